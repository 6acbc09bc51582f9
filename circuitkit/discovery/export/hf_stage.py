"""The export stage (after pruning): `export.format=hf` writes the pruned Hugging Face checkpoint
of this run's circuit.pt (`circuitkit.discovery.export.hf`); `export.format=null` skips it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit.core.circuit_file import run_circuit_path
from circuitkit.core.config import ConfigError
from circuitkit.core.io import check_writable
from circuitkit.core.pipeline import RunContext, Stage, StageResult
from circuitkit.discovery.export.hf import PROVENANCE_FILE, export_hf, summary_line
from circuitkit.models.loading import check_model, model_inputs

EXPORT_DIR = "pruned_model"


def export_dir(cfg: Any, run_dir: Path) -> Path:
    """Where the checkpoint goes: export.dir, or <run dir>/pruned_model."""
    return Path(cfg.export.dir).expanduser() if cfg.export.dir else Path(run_dir) / EXPORT_DIR


def _export(ctx: RunContext) -> StageResult:
    e = ctx.cfg.export
    if e.format is None:
        ctx.console.print("export.format=null: no pruned checkpoint written")
        return StageResult([], {"status": "skipped"})
    circuit = run_circuit_path(ctx.cfg.output_path, ctx.run_dir)
    if not circuit.is_file():
        raise FileNotFoundError(f"the export stage reads this run's circuit.pt ({circuit}), which does not exist: run"
                                " the pruning stage first (stages=[...,pruning,export]).")
    _check_export_run_dir(ctx.cfg, ctx.run_dir)
    out = export_dir(ctx.cfg, ctx.run_dir)
    # A fresh copy on the CPU: the run's model stays as it is for the stages after this one.
    prov = export_hf(circuit, out, e.ablation, ctx.cfg.model)
    ctx.console.print(summary_line(out, prov), markup=False)
    files = sorted(p for p in out.iterdir() if p.is_file())
    f = prov.get("faithfulness") or {}
    return StageResult(files, {
        "dir": str(out), "ablation": e.ablation, "heads_removed": prov["n_heads_removed"],
        "kv_groups_cut_per_layer": prov["physically_removed"]["kv_groups_per_layer"],
        "params_before": prov["params_before"], "params_after": prov["params_after"],
        "param_bytes_before": prov["param_bytes_before"], "param_bytes_after": prov["param_bytes_after"],
        "safetensors_bytes": prov["safetensors_bytes"], "faithfulness": f.get("faithfulness"),
        "reference_faithfulness": f.get("reference_faithfulness"), "provenance": str(out / PROVENANCE_FILE)})


def _export_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    if cfg.export.format is None:
        return {}
    return {**model_inputs(cfg.model), "circuit.pt": run_circuit_path(cfg.output_path, run_dir)}


def _within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _model_dir(cfg: Any) -> Path | None:
    """The base model's local directory (a hub model's cache is not the user's to write into)."""
    model = model_inputs(cfg.model).get("model")
    if not isinstance(model, Path):
        return None
    return (model if model.is_dir() else model.parent).resolve()


def _check_export(cfg: Any) -> None:
    if cfg.export.format is None:
        return
    check_model(cfg.model)
    if cfg.export.dir:
        check_writable(Path(cfg.export.dir), "export.dir", directory=True)
        out, model_dir = Path(cfg.export.dir).expanduser().resolve(), _model_dir(cfg)
        if model_dir is not None and (_within(out, model_dir) or _within(model_dir, out)):
            raise ConfigError(f"export.dir={cfg.export.dir!r} is the base model's directory or overlaps it"
                              f" ({model_dir}); the export replaces its folder as a whole: choose a directory of"
                              " its own, e.g. export.dir=null for <run dir>/pruned_model.")


def _check_export_run_dir(cfg: Any, run_dir: Path) -> None:
    """export.dir must not be the run directory or hold it: the export's folder is replaced whole."""
    if cfg.export.format is None or not cfg.export.dir:
        return
    out, run = Path(cfg.export.dir).expanduser().resolve(), Path(run_dir).expanduser().resolve()
    if _within(run, out):
        raise ConfigError(f"export.dir={cfg.export.dir!r} is the run directory or holds it ({run}); the export"
                          " replaces its folder as a whole: choose a directory of its own, e.g. export.dir=null"
                          f" for {run / EXPORT_DIR}.")


EXPORT_STAGE = Stage("export", ("model", "export", "output_path"), _export, inputs=_export_inputs,
                     check=_check_export, check_run_dir=_check_export_run_dir)
