"""Benchmark: sign bits in the preconditioned EK-FAC eigenbasis against dense and factored rows.

EOGP-style rows, derived here from a wide dense index (not a stored format): per module, rotate the
stored k_o x k_i block G into the K-FAC eigenbasis, G̃ = Q_outᵀ G Q_in, scale each coordinate by
(Λ*[o, i] + λ)^-½ (EK-FAC eigenvalues Λ*, λ = damping · mean Λ*, as `gradian.curvature.factors`), keep the
n coordinates of largest Λ* (the scaled coordinates' variance Λ* / (Λ* + λ) orders them the same) and
store sign(G̃), one bit each. Scores, summed over modules:

    sign·sign   ⟨sign q̃, sign g̃⟩ = n - 2 · popcount(bits_q XOR bits_g)
    query·sign  ⟨q̃, sign g̃⟩ (the query kept in float32)

With every coordinate kept in float32, ⟨q̃, g̃⟩ is the ekfac score exactly (the symmetric form of
(F + λI)⁻¹). Beside them, in the same process: dense rows ranked by ekfac at widths 1024 and 256
(4096 and 1024 float32 bytes per module: the default row's bytes and a quarter of them), and ekfac
on the wide index itself (what the bits are cut from), also with every row scaled to unit norm in
the preconditioned eigenbasis (a control: sign rows all have one norm). Yardsticks, corpus, model, recall@10 and
LDS are bench_yardsticks.py's.

    python scripts/bench/bench_signbits.py [--wide 16384] [--keep 16384,8192,2048] [--seeds 3]
        [--yardsticks A,B,LDS] [--damping 0.1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from circuitkit.models.config import ModelConfig  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from gradian.index.curvature import KroneckerCurvature
from gradian.index.reader import IndexReader
from gradian.rank.checks import check_compatible
from gradian.rank.queries import query_gradients
from gradian.settings.grads import GradsConfig  # noqa: E402
from scripts.bench.bench_yardsticks import DAMPING, MODULES, Yardstick, lds_yardstick, planted_a, planted_b  # noqa: E402

# popcount of every byte value
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(N, n) real -> (N, ceil(n / 8)) uint8, bit set where x >= 0 (first coordinate in the high bit)."""
    n = x.shape[1]
    bits = (x >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -n % 8))  # padding bits are 0 in every row: they never differ
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return (bits.reshape(x.shape[0], -1, 8) * weights).sum(-1, dtype=torch.uint8)


def packed_sign_scores(q_bits: torch.Tensor, g_bits: torch.Tensor, n: int) -> torch.Tensor:
    """⟨sign q, sign g⟩ for packed sign vectors of n coordinates: (Q, B), (N, B) uint8 -> (Q, N) int32,
    n - 2 · Hamming distance."""
    differ = _POPCOUNT[(q_bits[:, None, :] ^ g_bits[None, :, :]).long()].sum(-1)
    return n - 2 * differ


def eigen_coordinates(rows: torch.Tensor, curvature: KroneckerCurvature, keep: int | None) -> torch.Tensor:
    """(N, Σ k_o k_i) stored rows -> (N, modules · keep) float32: per module the rotated block
    Q_outᵀ G Q_in scaled by (Λ* + λ)^-½, its `keep` coordinates of largest eigenvalue (in that order;
    keep None: every coordinate, (N, Σ k_o k_i))."""
    out, start = [], 0
    for m, (k_o, k_i) in enumerate(curvature.shapes):
        if keep is not None and keep > k_o * k_i:
            raise ValueError(f"keep={keep} coordinates, but module {m} has only {k_o * k_i} (k_o {k_o} x k_i {k_i}):"
                             " build the wide index wider (--wide) or keep fewer (--keep).")
        block = rows[:, start:start + k_o * k_i].double().reshape(-1, k_o, k_i)
        lam = curvature.eigenvalues[m]
        scaled = (curvature.q_out[m].T @ block @ curvature.q_in[m]) / (lam + curvature.lambdas[m]).sqrt()
        top = lam.flatten().argsort(descending=True, stable=True)[:k_o * k_i if keep is None else keep]
        out.append(scaled.reshape(-1, k_o * k_i)[:, top].float())
        start += k_o * k_i
    return torch.cat(out, dim=1)


def build(ys: Yardstick, loaded, width: int, seed: int, work: Path) -> Path:
    """A dense float32 Kronecker index of `width` per module with K-FAC factors (and its curvature file)."""
    grads = GradsConfig(data_path=str(ys.docs), batch_size=16, module_filter=getattr(ys, "modules", MODULES),
                        projection="kronecker", projection_dim=width, projection_seed=seed, storage_dtype="float32",
                        loss="ce", preconditioner="kfac")
    index_dir = work / f"{ys.name}_{width}_{seed}"
    build_index(ModelConfig(name=ys.model_dir, precision=ys.precision), grads, index_dir,
                Console(stderr=True, quiet=True), loaded=loaded)
    return index_dir


