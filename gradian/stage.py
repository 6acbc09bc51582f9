"""The pipeline's grads stage: index `grads.data_path` by per-example gradients (Gradian).

`grads.circuit=run` reads the circuit.pt the pruning stage of the same run wrote (through the
circuit.pt reader, the one piece of circuit discovery Gradian imports).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from circuitkit.core.circuit_file import grads_circuit_path
from circuitkit.core.io import check_writable
from circuitkit.core.pipeline import RunContext, Stage, StageResult
from circuitkit.models.loading import check_model, model_inputs
from gradian.build.checks import check_grads_config
from gradian.build.indexer import SAMPLE_DATA, build_index
from gradian.build.memory import GRADS_MEMORY


def circuit_for_grads(ctx: RunContext) -> Path | None:
    """The circuit.pt `grads.circuit` names: 'run' is the file this run's pruning stage writes
    (read from disk, so a pruning stage skipped on rerun is not recomputed), else the path."""
    path = grads_circuit_path(ctx.cfg.grads.circuit, ctx.cfg.output_path, ctx.run_dir)
    if path is None or ctx.cfg.grads.circuit != "run":
        return path
    if not path.is_file():
        raise FileNotFoundError(f"grads.circuit=run reads the circuit.pt of this run ({path}), which does not exist:"
                                " run the pruning stage first (stages=[...,pruning,grads]) or give grads.circuit"
                                " the path of a circuit.pt.")
    return path


def _grads(ctx: RunContext) -> StageResult:
    """Gradient index of grads.data_path (Gradian), or skipped when grads.enabled is false."""
    g = ctx.cfg.grads
    if not g.enabled:
        ctx.console.print("grads.enabled=false: gradient indexing skipped")
        return StageResult([], {"status": "skipped"})
    index_dir = run_index_dir(ctx.cfg, ctx.run_dir)
    if not g.index_dir and ctx.changed_inputs and index_dir.is_dir():
        # The run's own index was made from inputs that changed since (data file, model, circuit):
        # it is stale, not resumable. A user-chosen index_dir is never deleted (Gradian refuses it).
        ctx.console.print(f"grads: {', '.join(ctx.changed_inputs[:3])} changed; rebuilding {index_dir}",
                          markup=False)
        shutil.rmtree(index_dir)
    circuit_path = circuit_for_grads(ctx)
    summary = build_index(ctx.cfg.model, g, index_dir, ctx.console, loaded=ctx.model(keep_adapter=True),
                          circuit_path=circuit_path)
    files = [index_dir / "manifest.json", *(index_dir / name for name in summary.get("shard_files", []))]
    ctx.console.print(f"index {index_dir}: {summary['rows_stored']} of {summary['n_rows']} rows,"
                      f" {summary['bytes'] / 2**20:.2f} MiB")
    restricted = summary.get("circuit")
    if restricted:
        ctx.console.print(f"restricted to circuit {circuit_path} (sha256 {restricted['sha256'][:12]}…):"
                          f" {len(restricted['heads'])} heads, {len(restricted['mlps'])} MLPs")
    return StageResult(files, {"index_dir": str(index_dir), "rows_stored": summary["rows_stored"],
                               "row_width": summary["row_width"], "index_bytes": summary["bytes"],
                               "complete": summary["complete"], "padding_share": summary.get("padding_share"),
                               "batch": summary.get("batch"),
                               # the estimate at the batches formed (estimated_peak_bytes: the plan's bound)
                               "estimated_batch_peak_bytes": summary.get("estimated_batch_peak_bytes"),
                               "circuit_sha256": restricted["sha256"] if restricted else None},
                       estimated_peak_bytes=summary["estimated_peak_bytes"])


def run_index_dir(cfg: Any, run_dir: Path) -> Path:
    """The index the grads stage writes (and the attribute stage reads): grads.index_dir, or <run dir>/index."""
    return Path(cfg.grads.index_dir).expanduser() if cfg.grads.index_dir else Path(run_dir) / "index"


def grads_data_file(cfg: Any) -> Path:
    return Path(cfg.grads.data_path).expanduser() if cfg.grads.data_path else SAMPLE_DATA


def _grads_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    if not cfg.grads.enabled:
        return {}
    data = grads_data_file(cfg)
    if not data.exists() and cfg.grads.data_format in ("hf", "auto"):
        # A hub dataset name: no local file to hash; the name and split are what identify it here.
        inputs: dict[str, Path | str] = {**model_inputs(cfg.model),
                                         "grads.data_path": f"hf:{cfg.grads.data_path}:{cfg.grads.data_split}"}
    else:
        inputs = {**model_inputs(cfg.model), "grads.data_path": data}
    if cfg.grads.circuit is not None:  # the circuit decides which parameters are indexed
        inputs["grads.circuit"] = grads_circuit_path(cfg.grads.circuit, cfg.output_path, run_dir)
    return inputs


def _check_grads(cfg: Any) -> None:
    """The model reference, then Gradian's own pre-run checks from config files alone: the data
    can be read, the index dir written, shard_index < num_shards, rows bounded by the context."""
    if not cfg.grads.enabled:
        return
    check_model(cfg.model)
    if cfg.grads.index_dir:  # a write probe: permission bits say nothing to root on a read-only mount
        check_writable(Path(cfg.grads.index_dir).expanduser(), "grads.index_dir", directory=True)
    check_grads_config(cfg.model, cfg.grads, Path(cfg.grads.index_dir).expanduser() if cfg.grads.index_dir else None)


GRADS_STAGE = Stage("grads", ("model", "grads"), _grads, inputs=_grads_inputs, check=_check_grads,
                    memory=GRADS_MEMORY)
