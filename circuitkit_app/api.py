"""Python API: `discover_circuit(dict)` runs the circuit stages from a plain dict.

    from circuitkit import discover_circuit
    circuit = discover_circuit({
        "model": {"name": "google/gemma-3-4b-it", "precision": "bfloat16"},
        "discovery": {"algorithm": "eap-ig", "task": "mmlu", "level": "node", "ig_steps": 3,
                      "batch_size": 1, "data_params": {"num_examples": 64}},
        "pruning": {"target_sparsity": 0.3, "scope": "heads"},
        "output_path": "./circuit.pt",
    })

The dict is validated against the same schema as the YAML config (unknown keys, wrong types
and out-of-range values raise ConfigError); missing keys take the schema defaults.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from circuitkit.discovery.circuit import load_circuit
from circuitkit_app.config import validate
from circuitkit_app.stage_list import CIRCUIT_STAGE_NAMES, run_pipeline


def discover_circuit(cfg: dict[str, Any], run_dir: str | Path | None = None) -> dict[str, Any]:
    """Validate `cfg`, run preflight/data/attribution/pruning, write `output_path`, return the circuit.

    run_dir: where the stages write their artifacts and manifest.json (default: beside
    output_path as `<stem>_run/`, else `outputs/discover/<timestamp>`). Returns the `Circuit`
    stored in circuit.pt (see circuitkit.core.circuit_file).
    """
    cfg = copy.deepcopy(dict(cfg))
    cfg.setdefault("stages", list(CIRCUIT_STAGE_NAMES))
    typed = validate(cfg)
    if "pruning" not in typed.stages:  # before any stage runs: nothing would come of it
        raise ValueError("discover_circuit needs the pruning stage to produce a circuit; include 'pruning' in stages.")
    if run_dir is None:
        if typed.output_path:
            out = Path(typed.output_path)
            run_dir = out.parent / f"{out.stem}_run"
        else:
            run_dir = Path("outputs") / "discover" / time.strftime("%Y-%m-%d_%H-%M-%S")
    manifest = run_pipeline(typed, Path(run_dir))
    path = manifest["stages"]["pruning"]["summary"].get("circuit_path")
    if path is None:  # a shard of a sharded attribution that was not the last to finish
        d = typed.discovery
        raise ValueError(f"attribution shard {d.shard_index} of {d.num_shards} finished, but other shards were still"
                         " running, so this job pruned nothing. The last shard to finish prunes the merged scores"
                         " and returns the circuit (or run `circuitkit merge` once all are done); read"
                         f" {typed.output_path or 'circuit.pt in that run directory'} after it.")
    return load_circuit(Path(path))
