"""Projection fidelity: do projected gradients keep the inner products (and rankings) of exact ones?

On the tiny Llama fixture's two down_proj modules (64 x 128 each), 24 clustered rows (6 groups
of near-duplicates): for each projection kind and projection_dim, the Pearson correlation of
all pairwise inner products (off-diagonal) between projected and exact per-example gradients,
and the top-10 overlap (for each row, how many of its 10 nearest rows by exact inner product
are also among its 10 nearest by projected inner product), averaged over seeds; plus the
effect of the storage dtype at one size.

    python scripts/bench/bench_projection.py [--seeds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from rich.console import Console
from rich.table import Table

from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.loading import load_model
from gradian.capture.gradients import per_example_gradients
from gradian.projection.projector import Projector

DIMS = (64, 256, 1024, 4096)


def clustered_batch(groups: int = 6, variants: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    """Near-duplicate groups (25 % of tokens resampled), supervised from position 8 on."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(5, 250, (groups, 1, length), generator=g).expand(groups, variants, length)
    flip = torch.rand(groups, variants, length, generator=g) < 0.25
    ids = torch.where(flip, torch.randint(5, 250, (groups, variants, length), generator=g), base)
    ids = ids.reshape(groups * variants, length)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, 8:] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervised": sup}


def fidelity(exact: torch.Tensor, approx: torch.Tensor, k: int = 10) -> tuple[float, float]:
    """(Pearson of off-diagonal inner products, mean top-k overlap) of row matrices (n, width)."""
    n = exact.shape[0]
    ge, ga = exact @ exact.T, approx @ approx.T
    iu = torch.triu_indices(n, n, 1)
    pearson = torch.corrcoef(torch.stack([ge[iu[0], iu[1]], ga[iu[0], iu[1]]]))[0, 1].item()
    eye = torch.eye(n, dtype=torch.bool)
    top_e = ge.masked_fill(eye, float("-inf")).topk(k, dim=1).indices
    top_a = ga.masked_fill(eye, float("-inf")).topk(k, dim=1).indices
    overlap = statistics.mean(len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_e, top_a, strict=True))
    return pearson, overlap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lm = load_model(ModelConfig(name="builtin:tiny-llama", precision="float32"))
    modules = select_modules(lm.model, lm.adapter, ["down_proj"])
    shapes = module_shapes(modules)
    batch = clustered_batch()
    exact = per_example_gradients(lm.model, lm.adapter, modules, Projector(shapes, projection_dim=None), batch).row()
    results = []
    for kind in ("kronecker", "dense"):
        for dim in DIMS:
            runs = []
            for seed in range(args.seeds):
                approx = per_example_gradients(lm.model, lm.adapter, modules, Projector(shapes, kind, dim, seed),
                                               batch).row()
                runs.append(fidelity(exact, approx))
            results.append({"kind": kind, "dim": dim, "storage": "float32",
                            "pearson": statistics.mean(r[0] for r in runs),
                            "top10": statistics.mean(r[1] for r in runs)})
    for dtype in (torch.bfloat16, torch.float16):
        approx = per_example_gradients(lm.model, lm.adapter, modules, Projector(shapes, "kronecker", 1024, 0),
                                       batch).row()
        p, o = fidelity(exact, approx.to(dtype).float())
        results.append({"kind": "kronecker", "dim": 1024, "storage": str(dtype).split(".")[1], "pearson": p,
                        "top10": o})
    table = Table(title=f"projection fidelity, tiny-llama down_proj (2 x 64 x 128), 24 clustered rows,"
                        f" mean of {args.seeds} seeds")
    for col in ("kind", "projection_dim", "storage", "Pearson (pairwise inner products)", "top-10 overlap"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["kind"], str(r["dim"]), r["storage"], f"{r['pearson']:.3f}", f"{r['top10']:.3f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