def index_scores(ys: Yardstick, loaded, index_dir: Path, damping: float, keeps: list[int]) -> dict[str, dict]:
    """style -> setup -> (Q, n_docs) float64 scores: ekfac on the index (and with unit rows), and per n in
    `keeps` the two sign scores."""
    reader = IndexReader(index_dir)
    projector = check_compatible(reader.manifest, loaded, index_dir)
    ids, grads = zip(*((r, g) for r, g, _ in reader.shards()), strict=True)
    ids, grads = torch.cat(ids), torch.cat(grads)
    curvature = KroneckerCurvature.from_index(reader, "ekfac", damping)
    n_modules = len(curvature.shapes)
    out: dict[str, dict] = {}
    for style, path in ys.queries.items():
        q, _ = query_gradients(reader.manifest, loaded, projector, path)
        full_q, full_g = eigen_coordinates(q, curvature, None), eigen_coordinates(grads, curvature, None)
        per = {"ekfac": full_q.double() @ full_g.double().T,
               # a control: is what the signs gain the normalisation of each row (every sign row has one norm)?
               "ekfac, unit rows": full_q.double() @ torch.nn.functional.normalize(full_g.double(), dim=1).T}
        for keep in keeps:
            cq, cg = eigen_coordinates(q, curvature, keep), eigen_coordinates(grads, curvature, keep)
            per[f"sign·sign n={keep}"] = packed_sign_scores(pack_signs(cq), pack_signs(cg), keep * n_modules).double()
            per[f"query·sign n={keep}"] = cq.double() @ torch.where(cg >= 0, 1.0, -1.0).double().T
        for name, s in per.items():  # columns in document order
            ordered = torch.zeros(s.shape[0], ys.n_docs, dtype=torch.float64)
            ordered[:, ids] = s
            per[name] = ordered
        out[style] = per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wide", type=int, default=16384, help="width per module of the index the bits are cut from")
    p.add_argument("--keep", default="16384,8192,2048", help="coordinates (bits) kept per module, comma list")
    p.add_argument("--dense-widths", default="1024,256", help="dense float32 rows ranked by ekfac beside them")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--yardsticks", default="A,B,LDS")
    p.add_argument("--damping", type=float, default=DAMPING)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from circuitkit.models.loading import load_model

    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)
    logging.getLogger("gradian.curvature.factors").setLevel(logging.ERROR)
    console = Console(width=200)
    keeps = [int(k) for k in args.keep.split(",") if k]
    dense_widths = [int(w) for w in args.dense_widths.split(",") if w]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="signbits_") as tmp:
        work = Path(tmp)
        for name in (y for y in args.yardsticks.split(",") if y):
            ys = {"A": lambda: planted_a(work, 24, 10), "B": lambda: planted_b(work, 24, 10),
                  "LDS": lambda: lds_yardstick(work, 16, console)}[name]()
            loaded = load_model(ModelConfig(name=ys.model_dir, precision=ys.precision), device=torch.device("cpu"))
            for seed in range(args.seeds):
                for width in [args.wide, *dense_widths]:
                    index_dir = build(ys, loaded, width, seed, work)
                    scores = index_scores(ys, loaded, index_dir, args.damping, keeps if width == args.wide else [])
                    for style, per in scores.items():
                        for setup, matrix in per.items():
                            dense = setup.startswith("ekfac")  # float32 rows; else one bit per kept coordinate
                            rows.append({"yardstick": name, "style": style, "seed": seed,
                                         "setup": f"dense {width}, {setup}" if dense else f"{setup} (of {width})",
                                         "bytes_per_module": 4 * width if dense else int(setup.rsplit("=", 1)[1]) // 8,
                                         **ys.evaluate(style, matrix)})
                console.print(f"[dim]{name} seed {seed} done ({time.perf_counter() - start:.0f} s)[/dim]")
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["yardstick"], r["style"], r["setup"], r["bytes_per_module"]), []).append(r)
    print("| yardstick | row | bytes / module | metric | mean ± sd (seeds) |")
    print("|---|---|---:|---|---:|")
    for (name, style, setup, nbytes), runs in groups.items():
        key = "lds" if "lds" in runs[0] else "r10"
        values = [r[key] for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"| {name} {style} | {setup} | {nbytes} | {'LDS' if key == 'lds' else 'recall@10'} |"
              f" {statistics.mean(values):.3f} ± {sd:.3f} |")
    console.print(f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads;"
                  f" wall {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
