"""The preflight's circuit-stage estimates before and after they read the tokenized prompts
(`circuitkit.discovery.data_lengths`), against the peaks a run measured.

Run the circuit stages first, then point this at the run directory with the same config:

    python -m circuitkit.run --config-name demo_real 'stages=[preflight,data,attribution,pruning]' \\
        report.enabled=false pruning.graph=false hydra.run.dir=/tmp/smollm2_ioi
    python scripts/bench/check_preflight_lengths.py /tmp/smollm2_ioi --config-name demo_real

Attribution's measured peak is the manifest's. Pruning's is measured here: `prune` alone on the
run's saved pairs and scores, inside the `measure_peak` the pipeline puts around a stage (live
tensor bytes + resident weights), because the pruning stage also computes the circuit's verdict,
whose passes its estimate does not cover (and because the stage may not have finished).
"before" is the estimate at `discovery.data_params.seq_len`, what the preflight printed until
the prompts were tokenized; "now" is the preflight's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution import load_scores
from circuitkit.discovery.attribution.memory import attribution_estimate
from circuitkit.discovery.data_lengths import ATTRIBUTION_AT_DATA, PRUNING_AT_DATA
from circuitkit.discovery.pruning.heads import prune
from circuitkit.discovery.pruning.memory import pruning_estimate
from circuitkit.discovery.stages import HELDOUT_TEMPLATES_FILE, _read_task_data
from circuitkit.discovery.tasks import TaskData
from circuitkit.models.loading import load_model
from circuitkit_app.config import compose


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--config-name", default="config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    _, cfg = compose(["stages=[preflight,data,attribution,pruning]", *args.overrides], args.config_name)
    d = cfg.discovery
    manifest = json.loads((args.run_dir / "manifest.json").read_text())
    rows = {"attribution": (attribution_estimate(cfg).total_bytes, ATTRIBUTION_AT_DATA.estimate(cfg),
                            manifest["stages"]["attribution"]["measured_peak_bytes"])}

    data, n_attr = _read_task_data(args.run_dir / "data.safetensors")
    templates_file = args.run_dir / HELDOUT_TEMPLATES_FILE
    templates = TaskData.load(templates_file) if templates_file.is_file() else None
    loaded = load_model(cfg.model)
    t0 = time.perf_counter()
    with measure_peak(torch.device("cpu"), lambda: module_bytes(loaded.model)) as peak:
        prune(loaded.adapter, load_scores(args.run_dir / "scores.safetensors"), data[:n_attr], data[n_attr:],
              cfg.pruning, d.metric, d.batch_size, heldout=templates)
    print(f"prune: {time.perf_counter() - t0:.0f} s")
    rows["pruning"] = (pruning_estimate(cfg).total_bytes, PRUNING_AT_DATA.estimate(cfg), peak.peak_bytes)

    print("| stage | preflight before (seq_len) | preflight now | measured peak | now / measured |")
    print("|---|---:|---:|---:|---:|")
    for stage, (before, now, measured) in rows.items():
        print(f"| {stage} ({now.lengths.get('line', '').split(':')[0].removeprefix('estimated at ')}) |"
              f" {before / 1e6:.1f} MB ({before / measured:.2f}x) | {now.total_bytes / 1e6:.1f} MB |"
              f" {measured / 1e6:.1f} MB | {now.total_bytes / measured:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
