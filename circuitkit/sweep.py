"""Sweep summary for Hydra multirun: one row per job, as CSV and a rich table."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from circuitkit.pipeline import MANIFEST, headline, make_console

SUMMARY_CSV = "sweep_summary.csv"


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rows for every job directory under `sweep_dir` (overrides, status, time, peak, results)."""
    rows = []
    for job_dir in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()),
                          key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        if not overrides_file.is_file():
            continue
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file))
        row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides)}
        manifest_path = job_dir / MANIFEST
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            stages = manifest.get("stages", {})
            statuses = {e.get("status") for e in stages.values()}
            row["status"] = "failed" if "failed" in statuses else ("ok" if stages else "empty")
            row["wall_s"] = round(sum(e.get("wall_s", 0) for e in stages.values()), 3)
            peaks = [e.get("measured_peak_bytes") or 0 for e in stages.values()]
            row["peak_mib"] = round(max(peaks, default=0) / 2**20, 1)
            row.update(headline(manifest))
        else:
            row["status"] = "no manifest (failed before the pipeline started)"
        rows.append(row)
    return rows


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]], console: Console | None = None) -> Path:
    """Write `sweep_summary.csv` in `sweep_dir` and print the rows as a table."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    path = Path(sweep_dir) / SUMMARY_CSV
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    table = Table(title=f"sweep summary ({path})")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    (console or make_console()).print(table)
    return path


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarize every job of the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            write_summary(sweep_dir, summarize_sweep(sweep_dir))
