"""`python -m circuitkit.run [overrides]`: compose the config groups and run the pipeline.

Everything that can be checked is checked before Hydra creates the run directory: override
syntax and keys, the composed config (types, ranges, interpolations, cross-field rules), the
stages' pre-run checks, and that the run directory can be written. Every error ends in one
line and an exit code (circuitkit.core.errors); `CIRCUITKIT_DEBUG=1` shows the traceback.

In a multirun each job stands alone: a job whose config or stage fails is recorded as a
failed row of `sweep_summary.csv` with its one-line error, the other jobs run, and the sweep
exits 1 when any job failed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from circuitkit.core.config import CONF_DIR
from circuitkit.core.errors import UserError, debug_enabled, exit_code_and_message, print_error, run_entry
from circuitkit.core.io import check_writable
from circuitkit.core.pipeline import make_console
from circuitkit.core.sweep import forget_last_sweep, last_sweep, record_job_failure
from circuitkit_app.config import check_overrides, compose_with_run_dir, hydra_dir, validate
from circuitkit_app.stage_list import check_stages, run_pipeline

# Hydra flags that take a value (the value is not an override).
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                     "--cfg", "-c", "--package", "-p", "--experimental-rerun"}
# Flags after which Hydra prints something and runs no job, or composes from elsewhere: no pre-check.
# (--config-name / --config-dir are pre-checked: a user's config file is composed like Hydra will.)
_NO_PRECHECK = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--version",
                "--shell-completion", "-sc", "--config-path", "-cp", "--experimental-rerun"}


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of a Hydra flag (`--config-name x`, `--config-name=x`, `-cn x`), None if absent."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


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


def _run_job(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    typed = validate(cfg)
    overrides = OmegaConf.to_container(hc.overrides.task)
    # The console is made here, not at import: launchers (joblib, submitit) pickle this
    # function with the module's globals when it runs as __main__ (`python -m circuitkit_app.run`), and a
    # console holds a lock.
    run_pipeline(typed, Path(hc.runtime.output_dir), make_console(), overrides,
                 checked=hc.mode != RunMode.MULTIRUN)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        code = run_entry(_run_job, cfg)
        if code:
            sys.exit(code)
        return

    try:
        _run_job(cfg)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - a failed job is a row of the summary, not the sweep's end
        if debug_enabled():
            raise
        _, message = exit_code_and_message(err)
        record_job_failure(Path(hc.runtime.output_dir), message)
        print_error(message, label=f"job {hc.job.num} failed")


def _main(argv: list[str]) -> int:
    multirun = "-m" in argv or "--multirun" in argv
    overrides = overrides_from_argv(argv)
    # In a sweep, a value out of range fails its own job (a row of the summary), not the sweep.
    check_overrides(overrides, ranges=not multirun)
    if not _NO_PRECHECK & {a.split("=", 1)[0] for a in argv}:
        name = flag_value(argv, "--config-name", "-cn") or "config"
        config_dir = flag_value(argv, "--config-dir", "-cd")
        if multirun:
            check_writable(Path(hydra_dir(overrides, "sweep", name, config_dir)), "hydra.sweep.dir", directory=True)
        else:
            typed, run_dir = compose_with_run_dir(overrides, name, config_dir)
            check_stages(typed, Path(run_dir))
            check_writable(Path(run_dir), "hydra.run.dir", directory=True)
    if debug_enabled():
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")

    forget_last_sweep()
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()
    if multirun:
        summary = last_sweep()
        if summary is not None and summary.failed:
            raise UserError(f"{summary.failed} of {summary.jobs} sweep jobs failed; see {summary.csv_path}"
                            " (one row per job, with its error).")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: check what can be checked, hand over to Hydra; returns the exit status.

    0 ok, 1 a stage or sweep job failed, 2 the command or config is wrong (nothing ran),
    130 interrupted. Set CIRCUITKIT_DEBUG=1 for tracebacks.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_entry(_main, argv)
    except SystemExit as exit_:  # the job's own exit status (run_entry already printed the line)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
