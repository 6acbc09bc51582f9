"""Experiment: does a data-dependent Kronecker projection beat a random one at the same width?

The question: K-FAC / EK-FAC in the projected space within reach of the unprojected scores
at width 1024. The projection is where the information goes, so this script tries projections
other than the seeded random ones, at the same width, on bench_yardsticks' yardsticks (A, B,
LDS; MLP modules, loss ce, EK-FAC):

* ``kronecker``, ``orthogonal``: the library's kinds (3 projection seeds).
* ``pca``: each factor's rows are the top eigenvectors of the module's *full* K-FAC factor
  (A = Σ x xᵀ / N, S = Σ δ δᵀ / n, from an unprojected index), as LoGra's PCA initialisation:
  the K-FAC score in that space is the exact full score truncated to the leading eigen-directions.
* ``half_pca``: half of each factor's rows from the top eigenvectors, the other half random
  (orthogonalised against them).
* ``whiten``: the full factors' damped inverse square roots applied before a random projection
  (P_out (S + λ_S)^-½ δ, P_in (A + λ_A)^-½ x, λ = √damping x mean eigenvalue per factor), so the
  projected rows estimate the full K-FAC inner product by Johnson-Lindenstrauss; ranked with
  ``cosine`` and with ``ekfac`` on top. ``whiten_orthogonal``: the same with orthonormal random factors;
  now a library option, ``grads.projection=whitened`` (`gradian.curvature.whitening`: the same
  damping, its factor pass in the indexer, the matrices stored with the index), measured through
  ``bench_yardsticks.py --projections whitened``.
* ``proportional``: the library's random Kronecker factors with k_o / k_i split in proportion to
  d_out / d_in (equal shares of each side) instead of balanced (k_o ≈ k_i).

The data-dependent kinds are not library options: this script swaps them into
`gradian.projection.projector` for its own indexes only (the index and its queries then use the same
matrices, and the fingerprint covers them).

    python scripts/experiments/exp_projection_basis.py --yardstick LDS [--fisher sampled] [--width 1024] [--work DIR]
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import scripts.bench.bench_yardsticks as by  # noqa: E402
from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from gradian.curvature import factors as cv  # noqa: E402
from gradian.index.reader import IndexReader
from gradian.projection import projector as gp  # noqa: E402
from gradian.settings.grads import GradsConfig  # noqa: E402

KINDS = ("kronecker", "orthogonal", "pca", "half_pca", "whiten", "whiten_orthogonal", "proportional")


def full_factors(ys: by.Yardstick, work: Path, fisher: str) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per module (q_in, e_in, q_out, e_out) of the full K-FAC factors, eigenvalues descending."""
    raw_dir = work / f"{ys.name}_raw_{fisher}"
    if not (raw_dir / "manifest.json").is_file():
        cfg = ModelConfig(name=ys.model_dir, precision="float32")
        grads = GradsConfig(data_path=str(ys.docs), batch_size=16, module_filter=by.MODULES, projection_dim=None,
                            storage_dtype="float32", loss="ce", preconditioner="kfac", fisher=fisher)
        build_index(cfg, grads, raw_dir, Console(quiet=True),
                    loaded=load_model(cfg, device=torch.device("cpu")))
    reader = IndexReader(raw_dir)
    a_tot, s_tot, tokens = cv._read_shard_factors(reader)
    n_rows = cv.n_rows_of(reader.manifest)
    out = {}
    for m, name in enumerate(reader.manifest["projection"]["modules"]):
        qa, ea, qs, es = cv._basis(a_tot[m], s_tot[m], n_rows, tokens)
        out[name] = (qa.flip(1), ea.flip(0), qs.flip(1), es.flip(0))
    return out


