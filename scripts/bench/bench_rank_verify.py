"""Benchmark: what checking each shard's sha256 costs `gradian rank`, side by side in one run.

A synthetic index shaped like a GPT-2-small index of the 12 MLP output projections at
projection_dim 1024 (row width 12 x 1024 = 12288, float16: 24 KiB per row), `--rows` rows in
shards of `--rows-per-shard`, streamed by `stream_topk` against `--queries` random queries:

* **verify**: the default; each shard's bytes are read once, hashed, then parsed.
* **no-verify**: `--no-verify`; each shard is memory-mapped and parsed, nothing hashed.

The two are run alternately `--repeats` times after one warm-up pass of each (the page cache
then holds the index, as it does on a machine that ranks repeatedly; a cold disk adds the
same read time to both). Prints the median seconds of each and the ratio.

    python scripts/bench/bench_rank_verify.py [--rows 8192] [--rows-per-shard 4096] [--queries 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gradian.index.writer import IndexWriter
from gradian.rank.scores import stream_topk

WIDTH = 12 * 1024


def build(index_dir: Path, n_rows: int, rows_per_shard: int) -> int:
    """Write the synthetic index; returns its size in bytes."""
    writer = IndexWriter(index_dir, {"storage_dtype": "float16", "row_width": WIDTH}, n_rows, rows_per_shard)
    gen = torch.Generator().manual_seed(0)
    for k in writer.pending():
        start, end = writer.row_range(k)
        writer.write_shard(k, torch.randn(end - start, WIDTH, generator=gen), torch.arange(start, end))
    return sum(p.stat().st_size for p in index_dir.glob("shard-*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rows-per-shard", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="bench-rank-verify-") as tmp:
        index_dir = Path(tmp) / "index"
        size = build(index_dir, args.rows, args.rows_per_shard)
        queries = torch.randn(args.queries, WIDTH, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {"verify": [], "no-verify": []}
        for rep in range(args.repeats + 1):
            for name in ("verify", "no-verify"):
                start = time.perf_counter()
                top = stream_topk(index_dir, queries, 10, "cosine", "mean", verify=name == "verify")
                if rep:  # the first pass of each warms the page cache
                    times[name].append(time.perf_counter() - start)
            assert top["query_rows"].shape == (args.queries, 10)
        # The hash alone, over the same bytes, for scale.
        start = time.perf_counter()
        for path in sorted(index_dir.glob("shard-*.safetensors")):
            hashlib.sha256(path.read_bytes()).hexdigest()
        hash_s = time.perf_counter() - start
    verify, plain = statistics.median(times["verify"]), statistics.median(times["no-verify"])
    table = Table(title=f"stream_topk over {args.rows} rows x {WIDTH} float16 ({size / 2**20:.0f} MiB,"
                        f" {args.rows // args.rows_per_shard} shards), {args.queries} queries, median of"
                        f" {args.repeats}")
    for col in ("mode", "seconds", "MiB/s", "ratio"):
        table.add_column(col, justify="right")
    table.add_row("no-verify", f"{plain:.3f}", f"{size / 2**20 / plain:.0f}", "1.00")
    table.add_row("verify (default)", f"{verify:.3f}", f"{size / 2**20 / verify:.0f}", f"{verify / plain:.2f}")
    table.add_row("sha256 alone", f"{hash_s:.3f}", f"{size / 2**20 / hash_s:.0f}", "")
    Console().print(table)


if __name__ == "__main__":
    main()
