"""Scale-out on one machine: 1, 2 and 3 local workers (Hydra's joblib launcher) for sharded
attribution and sharded gradient indexing, measured side by side in one run.

    python scripts/bench/bench_scale_out.py [--workers 1 2 3] [--examples 48] [--rows 360] [--json out.json]

Each configuration is one `python -m circuitkit.run` command, timed from start to exit (process
start-up, model load and the merge included, as a user waits for it): 1 worker is a plain run,
N > 1 a multirun with `hydra/launcher=local hydra.launcher.n_jobs=N` and num_shards=N. Threads
are left as each launcher sets them (a single run uses every core; joblib gives each of N
workers cpu_count // N). The merge cost is timed separately: `circuitkit merge --no-prune` over
the N shard run dirs (read, check, add, write), and the merging shard's attribution stage time
against the others' (the merging one also writes the merged scores and the heatmap). Each job's
own stage time (from its manifest) shows how the work itself split, apart from start-up.
Ratios are to the 1-worker wall time of the same run.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ATTRIBUTION = ["stages=[data,attribution]", "model=induction", "model.precision=float32", "discovery.level=node",
               "discovery.ig_steps=5", "discovery.batch_size=4", "discovery.data_params.eval_examples=4"]
INDEX = ["stages=[grads]", "model=induction", "model.precision=float32", "grads.projection_dim=64",
         "grads.rows_per_shard=64", "grads.batch_size=8"]


def _rows(path: Path, n: int) -> Path:
    """Induction-style training rows of the fixture's symbols (prompt + completion)."""
    from circuitkit.fixtures.models import synthetic_corpus

    sentences = synthetic_corpus(2 * n + 4, seed=2)
    rng = random.Random(0)
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": " ".join(sentences[2 * i: 2 * i + rng.randint(1, 2)]),
                                 "completion": " " + sentences[2 * i + 1]}) + "\n")
    return path


def _timed(args: list[str]) -> float:
    env = {**os.environ, "COLUMNS": "160"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr[-3000:]}")
    return wall


def _run(kind: str, workers: int, common: list[str], root: Path) -> dict:
    out = root / f"{kind}-{workers}"
    stage = "grads" if kind == "index" else "attribution"
    if workers == 1:
        extra = [f"grads.index_dir={out / 'index'}"] if kind == "index" else []
        wall = _timed([*common, *extra, f"hydra.run.dir={out}"])
        from circuitkit.core.pipeline import load_manifest

        return {"kind": kind, "workers": workers, "wall_s": wall,
                "stage_s": [load_manifest(out)["stages"][stage]["wall_s"]]}
    key = "grads" if kind == "index" else "discovery"
    extra = [f"grads.index_dir={out / 'index'}"] if kind == "index" else []
    wall = _timed(["-m", "hydra/launcher=local", f"hydra.launcher.n_jobs={workers}", *common, *extra,
                   f"{key}.num_shards={workers}", f"{key}.shard_index=range({workers})", f"hydra.sweep.dir={out}"])
    row = {"kind": kind, "workers": workers, "wall_s": wall}
    from circuitkit.core.pipeline import load_manifest

    row["stage_s"] = [load_manifest(out / str(i))["stages"][stage]["wall_s"] for i in range(workers)]
    if kind == "attribution":
        from circuitkit_app.merge import merge_run_dirs

        run_dirs = [out / str(i) for i in range(workers)]
        t0 = time.perf_counter()
        merge_run_dirs(run_dirs, out / "merged", prune=False, console=Console(file=open(os.devnull, "w")))
        row["merge_s"] = time.perf_counter() - t0
        stages = [load_manifest(d)["stages"]["attribution"] for d in run_dirs]
        merger = [s for s in stages if s["summary"].get("merged")]
        others = [s["wall_s"] for s in stages if not s["summary"].get("merged")]
        row["merging_shard_stage_s"] = merger[0]["wall_s"] if merger else None
        row["other_shards_stage_s"] = sum(others) / len(others) if others else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--examples", type=int, default=48, help="attribution examples")
    parser.add_argument("--rows", type=int, default=360, help="rows to index")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        root = Path(tmp)
        data = _rows(root / "rows.jsonl", args.rows)
        attribution = [*ATTRIBUTION, f"discovery.data_params.num_examples={args.examples}"]
        index = [*INDEX, f"grads.data_path={data}"]
        for kind, common in (("attribution", attribution), ("index", index)):
            for workers in args.workers:
                console.print(f"{kind}, {workers} worker(s) ...")
                rows.append(_run(kind, workers, common, root))
    table = Table(title=f"scale-out on this machine ({os.cpu_count()} cores): {args.examples} attribution examples,"
                        f" {args.rows} index rows")
    for col in ("stage", "workers", "wall s", "speed-up vs 1", "stage s per job", "merge s (circuitkit merge)",
                "merging shard's stage s", "other shards' stage s"):
        table.add_column(col, justify="right")
    base = {r["kind"]: r["wall_s"] for r in rows if r["workers"] == 1}
    def fmt(r, key):
        return "-" if r.get(key) is None else f"{r[key]:.2f}"
    for r in rows:
        speed = f"{base[r['kind']] / r['wall_s']:.2f}x" if r["kind"] in base else "-"
        table.add_row(r["kind"], str(r["workers"]), f"{r['wall_s']:.1f}", speed,
                      " / ".join(f"{x:.1f}" for x in r["stage_s"]), fmt(r, "merge_s"),
                      fmt(r, "merging_shard_stage_s"), fmt(r, "other_shards_stage_s"))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
