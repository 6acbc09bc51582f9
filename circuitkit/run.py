"""`python -m circuitkit.run [overrides]`: compose the config groups and run the pipeline.

Overrides are checked against the schema before Hydra composes them, so an unknown or
mistyped key fails with a message that names it and what is allowed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from circuitkit.config import CONF_DIR, ConfigError, check_overrides, validate
from circuitkit.pipeline import PipelineError, make_console, run_pipeline

# Hydra flags that take a value (the value is not an override).
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                     "--cfg", "-c", "--package", "-p", "--experimental-rerun"}


def overrides_from_argv(argv: list[str]) -> list[str]:
    """The `key=value` overrides among Hydra's command-line arguments."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            skip = arg in _FLAGS_WITH_VALUE
            continue
        out.append(arg)
    return out


def _fail(message: str, code: int) -> None:
    make_console().print(f"[bold red]error:[/bold red] {message}")
    sys.exit(code)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    # The console is made here, not at import: launchers (joblib, submitit) pickle this
    # function with the module's globals when it runs as __main__, and a console holds a lock.
    console = make_console()
    hc = HydraConfig.get()
    try:
        typed = validate(cfg)
    except ConfigError as err:
        _fail(str(err), 2)
    overrides = OmegaConf.to_container(hc.overrides.task)
    try:
        run_pipeline(typed, Path(hc.runtime.output_dir), console, overrides)
    except PipelineError as err:
        if hc.mode == RunMode.MULTIRUN:
            # Keep the sweep going; the sweep summary shows this job as failed.
            console.print(f"[bold red]job {hc.job.num} failed:[/bold red] {err}")
            return
        _fail(str(err), 1)


def main(argv: list[str] | None = None) -> None:
    """Entry point: validate overrides, then hand over to Hydra."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_overrides(overrides_from_argv(argv))
    except ConfigError as err:
        _fail(str(err), 2)
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()


if __name__ == "__main__":
    main()
