"""Benchmark: indexing time of sign rows (the `grads=signs` preset) against the default dense rows on SmolLM2.

One process, the model loaded once before any clock; the rows are `bench_lengths.lengths_corpus`'s
(log-normal prompt and completion lengths, 29..497 tokens, mean about 124), rendered with SmolLM2's
tokenizer. Each setup builds a fresh index of every row (`gradian.build.indexer.build_index`), the setups
interleaved for `--rounds` rounds; the table gives each setup's median seconds and its median
per-round ratio to the default:

* **default**: the product's defaults (kronecker_orthogonal 1024 per module, float16, K-FAC factors);
* **signs, factor pass over every row**: conf/grads/signs.yaml with grads.factor_rows null: the eigen
  projection, 16384 per module, one bit per coordinate, the factor pass over all rows first;
* **signs, factor pass over a tenth**: the same with grads.factor_rows = rows / 10, what the
  preset's 2,000 sampled rows are for a 20,000-row corpus.

    python scripts/bench/bench_signs_index.py [--rows 200] [--rounds 2] [--modules all|mlp] [--json out.json]
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

import torch
from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from circuitkit.models.loading import load_model  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from scripts.bench.bench_lengths import lengths_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fetched:smollm2")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modules", default="all", help="grads.module_filter: all (the default, null) or a comma list")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)
    console = Console(width=160)
    modules = [] if args.modules == "all" else [f"grads.module_filter=[{args.modules}]"]
    setups = {"default": [], "signs, factor pass over every row": ["grads=signs", "grads.factor_rows=null"],
              f"signs, factor pass over a tenth ({args.rows // 10} rows)": ["grads=signs",
                                                                             f"grads.factor_rows={args.rows // 10}"]}
    times: dict[str, list[float]] = {name: [] for name in setups}
    info: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="signs_index_") as tmp:
        work = Path(tmp)
        _, cfg0 = compose([f"model.name={args.model}"])
        loaded = load_model(cfg0.model, keep_adapter=True)
        data = work / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in lengths_corpus(args.rows, loaded.tokenizer)))
        for rnd in range(args.rounds):
            for i, (name, overrides) in enumerate(setups.items()):
                _, cfg = compose([f"model.name={args.model}", f"grads.data_path={data}", *modules, *overrides])
                index_dir = work / f"round{rnd}_setup{i}"
                start = time.perf_counter()
                summary = build_index(cfg.model, cfg.grads, index_dir, Console(quiet=True), loaded=loaded)
                times[name].append(time.perf_counter() - start)
                info[name] = {"bytes": sum(f.stat().st_size for f in index_dir.iterdir() if f.is_file()),
                              "padding_share": summary["padding_share"], "row_width": summary.get("row_width")}
                console.print(f"[dim]round {rnd}: {name}: {times[name][-1]:.1f} s[/dim]")
    base = times["default"]
    table = Table(title=f"build_index on {args.model}, {args.rows} rows of varied length ({args.modules} modules),"
                        f" median of {args.rounds} rounds")
    for col in ("setup", "seconds", "ratio to default (median per round)", "index bytes", "padding share"):
        table.add_column(col, justify="right")
    rows = []
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        rows.append({"setup": name, "seconds": ts, "ratio": ratio, **info[name]})
        table.add_row(name, f"{statistics.median(ts):.1f}", f"{ratio:.2f}", f"{info[name]['bytes']:,}",
                      f"{info[name]['padding_share']:.1%}")
    console.print(table)
    console.print(f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
