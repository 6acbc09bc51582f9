"""Sweeps: a bad job is a failed row and the sweep exits 1, a job failing in a stage does not stop the
others, and the summary table escapes markup and stays readable at 120 columns.
"""

from __future__ import annotations

import csv

from tests.helpers.refusals import (
    SMALL,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    error_lines,
    invoke,
)


def test_a_bad_job_is_a_failed_row_and_the_sweep_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    sweep = tmp_path / "sweep"
    code, _, err = invoke("run", ["-m", "stages=[data]", "grads.num_shards=2", "grads.shard_index=2,0,1",
                                  f"hydra.sweep.dir={sweep}", *SMALL], capsys)
    assert code == 1 and "Traceback" not in err
    assert error_lines(err)[-1].startswith("error: 1 of 3 sweep jobs failed")
    with open(sweep / "sweep_summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["failed", "ok", "ok"]
    assert "grads.shard_index" in rows[0]["error"] and rows[1]["data.num_examples"] == "4"
    table = err[err.index("sweep summary"):err.index("error: 1 of 3")].splitlines()
    assert any("stages=[data]" in line for line in table)  # brackets survive rich markup
    header = next(line for line in table if "overrides" in line)
    assert "…" not in header and "peak MiB" in header and "result" in header  # readable at 120 columns
    assert all(len(line) <= 120 for line in table), table


def test_a_job_failing_in_a_stage_does_not_stop_the_others(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    code, _, err = invoke("run", ["-m", "stages=[data]", "discovery.data_params.seq_len=1000,16",
                                  f"hydra.sweep.dir={sweep}", *SMALL[:2], "model.precision=float32"], capsys)
    assert code == 1
    with open(sweep / "sweep_summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["failed", "ok"] and "256" in rows[0]["error"]


def test_write_summary_escapes_markup_and_shows_one_result(tmp_path):
    from rich.console import Console

    from circuitkit.core.sweep import write_summary

    console = Console(record=True, width=120)
    rows = [{"job": "0", "overrides": "stages=[data,pruning] seed=1", "status": "ok", "wall_s": 1.5,
             "peak_mib": 3.0, "pruning.faithfulness": 0.8123, **{f"x.col{i}": i for i in range(14)}}]
    write_summary(tmp_path, rows, console)
    text = console.export_text()
    assert "stages=[data,pruning]" in text and "pruning.faithfulness 0.8123" in text and "col3" not in text
    assert "x.col13" in (tmp_path / "sweep_summary.csv").read_text()
