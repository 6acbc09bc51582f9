"""`circuitkit merge RUN_DIRS... [--out DIR] [--no-prune]`: merge attribution shards by hand.

The last shard of a sweep merges on its own (circuitkit.discovery.attribution.shards); this command is
for shards that ran where they cannot meet (different machines, different sweep dirs) or when
the automatic merge was refused. It reads each run dir's `attribution_shard.safetensors`,
refuses shards of different configs, models or data naming the key, writes the merged
`scores.safetensors` (with the shards' per-example scores in example order, as one job's),
`data.safetensors` and `merge.json` into DIR (each shard verified against
the sha256 its run dir's manifest.json recorded for it), and runs the pruning stage
there on the merged scores with the shards' config (skip with --no-prune).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from rich.console import Console

from circuitkit.core.errors import UserError

USAGE = "circuitkit merge RUN_DIR [RUN_DIR ...] [--out DIR] [--no-prune]"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="circuitkit merge", usage=USAGE,
                                     description="Merge attribution shards (discovery.num_shards > 1) into one"
                                                 " scores.safetensors, then prune on it.")
    parser.add_argument("run_dirs", nargs="+", help="run directories of the shards (each holds attribution_shard.safetensors)")
    parser.add_argument("--out", default=None, help="where the merged run goes; default <first run dir>/../merged")
    parser.add_argument("--no-prune", action="store_true", help="only merge the scores; do not run the pruning stage")
    return parser


def merge_run_dirs(run_dirs: list[Path], out: Path, prune: bool = True, console: Console | None = None) -> dict:
    """Merge the shards of `run_dirs` into `out`; returns out's manifest (or the merge record
    when `prune` is False). UserError naming what is wrong for a missing or mismatched shard."""
    from circuitkit.core.io import atomic_write_json
    from circuitkit.core.pipeline import MANIFEST, load_manifest, make_console
    from circuitkit.discovery.attribution import save_scores
    from circuitkit.discovery.attribution.shards import (
        MERGE_RECORD,
        PARTIAL_FILE,
        load_partial,
        merge_partials,
        per_example_record,
        shard_records,
    )
    from circuitkit.discovery.stages import HELDOUT_TEMPLATES_FILE
    from circuitkit_app.config import validate
    from circuitkit_app.stage_list import run_pipeline

    console = console or make_console()
    partials = []
    for run_dir in run_dirs:
        path = Path(run_dir) / PARTIAL_FILE
        if not path.is_file():
            raise UserError(f"{run_dir} has no {PARTIAL_FILE}: give the run dirs of attribution shards"
                            " (discovery.num_shards > 1) whose attribution stage finished.", exit_code=2)
        partials.append(load_partial(path, run_dir=Path(run_dir)))  # verified against that run's manifest
    merged = merge_partials(partials)  # refuses mismatched shards, naming the key
    first = Path(run_dirs[0])
    config = load_manifest(first).get("config")
    if config is None:
        raise UserError(f"{first / MANIFEST} is missing or has no config; it is not a pipeline run dir.", exit_code=2)
    cfg = validate(config)
    d = cfg.discovery
    out.mkdir(parents=True, exist_ok=True)
    save_scores(out / "scores.safetensors", merged, {"model": cfg.model.name, "task": d.task,
                                                     "prepend_bos": str(d.data_params.prepend_bos).lower()})
    shutil.copyfile(first / "data.safetensors", out / "data.safetensors")
    if (first / HELDOUT_TEMPLATES_FILE).is_file():  # the pairs from held-out templates pruning also measures
        shutil.copyfile(first / HELDOUT_TEMPLATES_FILE, out / HELDOUT_TEMPLATES_FILE)
    records = shard_records(partials)
    per_example = per_example_record(partials, merged)
    record = {"merged_by": "circuitkit merge", "n_examples": merged.n_examples, "shards": records, **per_example}
    atomic_write_json(out / MERGE_RECORD, record)
    console.print(f"merged {len(partials)} shards ({merged.n_examples} examples) into {out / 'scores.safetensors'}",
                  markup=False)
    if "per_example_missing" in per_example:
        console.print(f"note: {per_example['per_example_missing']}", markup=False)
    if not prune:
        return record
    manifest = load_manifest(out)
    manifest["attribution_shards"] = records
    atomic_write_json(out / MANIFEST, manifest)
    return run_pipeline(dataclasses.replace(cfg, stages=["pruning"]), out, console)


def main(argv: list[str]) -> int:
    """Entry of `circuitkit merge`; returns the exit status."""
    args = _parser().parse_args(argv)
    run_dirs = [Path(p) for p in args.run_dirs]
    out = Path(args.out) if args.out else run_dirs[0].resolve().parent / "merged"
    merge_run_dirs(run_dirs, out, prune=not args.no_prune)
    return 0
