"""Sweep summary for Hydra multirun: one row per job, as CSV and a rich table.

Every job has a row, failed ones included (with their one-line error): a job that fails
records itself in its directory (`record_job_failure`), and the summary is written whatever
happened. The CSV holds every column; the table shows what fits a terminal (job, overrides,
status, wall time, peak, one headline result or the error).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from circuitkit.core.io import atomic_write_bytes, atomic_write_json
from circuitkit.core.pipeline import MANIFEST, headline, make_console

SUMMARY_CSV = "sweep_summary.csv"
# The one result shown in the table, first present wins (the CSV has them all).
HEADLINE_KEYS = ("pruning.faithfulness", "attribution.top_head_score", "grads.rows_stored")


@dataclass
class SweepOutcome:
    """What the last sweep of this process ended with (read by the entry point for its exit code)."""

    jobs: int
    failed: int
    csv_path: Path


_LAST: SweepOutcome | None = None


def last_sweep() -> SweepOutcome | None:
    """The outcome of the last sweep summarized in this process, None if none was."""
    return _LAST


def forget_last_sweep() -> None:
    """Called before a sweep starts, so an earlier sweep's outcome is never read as its own."""
    global _LAST
    _LAST = None


def record_job_failure(job_dir: Path, message: str) -> None:
    """Mark a sweep job as failed in its manifest.json, with the one-line error."""
    path = Path(job_dir) / MANIFEST
    manifest: dict[str, Any] = {}
    if path.is_file():
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            manifest = {}
    manifest.setdefault("stages", {})
    manifest.update(status="failed", error=message)
    atomic_write_json(path, manifest)


def job_overrides(job_dir: Path) -> list[str]:
    """A job's overrides as Hydra recorded them (`.hydra/overrides.yaml`: one 'key=value' string
    each, a value may hold any character); ValueError naming the file and the job if it is not that."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    path = Path(job_dir) / ".hydra" / "overrides.yaml"
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(path))
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as err:
        raise ValueError(f"{path} (job {Path(job_dir).name}) cannot be read ({' '.join(str(err).split())})") from None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"{path} (job {Path(job_dir).name}) is not Hydra's list of 'key=value' overrides")
    return overrides


def _job_row(job_dir: Path) -> dict[str, Any] | None:
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return None
    try:
        overrides = job_overrides(job_dir)
    except ValueError as err:
        return {"job": job_dir.name, "overrides": "", "status": "failed", "error": str(err)}
    row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides)}
    manifest_path = job_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    except (OSError, json.JSONDecodeError) as err:
        manifest = {"status": "failed", "error": f"{manifest_path} cannot be read ({err})"}
    if manifest is None:
        row.update(status="failed", error="no manifest.json: the job ended before the pipeline started")
        return row
    stages = manifest.get("stages", {})
    statuses = {e.get("status") for e in stages.values()}
    bad = [e for e in stages.values() if e.get("status") in ("failed", "interrupted", "running")]
    if manifest.get("status") == "failed" or bad:
        row["status"] = "failed"
    else:
        row["status"] = "ok" if stages and statuses <= {"ok", "skipped"} else "empty"
    row["wall_s"] = round(sum(e.get("wall_s", 0) for e in stages.values()), 3)
    peaks = [e.get("measured_peak_bytes") or 0 for e in stages.values()]
    row["peak_mib"] = round(max(peaks, default=0) / 2**20, 1)
    error = manifest.get("error") or next((e.get("error") for e in bad if e.get("error")), None)
    if error:
        row["error"] = error
    row.update(headline(manifest))
    return row


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rows for every job directory under `sweep_dir` (overrides, status, time, peak, error, results)."""
    rows = []
    for job_dir in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()),
                          key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
        row = _job_row(job_dir)
        if row is not None:
            rows.append(row)
    return rows


def _headline_cell(row: dict[str, Any]) -> str:
    if row.get("status") != "ok" and row.get("error"):
        return f"error: {row['error']}"
    for key in HEADLINE_KEYS:
        if row.get(key) is not None:
            value = row[key]
            return f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
    return ""


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]], console: Console | None = None) -> Path:
    """Write `sweep_summary.csv` in `sweep_dir` (every column) and print the rows as a table
    of the columns that fit a terminal."""
    import io

    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    path = Path(sweep_dir) / SUMMARY_CSV
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=columns or ["job"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(path, buffer.getvalue().encode())
    failed = sum(row.get("status") == "failed" for row in rows)
    table = Table(title=escape(f"sweep summary: {len(rows) - failed} ok, {failed} failed (all columns: {path})"))
    table.add_column("job", justify="right", no_wrap=True)
    table.add_column("overrides", overflow="fold", ratio=2)
    table.add_column("status", no_wrap=True)
    table.add_column("wall s", justify="right", no_wrap=True)
    table.add_column("peak MiB", justify="right", no_wrap=True)
    table.add_column("result", overflow="fold", ratio=3)
    for row in rows:
        status = row.get("status", "?")
        table.add_row(escape(str(row.get("job", ""))), escape(str(row.get("overrides", ""))),
                      f"[red]{escape(status)}[/red]" if status != "ok" else "ok",
                      f"{row['wall_s']:.1f}" if isinstance(row.get("wall_s"), int | float) else "-",
                      f"{row['peak_mib']:.1f}" if isinstance(row.get("peak_mib"), int | float) else "-",
                      escape(_headline_cell(row)))
    (console or make_console()).print(table)
    global _LAST
    _LAST = SweepOutcome(len(rows), failed, path)
    return path


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarize every job of the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            write_summary(sweep_dir, summarize_sweep(sweep_dir))
