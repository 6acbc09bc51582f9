"""report.html: a run, a sweep or a ranking as one self-contained interactive page.

    circuitkit report RUN_DIR [--out FILE] [--rank RANK.jsonl --queries Q.jsonl] [--top-edges N]
    circuitkit report SWEEP_DIR [--out FILE]          a multirun: its jobs compared
    gradian report RANK.jsonl --index INDEX [--queries Q.jsonl] [--out FILE]
    gradian rank ... --out RANK.jsonl --report [FILE]

A room of its own above both domains: it reads the typed artifacts (manifest.json, scores,
circuit.pt, the index header, rank results) through their readers (`collect.py`, `ranked.py`,
`sweep.py`) and renders them (`page.py`); no stage writes HTML. The pipeline calls
`write_run_report` as the last step of every run and `SweepReport` at the end of a multirun
(`report.enabled`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from circuitkit.core.errors import UserError

log = logging.getLogger(__name__)
REPORT = "report.html"


def _out_path(out: Path | None, default: Path) -> Path:
    from circuitkit.core.io import check_writable

    out = Path(out) if out is not None else default
    check_writable(out, "--out")
    return out


def write_run_report(run_dir: Path, out: Path | None = None, rank: Path | None = None,
                     queries: Path | None = None, top_edges: int | None = None) -> Path:
    """The report of the pipeline run in `run_dir` (default: RUN_DIR/report.html); with `rank`,
    also those ranked rows (read against the run's index). Returns the path written."""
    from circuitkit_app.report.collect import collect_run
    from circuitkit_app.report.page import write_page
    from circuitkit_app.report.ranked import collect_rank

    run_dir = Path(run_dir)
    out = _out_path(out, run_dir / REPORT)
    view = collect_run(run_dir, top_edges)
    if rank is not None:
        index = (view.get("gradian") or {}).get("index")
        if not index:
            raise UserError(f"--rank {rank}: {run_dir} has no Gradian index to read the ranked rows against; use"
                            " `gradian report RANK.jsonl --index INDEX`.", exit_code=2)
        view["gradian"]["rank"] = collect_rank(Path(rank), Path(index["index_dir"]), queries)
    model = view["run"].get("model") or "?"
    return write_page(view, f"CircuitKit run: {model} ({run_dir.name})", out)


def write_sweep_report(sweep_dir: Path, out: Path | None = None) -> Path:
    """The report comparing a multirun's jobs (default: SWEEP_DIR/report.html)."""
    from circuitkit_app.report.page import write_page
    from circuitkit_app.report.sweep import collect_sweep

    sweep_dir = Path(sweep_dir)
    out = _out_path(out, sweep_dir / REPORT)
    view = collect_sweep(sweep_dir)
    return write_page(view, f"CircuitKit sweep: {sweep_dir}", out)


def write_rank_report(rank: Path, index: Path, queries: Path | None = None, out: Path | None = None) -> Path:
    """The report of `gradian rank --out` results against `index` (default: RANK.html beside RANK.jsonl)."""
    from circuitkit_app.report.collect import index_view
    from circuitkit_app.report.page import write_page
    from circuitkit_app.report.ranked import collect_rank

    rank = Path(rank)
    out = _out_path(out, rank.with_suffix(".html"))
    view: dict[str, Any] = {"kind": "rank", "gradian": {"index": index_view(Path(index)),
                                                        "rank": collect_rank(rank, Path(index), queries)}}
    return write_page(view, f"Gradian ranking: {rank.name}", out)


def is_sweep_dir(path: Path) -> bool:
    """A multirun's sweep directory: job folders with .hydra/overrides.yaml and no manifest of its own."""
    path = Path(path)
    return not (path / "manifest.json").is_file() and any(
        (p / ".hydra" / "overrides.yaml").is_file() for p in path.iterdir() if p.is_dir())


def report_after_run(run_dir: Path, enabled: bool, console=None) -> Path | None:
    """The pipeline's last step: write RUN_DIR/report.html. A report that cannot be written is a
    warning (the run's own artifacts stand), naming the command that retries it."""
    if not enabled:
        return None
    try:
        path = write_run_report(run_dir)
    except Exception as err:  # noqa: BLE001 - the run's artifacts are written; the page is a view of them
        message = f"report.html not written ({type(err).__name__}: {err}); retry with `circuitkit report {run_dir}`"
        if console is not None:
            console.print(f"[yellow]warning:[/yellow] {message}")
        log.warning(message)
        return None
    if console is not None:
        console.print(f"report: {path}")
    return path


class SweepReport(Callback):
    """Hydra callback: after a multirun, one report.html in the sweep dir comparing its jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        enabled = OmegaConf.select(config, "report.enabled", default=True)
        sweep_dir = Path(config.hydra.sweep.dir)
        if not enabled or not sweep_dir.is_dir():
            return
        try:
            path = write_sweep_report(sweep_dir)
        except Exception as err:  # noqa: BLE001 - the sweep's jobs and summary are written already
            log.warning("sweep report not written (%s: %s); retry with `circuitkit report %s`",
                        type(err).__name__, err, sweep_dir)
            return
        print(f"sweep report: {path}")
