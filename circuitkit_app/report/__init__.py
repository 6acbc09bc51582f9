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


def _out_path(out: Path | None, default: Path, inputs: list[tuple[str, Path]], kept_dir: Path | None = None) -> Path:
    """Where the page goes, checked before any work: a file path (not a directory), none of the
    command's `inputs`, no file of `kept_dir` (the run or sweep directory) but a page, writable."""
    from circuitkit.core.io import check_not_an_input, check_writable

    out = Path(out) if out is not None else default
    example = str(out / REPORT) if out.is_dir() else str(default if default != out else out.with_name(REPORT))
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a directory, but the report is one HTML file: give its file name,"
                        f" e.g. {example}.", exit_code=2)
    check_not_an_input(out, "--out", inputs, example)
    target = out.resolve()
    if (kept_dir is not None and target.is_file() and target.suffix.lower() not in (".html", ".htm")
            and Path(kept_dir).resolve() in target.parents):
        raise UserError(f"--out {str(out)!r} is {target.name}, a file of {kept_dir}, not a page; writing the report"
                        f" there would destroy it. Give another path, e.g. {example}.", exit_code=2)
    check_writable(out, "--out")
    return out


def _index_data(index_dir: Path) -> list[tuple[str, Path]]:
    """The training data file an index names, as an input no page may replace ([] if none is named)."""
    import json

    try:
        data = json.loads((Path(index_dir) / "manifest.json").read_text()).get("data_file")
    except (OSError, ValueError, AttributeError):
        return []  # the index's own reader says what is wrong with it
    return [("the index's training data", Path(data))] if isinstance(data, str) and data else []


def _run_inputs(run_dir: Path, rank: Path | None, queries: Path | None) -> list[tuple[str, Path]]:
    """What `circuitkit report RUN_DIR` reads: the manifest, every artifact it records, the run's
    index and its data, --rank and --queries."""
    from circuitkit.core.pipeline import MANIFEST, load_manifest

    manifest = load_manifest(run_dir)
    inputs = [("the run's manifest", run_dir / MANIFEST)]
    for entry in (manifest.get("stages") or {}).values():
        for rel in (entry.get("artifacts") or {}) if isinstance(entry, dict) else ():
            inputs.append(("an artifact of the run", Path(rel) if Path(rel).is_absolute() else run_dir / rel))
    grads = (manifest.get("config") or {}).get("grads") or {}
    for index in {run_dir / "index", *([Path(grads["index_dir"])] if grads.get("index_dir") else [])}:
        if (index / "manifest.json").is_file():
            inputs += [("the run's index", index), *_index_data(index)]
    inputs += [(name, Path(p)) for name, p in (("--rank", rank), ("--queries", queries)) if p is not None]
    return inputs


def _check_queries(queries: Path | None) -> None:
    if queries is not None:
        from gradian.build.checks import check_input_file

        check_input_file(Path(queries), "--queries")


def write_run_report(run_dir: Path, out: Path | None = None, rank: Path | None = None,
                     queries: Path | None = None, top_edges: int | None = None) -> Path:
    """The report of the pipeline run in `run_dir` (default: RUN_DIR/report.html); with `rank`,
    also those ranked rows (read against the run's index). Returns the path written."""
    from circuitkit_app.report.collect import collect_run
    from circuitkit_app.report.page import write_page
    from circuitkit_app.report.ranked import collect_rank

    run_dir = Path(run_dir)
    _check_queries(queries)
    out = _out_path(out, run_dir / REPORT, _run_inputs(run_dir, rank, queries), run_dir)
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
    out = _out_path(out, sweep_dir / REPORT, [], sweep_dir)
    view = collect_sweep(sweep_dir)
    return write_page(view, f"CircuitKit sweep: {sweep_dir}", out)


def write_rank_report(rank: Path, index: Path, queries: Path | None = None, out: Path | None = None) -> Path:
    """The report of `gradian rank --out` results against `index` (default: RANK.html beside RANK.jsonl)."""
    from circuitkit_app.report.collect import index_view
    from circuitkit_app.report.page import write_page
    from circuitkit_app.report.ranked import collect_rank

    rank = Path(rank)
    _check_queries(queries)
    inputs = [("the rank file", rank), ("the index", Path(index)), *_index_data(Path(index))]
    out = _out_path(out, rank.with_suffix(".html"), inputs + ([("--queries", Path(queries))] if queries else []))
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
