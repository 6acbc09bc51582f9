"""The entry layer (circuitkit_app/): the names users type, and the checks it makes before anything runs."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from circuitkit.core.circuit_file import grads_circuit_path
from circuitkit.core.errors import UserError
from circuitkit_app.config import compose

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def test_the_names_users_type_reach_the_entry_package():
    import circuitkit.cli
    import circuitkit.run
    import circuitkit_app.cli
    import circuitkit_app.run

    assert circuitkit.run.main is circuitkit_app.run.main  # python -m circuitkit.run
    assert circuitkit.cli.main is circuitkit_app.cli.main  # python -m circuitkit.cli
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), f"console script {name} -> {target}"
    assert set(scripts) == {"circuitkit", "gradian"}



def test_another_circuitkit_on_the_path_is_named_in_one_line(tmp_path):
    # PyPI's `circuitkit` (Lexsi Labs' CircuitKIT) imports under our name: ours says so and stops (exit 2).
    import subprocess
    import sys

    other = tmp_path / "circuitkit"
    other.mkdir()
    (other / "__init__.py").write_text('"""Another project named circuitkit."""\n__version__ = "0.2.0"\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    for module in ("circuitkit_app.cli", "circuitkit_app.gradian_cli"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], env=env, capture_output=True, text=True, cwd=tmp_path,
                              timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(other / "__init__.py") in lines[0] and "circuitkit-gradian" in lines[0]
        assert "Traceback" not in proc.stderr
    # And ours passes the same check.
    ok = subprocess.run([sys.executable, "-m", "circuitkit_app.cli", "--help"], capture_output=True, text=True,
                        timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ok.returncode == 0, ok.stderr

def test_grads_circuit_run_is_the_circuit_this_run_writes(tmp_path):
    run_dir = tmp_path / "run"
    assert grads_circuit_path(None, None, run_dir) is None
    assert grads_circuit_path("run", None, run_dir) == run_dir / "circuit.pt"
    assert grads_circuit_path("run", str(tmp_path / "out.pt"), run_dir) == tmp_path / "out.pt"
    assert grads_circuit_path("other.pt", str(tmp_path / "out.pt"), run_dir) == Path("other.pt")
    # Before the run (the preflight's estimate has no run directory): output_path, else unknown.
    assert grads_circuit_path("run", None, None) is None
    assert grads_circuit_path("run", str(tmp_path / "out.pt"), None) == tmp_path / "out.pt"


def test_the_grads_stage_reads_run_from_its_own_run_dir(tmp_path):
    from gradian.stage import circuit_for_grads

    _, cfg = compose(["stages=[grads]", "grads.circuit=run"])
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "run" / "circuit.pt")):
        circuit_for_grads(ctx)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "circuit.pt").write_bytes(b"x")
    assert circuit_for_grads(ctx) == tmp_path / "run" / "circuit.pt"


def test_discover_circuit_refuses_a_stage_list_without_pruning_before_running(tmp_path):
    from circuitkit import discover_circuit

    run_dir = tmp_path / "run"
    cfg = {"model": {"name": "builtin:tiny-gpt2", "precision": "float32"}, "stages": ["data", "attribution"]}
    with pytest.raises(ValueError, match="include 'pruning' in stages"):
        discover_circuit(cfg, run_dir=run_dir)
    assert not run_dir.exists()  # nothing ran: no data, no attribution, no manifest


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory no one can write into: procfs' read-only part for root (permission bits do not
    stop root), a mode-0555 directory for others."""
    if IS_ROOT:
        return Path("/proc/sys")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


def test_gradian_index_and_the_pipeline_probe_the_index_dir_alike(read_only_dir, tmp_path):
    from circuitkit_app.stage_list import check_stages
    from gradian.build.checks import check_grads_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": " b"}\n')
    _, cfg = compose(["stages=[grads]", f"grads.data_path={data}", f"grads.index_dir={read_only_dir / 'idx'}",
                      "model.name=builtin:tiny-gpt2"])
    messages = []
    for check in (lambda: check_grads_config(cfg.model, cfg.grads), lambda: check_stages(cfg)):
        with pytest.raises(UserError, match=r"grads\.index_dir=.*: cannot write into") as err:
            check()
        assert err.value.exit_code == 2
        messages.append(str(err.value))
    assert messages[0] == messages[1]  # gradian index and the pipeline say the same, from one probe
