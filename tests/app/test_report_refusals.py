"""`circuitkit report` reads only a run's own artifacts (an edited output_path or a link to outside is
refused), and reads a recorded output_path outside the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.discovery.export.test_export_hf import _circuit, _load
from tests.helpers.refusals import (
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
    invoke,
)


def _hand_run(run: Path, output_path: str | None, artifacts: dict | None = None) -> Path:
    """A run directory with only a manifest.json, as a run writes it (config, stages)."""
    from circuitkit.core.config import to_dict
    from circuitkit_app.config import AppConfig

    run.mkdir(parents=True, exist_ok=True)
    config = {**to_dict(AppConfig()), "output_path": output_path}
    stages = {"pruning": {"status": "ok", "artifacts": artifacts or {}}}
    (run / "manifest.json").write_text(json.dumps({"config": config, "stages": stages, "status": "ok"}))
    return run


@pytest.mark.parametrize("how", ["edited_output_path", "link_to_outside"])
def test_report_reads_only_the_runs_own_artifacts(how, tmp_path, capsys):
    run = tmp_path / "run"
    if how == "edited_output_path":
        _hand_run(run, "/etc/passwd")
    else:  # circuit.pt in the run directory is a link to a file outside it
        _hand_run(run, None)
        (run / "circuit.pt").symlink_to("/etc/passwd")
    code, _, err = invoke("cli", ["report", str(run)], capsys)
    line = _one_error(err)
    assert code == 1 and "outside the run directory" in line and "manifest.json" in line, (code, line)
    assert "/etc/passwd" in line or "circuit.pt" in line
    assert not (run / "report.html").exists()


def test_report_reads_a_recorded_output_path_outside_the_run(tmp_path, capsys):
    """output_path elsewhere is the run's own artifact when its stage recorded it (with its sha256)."""
    from circuitkit.core.io import sha256_file

    circuit = tmp_path / "elsewhere" / "circuit.pt"
    circuit.parent.mkdir()
    _circuit(_load("tiny-gpt2"), circuit)
    run = _hand_run(tmp_path / "run", str(circuit), {str(circuit): {"sha256": sha256_file(circuit)}})
    code, _, err = invoke("cli", ["report", str(run)], capsys)
    assert code == 0, err[-2000:]
    assert 'id="circuit"' in (run / "report.html").read_text()
