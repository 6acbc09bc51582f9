"""The one list of the pipeline's stages, assembled where both domains are known (entry layer).

    preflight -> data -> attribution -> pruning -> export -> grads -> attribute

Each stage lives with its domain (`circuitkit.preflight.stage`, `circuitkit.discovery.stages` for the circuit
stages, `gradian.stage`, `gradian.attribute.stage`); a new stage is one more entry here (and its name in
`circuitkit_app.config.ALL_STAGES`, the schema's choices for `stages`). `run_pipeline` and
`check_stages` are what run.py, api.py, smart.py, the scripts and the tests call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from circuitkit.core.pipeline import Pipeline
from circuitkit.discovery.export.hf_stage import EXPORT_STAGE
from circuitkit.discovery.stages import CIRCUIT_STAGES
from circuitkit.models.loading import load_model, model_source
from circuitkit.preflight.stage import PREFLIGHT_STAGE
from circuitkit_app.config import AppConfig
from gradian.attribute.stage import ATTRIBUTE_STAGE
from gradian.stage import GRADS_STAGE

PIPELINE = Pipeline({stage.name: stage for stage in (PREFLIGHT_STAGE, *CIRCUIT_STAGES, EXPORT_STAGE, GRADS_STAGE,
                                                     ATTRIBUTE_STAGE)}, load_model, model_source)
# What discover_circuit and `circuitkit discover-smart` run: every stage up to the circuit.
CIRCUIT_STAGE_NAMES = (PREFLIGHT_STAGE.name, *(stage.name for stage in CIRCUIT_STAGES))


def run_pipeline(cfg: AppConfig, run_dir: str | Path, console: Console | None = None,
                 overrides: list[str] | None = None, checked: bool = False) -> dict[str, Any]:
    """Run `cfg.stages` in `run_dir`; returns the manifest (see `circuitkit.core.pipeline.Pipeline.run`).

    The last step, also after a stage failed: report.html in `run_dir` (`report.enabled`), the run
    as one page (circuitkit_app.report); an interrupted run writes none.
    """
    from circuitkit.core.pipeline import PipelineError
    from circuitkit_app.report import report_after_run

    try:
        manifest = PIPELINE.run(cfg, Path(run_dir), console, overrides, checked)
    except PipelineError:
        if (Path(run_dir) / "manifest.json").is_file():
            report_after_run(Path(run_dir), cfg.report.enabled, console)
        raise
    report_after_run(Path(run_dir), cfg.report.enabled, console)
    return manifest


def check_stages(cfg: AppConfig, run_dir: Path | None = None) -> None:
    """Every selected stage's pre-run check (configs only, nothing written); given the run
    directory, also the checks that need it."""
    PIPELINE.check(cfg, run_dir)
