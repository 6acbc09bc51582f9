"""Benchmark: peak memory of `gradian index` as the corpus grows (10^4, 10^5, 10^6 rows).

Each size runs `gradian index` in a fresh process on the built-in tiny GPT-2 over a generated
JSONL corpus (deterministic; short rows, prompts of 2-6 words and completions of 1-2, so that a
million rows index in minutes on two cores: what is measured is memory) and reads that
process's peak resident memory (`os.wait4`'s ru_maxrss, the high-water mark of the whole
process: Python, torch, the model, the tokenized corpus and the index writer). Memory that grows
with the row count shows as a ratio above 1 against the smallest size.

    python scripts/bench/bench_streaming.py [--sizes 10000 100000 1000000] [--rows-per-shard 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had not "
         "but what all when there can more one so out up if about who get would make like time just him know "
         "take people into year your good some could them see other than then now look only come its over").split()


def write_corpus(path: Path, n_rows: int, seed: int = 0) -> Path:
    """n_rows prompt/completion rows, written in chunks (the generator holds no list of rows)."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n_rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            completion = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def run_index(data: Path, index_dir: Path, rows_per_shard: int) -> dict:
    """`gradian index` in a child process; its wall time and peak RSS."""
    cmd = [sys.executable, "-m", "circuitkit_app.gradian_cli", "index", f"grads.data_path={data}", f"grads.index_dir={index_dir}",
           "grads.batch_size=512", "grads.projection_dim=16", "grads.module_filter=[mlp.c_proj]",
           f"grads.rows_per_shard={rows_per_shard}", "model.precision=float32"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "120"})
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"gradian index failed:\n{stderr[-3000:]}")
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--rows-per-shard", type=int, default=4096,
                   help="grads.rows_per_shard (the config default). A shard's rows and gradients are held "
                        "until it is written, so the smallest size should fill at least one shard: otherwise "
                        "the bounded per-shard working set shows as growth")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    console = Console()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            data = write_corpus(Path(tmp) / f"corpus_{n}.jsonl", n)
            console.print(f"{n} rows: {data.stat().st_size / 2**20:.1f} MiB of JSONL, indexing ...")
            res = {"rows": n, "file_mib": round(data.stat().st_size / 2**20, 1), **run_index(data, Path(tmp) / f"idx_{n}", args.rows_per_shard)}
            results.append(res)
            data.unlink()
    base = results[0]["peak_rss_mib"]
    table = Table(title="gradian index: peak RSS vs corpus size (tiny GPT-2, float32)")
    for col in ("rows", "JSONL MiB", "wall s", "rows/s", "peak RSS MiB", "vs smallest"):
        table.add_column(col, justify="right")
    for r in results:
        r["ratio"] = round(r["peak_rss_mib"] / base, 3)
        table.add_row(f"{r['rows']:,}", f"{r['file_mib']}", f"{r['wall_s']}", f"{r['rows'] / r['wall_s']:.0f}",
                      f"{r['peak_rss_mib']}", f"{r['ratio']:.3f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
