"""Benchmark: rank time and disk of sign rows against dense rows at equal bytes, on large indexes.

Two synthetic indexes of the same N rows and M modules (rank time does not depend on what the
rows hold, only on their bytes and format): dense float16 rows of W values per module (the
product's default row: W = 1024, 2 W bytes per module) and sign rows of 16 W coordinates per
module (`grads.row_format=signs`, the same 2 W bytes). Both are written through `IndexWriter`
(shards of `--rows-per-shard` rows, sha256 in the manifest) and ranked by `gradian.rank.scores.stream_topk`
with Q queries: dense by cosine (ekfac streams the same matmul over the rows: its preconditioning is
of the queries only, `gradian.curvature.factors`), signs by cosine (XOR + popcount on 64-bit words,
`gradian.index.formats.signs`). Wall seconds, best of `--repeats` in one process, the page cache warm after the
first read; with each shard's sha256 checked as it is read (what `gradian rank` does) and without.

    python scripts/bench/bench_signs_rank.py [--rows 10000,100000] [--modules 4] [--width 1024]
        [--queries 1,8] [--repeats 3] [--work DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from gradian.index.formats.signs import packed_width
from gradian.index.writer import IndexWriter
from gradian.rank.scores import stream_topk


def header(fmt: str, modules: int, width: int) -> dict[str, Any]:
    """The manifest header of a synthetic index: `modules` modules of `width` coordinates each."""
    entries = {f"m{i}": {"shape": [4096, 4096], "width": width} for i in range(modules)}
    n = modules * width
    return {"projection": {"kind": "kronecker_orthogonal", "projection_dim": width, "seed": 0, "modules": entries},
            "storage_dtype": "float16", "row_format": fmt, "row_rank": None, "preconditioner": "none",
            "row_width": packed_width(n) if fmt == "signs" else n}


def write_index(index_dir: Path, fmt: str, n_rows: int, modules: int, width: int, rows_per_shard: int) -> float:
    """Write n_rows random rows; returns the bytes of the shards."""
    writer = IndexWriter(index_dir, header(fmt, modules, width), n_rows, rows_per_shard)
    g = torch.Generator().manual_seed(0)
    for k in writer.pending():
        start, end = writer.row_range(k)
        writer.write_shard(k, torch.randn(end - start, modules * width, generator=g), torch.arange(start, end))
    return sum(p.stat().st_size for p in index_dir.glob("shard-*.safetensors"))


def best_time(index_dir: Path, queries: torch.Tensor, verify: bool, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stream_topk(index_dir, queries, top_k=10, score="cosine", verify=verify)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="10000,100000")
    p.add_argument("--modules", type=int, default=4)
    p.add_argument("--width", type=int, default=1024, help="dense values per module (sign rows: 16 x as many bits)")
    p.add_argument("--queries", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows-per-shard", type=int, default=4096)
    p.add_argument("--work", type=Path, default=None, help="where the indexes are written (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    console = Console(width=160)
    results = []
    with tempfile.TemporaryDirectory(prefix="signs_rank_", dir=args.work) as tmp:
        for n_rows in (int(x) for x in args.rows.split(",") if x):
            built = {}
            for fmt, width in (("dense", args.width), ("signs", 16 * args.width)):
                index_dir = Path(tmp) / f"{fmt}_{n_rows}"
                start = time.perf_counter()
                disk = write_index(index_dir, fmt, n_rows, args.modules, width, args.rows_per_shard)
                built[fmt] = (index_dir, width, disk)
                console.print(f"[dim]{fmt} {n_rows} rows written in {time.perf_counter() - start:.0f} s[/dim]")
            for q in (int(x) for x in args.queries.split(",") if x):
                for verify in (True, False):
                    row: dict[str, Any] = {"rows": n_rows, "queries": q, "verify": verify}
                    for fmt, (index_dir, width, disk) in built.items():
                        queries = torch.randn(q, args.modules * width, generator=torch.Generator().manual_seed(1))
                        row[f"{fmt}_s"] = best_time(index_dir, queries, verify, args.repeats)
                        row[f"{fmt}_bytes_per_row"] = disk / n_rows
                    row["ratio"] = row["signs_s"] / row["dense_s"]
                    results.append(row)
                    console.print(row)
            for index_dir, _, _ in built.values():
                shutil.rmtree(index_dir)
    table = Table(title=f"stream_topk, cosine: sign rows ({16 * args.width} bits per module) against dense float16"
                        f" ({args.width} values per module), {args.modules} modules")
    for col in ("rows", "queries", "sha256 checked", "dense s", "signs s", "signs / dense", "bytes / row dense",
                "bytes / row signs"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r['rows']:,}", str(r["queries"]), "yes" if r["verify"] else "no", f"{r['dense_s']:.2f}",
                      f"{r['signs_s']:.2f}", f"{r['ratio']:.2f}", f"{r['dense_bytes_per_row']:.0f}",
                      f"{r['signs_bytes_per_row']:.0f}")
    console.print(table)
    console.print(f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