def patched_matrices(kind: str, factors: dict, damping: float):
    """A replacement for Projector.kronecker_matrices that draws `kind`'s factors."""
    random_matrices = gp.Projector.kronecker_matrices

    def top(q: torch.Tensor, k: int) -> torch.Tensor:
        return q[:, :k].T.float() * math.sqrt(q.shape[0] / k)

    def half(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        h = p.shape[0] // 2
        lead = q[:, :h].T.float()
        rest = p[h:] - (p[h:] @ lead.T) @ lead
        return torch.cat([lead * math.sqrt(q.shape[0] / p.shape[0]), rest])

    def whitener(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return (q * (e + math.sqrt(damping) * e.mean()).rsqrt()) @ q.T

    def matrices(self, name, device="cpu"):
        p_out, p_in = random_matrices(self, name, device)
        if name not in factors:
            return p_out, p_in
        qa, ea, qs, es = factors[name]
        if kind == "pca":
            return top(qs, p_out.shape[0]).to(device), top(qa, p_in.shape[0]).to(device)
        if kind == "half_pca":
            return half(qs, p_out).to(device), half(qa, p_in).to(device)
        return ((p_out.double() @ whitener(qs, es)).float().to(device),
                (p_in.double() @ whitener(qa, ea)).float().to(device))

    return matrices


def proportional_factors(n: int, d_out: int, d_in: int, name: str = "") -> tuple[int, int]:
    pairs = [(a, b) for a, b in gp._factor_pairs(n) if a <= d_out and b <= d_in]
    return min(pairs, key=lambda ab: abs(math.log((ab[0] / d_out) / (ab[1] / d_in))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yardstick", default="LDS", choices=("A", "B", "LDS"))
    p.add_argument("--fisher", default="empirical", choices=("empirical", "sampled"))
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--work", type=Path, default=Path("outputs/exp_projection_basis"))
    args = p.parse_args(argv)
    console = Console(width=160)
    args.work.mkdir(parents=True, exist_ok=True)
    ys = {"LDS": lambda: by.lds_yardstick(args.work, 16, console), "A": lambda: by.planted_a(args.work, 24, 10),
          "B": lambda: by.planted_b(args.work, 24, 10)}[args.yardstick]()
    factors = full_factors(ys, args.work, args.fisher)
    original = (gp.Projector.kronecker_matrices, gp.kronecker_factors)
    results: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    quiet = Console(quiet=True)
    for kind in [k for k in args.kinds.split(",") if k]:
        if kind not in KINDS:
            raise SystemExit(f"--kinds: unknown {kind!r}; valid: {', '.join(KINDS)}")
        data_dependent = kind in ("pca", "half_pca", "whiten", "whiten_orthogonal")
        if data_dependent:
            gp.Projector.kronecker_matrices = patched_matrices(kind.removesuffix("_orthogonal"), factors,
                                                               by.DAMPING / 10)
        if kind == "proportional":
            gp.kronecker_factors = proportional_factors
        projection = "kronecker_orthogonal" if kind.endswith("orthogonal") else "kronecker"
        scores = ("ekfac", "cosine") if kind.startswith("whiten") else ("ekfac",)
        rows = by.run_yardstick(ys, [args.width], 1 if kind == "pca" else args.seeds, ["ce"], args.work / "idx",
                                quiet, wanted=scores, dampings=(0.01,),
                                raw_too=False, fisher=args.fisher, projection=projection)
        gp.Projector.kronecker_matrices, gp.kronecker_factors = original
        for r in rows:
            for metric in ("lds", "r1", "r10"):
                if metric in r:
                    label = kind if r["score"].startswith("ekfac") else f"{kind}, {r['score']}"
                    results[(label, r["style"], metric)].append(r[metric])
        console.print(f"[dim]{kind} done[/dim]")
    table = Table(title=f"yardstick {args.yardstick}, width {args.width}, EK-FAC λ=0.01, fisher {args.fisher}"
                        " (mean over projection seeds; pca: one, it has no seed)")
    table.add_column("projection")
    cols = sorted({(style, metric) for _, style, metric in results})
    for style, metric in cols:
        table.add_column(f"{style} {metric}", justify="right")
    for kind in dict.fromkeys(k for k, _, _ in results):
        table.add_row(kind, *[f"{statistics.mean(results[(kind, s, m)]):.3f}" if (kind, s, m) in results else "-"
                              for s, m in cols])
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
