"""Benchmark: `gradian rank --top-k K --out FILE`, terminal output before and after the summary.

Before, the whole ranking (queries x K rows plus the aggregate) was rendered as one rich table
even when it also went to a file; now the file gets everything and the terminal a summary
(gradian.cli.SUMMARY_QUERIES queries x SUMMARY_RANKS ranks and the aggregate's). One `rank()`
call computes the results, then both renderings run side by side on them, to a 120-column
console writing into memory (what a terminal would receive).

Builds a `--rows`-row index of the tiny GPT-2 fixture (float32, projection dim 16) and ranks
`--queries` of its rows against it.

    python scripts/bench/bench_rank_out.py [--rows 700] [--queries 10] [--top-k 600]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from circuitkit.models.config import ModelConfig
from gradian.build.indexer import build_index
from gradian.cli import SUMMARY_QUERIES, SUMMARY_RANKS, _results_table
from gradian.rank.ranking import rank
from gradian.settings.grads import GradsConfig


def _render(table: Table) -> float:
    console = Console(file=io.StringIO(), width=120, force_terminal=True)
    start = time.perf_counter()
    console.print(table)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=700)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rank-out-") as tmp:
        root = Path(tmp)
        rows = [{"prompt": f"Item {i} is ", "completion": f"number {i * 7 % 101} of {i % 13}."} for i in range(args.rows)]
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[: args.queries]))
        grads = GradsConfig(data_path=str(root / "train.jsonl"), projection_dim=16, batch_size=16)
        start = time.perf_counter()
        build_index(ModelConfig(precision="float32"), grads, root / "index")
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        results = rank(root / "index", root / "q.jsonl", top_k=args.top_k, out_path=root / "ranked.jsonl")
        rank_s = time.perf_counter() - start
    full_s = _render(_results_table("full", results))
    queries = list(dict.fromkeys(r["query"] for r in results if r["query"] != "aggregate"))
    keep = set(queries[:SUMMARY_QUERIES]) | {"aggregate"}
    summary = [r for r in results if r["query"] in keep and r["rank"] <= SUMMARY_RANKS]
    summary_s = _render(_results_table("summary", summary))
    table = Table(title=f"rank --top-k {args.top_k} --out: {args.queries} queries, {args.rows}-row index"
                        f" (built in {build_s:.1f} s)")
    for col in ("what", "table rows", "seconds", "command total (s)"):
        table.add_column(col, justify="right")
    table.add_row("rank() (model, queries, stream, file)", "", f"{rank_s:.2f}", "")
    table.add_row("before: full table", str(len(results)), f"{full_s:.2f}", f"{rank_s + full_s:.2f}")
    table.add_row("after: summary", str(len(summary)), f"{summary_s:.3f}", f"{rank_s + summary_s:.2f}")
    Console().print(table)
    print(f"terminal output: {full_s / summary_s:.0f}x faster; whole command {(rank_s + full_s) / (rank_s + summary_s):.1f}x")


if __name__ == "__main__":
    main()
