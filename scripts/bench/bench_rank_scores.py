"""Benchmark: rank-time cost of the preconditioned scores, as ratios to cosine in one run.

Writes a synthetic index (random rows, `--rows` x `--modules` blocks of `--dim`, float16, in
shards of 4096, with the per-module second moments and the K-FAC factors of
grads.preconditioner=module+kfac, and the EK-FAC curvature file) through `IndexWriter` and
`finalize_curvature`, so the files are what `gradian index` writes, then times `stream_topk`
(sha256 check, reading, scoring, top-k) for each score with `--queries` query rows, best of
`--repeat`. The preconditioners' one-off cost (adding the shards' sums and one Cholesky
factorisation per module; reading the curvature file) is part of the influence / whitened /
kfac / ekfac times. Widths above 4096 have no module second moments (kfac and ekfac only).

    python scripts/bench/bench_rank_scores.py [--rows 20000] [--modules 8] [--dim 256] [--queries 10,100]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gradian.build.indexer import finalize_curvature
from gradian.curvature.factors import FactorSums
from gradian.index.writer import IndexWriter
from gradian.projection.projector import kronecker_factors
from gradian.rank.scores import SCORES, stream_topk


def write_index(index_dir: Path, rows: int, modules: int, dim: int) -> list[str]:
    """The index; returns the scores it supports."""
    k_o, k_i = kronecker_factors(dim, 4096, 4096)
    names = {f"m{i}": {"shape": [4096, 4096], "width": dim, "factors": [k_o, k_i]} for i in range(modules)}
    module = dim <= 4096
    header = {"storage_dtype": "float16", "preconditioner": "module+kfac" if module else "kfac",
              "row_width": modules * dim,
              "projection": {"kind": "kronecker", "projection_dim": dim, "seed": 0, "modules": names}}
    writer = IndexWriter(index_dir, header, rows, 4096)
    gen = torch.Generator().manual_seed(0)
    # Rows with a shared direction per module, as gradients have: whitening has something to undo.
    shared = torch.randn(modules * dim, generator=gen)
    for k in writer.pending():
        start, end = writer.row_range(k)
        grads = torch.randn(end - start, modules * dim, generator=gen) + 3 * shared
        factors = FactorSums(list(names))
        for name in names:  # factors of random positions (the scores' cost does not depend on them)
            factors.add(name, torch.randn(1, 8 * (end - start), k_i, generator=gen),
                        torch.randn(1, 8 * (end - start), k_o, generator=gen))
        factors.add_tokens(8 * (end - start))
        writer.write_shard(k, grads, torch.arange(start, end), second_moment_blocks=modules if module else None,
                           extra_tensors=factors.tensors())
    finalize_curvature(index_dir)
    return [s for s in SCORES if module or s not in ("influence", "whitened")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--modules", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--queries", default="10,100")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    table = Table(title=f"stream_topk over {args.rows} rows x {args.modules} modules x {args.dim} (float16),"
                        f" top 10, best of {args.repeat}")
    for col in ("queries", "score", "seconds", "ratio to cosine"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="bench_rank_scores_") as tmp:
        index_dir = Path(tmp) / "index"
        scores = write_index(index_dir, args.rows, args.modules, args.dim)
        for n_queries in (int(q) for q in args.queries.split(",")):
            q = torch.randn(n_queries, args.modules * args.dim, generator=torch.Generator().manual_seed(1))
            seconds = {}
            for score in scores:
                times = []
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    stream_topk(index_dir, q, top_k=10, score=score)
                    times.append(time.perf_counter() - start)
                seconds[score] = min(times)
            for score in scores:
                table.add_row(str(n_queries), score, f"{seconds[score]:.3f}", f"{seconds[score] / seconds['cosine']:.2f}")
    Console(width=120).print(table)
    print(f"{torch.get_num_threads()} torch threads")


if __name__ == "__main__":
    main()
