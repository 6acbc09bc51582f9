"""Runs, indexes and exports record the software that made them (circuitkit-gradian's version and git
commit); an index written before the software was recorded still reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from circuitkit.discovery.export.hf import PROVENANCE_FILE, export_hf
from tests.discovery.export.test_export_hf import _circuit, _load
from tests.helpers.refusals import (
    SMALL,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    invoke,
)

ROOT = Path(__file__).resolve().parents[2]


def _names_us(record: dict) -> None:
    from circuitkit.core.provenance import git_commit

    assert record["circuitkit-gradian"] == "0.1.0" or record["circuitkit-gradian"].startswith("0.1.0")
    assert "not installed" not in record["circuitkit-gradian"]
    assert record["git_commit"] == git_commit() and (ROOT / ".git").exists() == (record["git_commit"] is not None)


def test_a_run_records_circuitkit_gradians_version_and_commit(tmp_path, capsys):
    from circuitkit.core.circuit_file import load_circuit

    run = tmp_path / "run"
    code, _, err = invoke("run", [*SMALL, "stages=[data,attribution,pruning]", "pruning.graph=false",
                                  "pruning.bootstrap_resamples=0", f"hydra.run.dir={run}"], capsys)
    assert code == 0, err[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    _names_us(manifest["versions"])
    assert "circuitkit" not in manifest["versions"]  # PyPI's circuitkit is another project
    _names_us(load_circuit(run / "circuit.pt").versions)
    page = (run / "report.html").read_text()
    assert "circuitkit-gradian" in page and manifest["versions"]["git_commit"] in page


def test_the_index_header_and_an_export_record_the_software(tmp_path):
    from gradian.build.indexer import build_index
    from gradian.index.reader import IndexReader
    from tests.gradian.index.test_sign_rows import _cfg as sign_cfg

    cfg = sign_cfg(tmp_path)
    build_index(cfg.model, cfg.grads, tmp_path / "idx")
    _names_us(IndexReader(tmp_path / "idx").manifest["software"])
    _circuit(_load("tiny-gpt2"), tmp_path / "circuit.pt")
    provenance = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "zero")
    _names_us(provenance["software"])
    _names_us(json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["software"])


def test_an_index_written_before_the_software_was_recorded_still_reads(tmp_path):
    from gradian.build.indexer import build_index
    from gradian.index.reader import IndexReader
    from tests.gradian.index.test_sign_rows import _cfg as sign_cfg

    cfg = sign_cfg(tmp_path)
    build_index(cfg.model, cfg.grads, tmp_path / "idx")
    path = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["software"]
    path.write_text(json.dumps(manifest))
    reader = IndexReader(tmp_path / "idx")
    assert reader.manifest["software"] is None
    build_index(cfg.model, cfg.grads, tmp_path / "idx")  # a resume of the older index is the same index


@pytest.mark.slow
def test_an_installed_wheel_records_its_version_and_no_commit(tmp_path):
    """A non-editable install: the version comes from the wheel's metadata, and no commit (the package
    lives in site-packages, not in a checkout)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "wheel").glob("circuitkit_gradian-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=600)
    script = ("import json, circuitkit; from circuitkit.core.provenance import software;"
              " print(json.dumps([circuitkit.__file__, software()]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    where, record = json.loads(out)
    assert where.startswith(str(tmp_path / "site"))
    assert record == {"circuitkit-gradian": "0.1.0", "git_commit": None}
