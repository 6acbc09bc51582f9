"""Slurm through submitit, as far as this machine goes: the `slurm` preset composes, and
submitit's local executor (`hydra/launcher=submitit_local`, the same plugin and job pickling a
Slurm cluster gets) runs sharded attribution whose merge equals one local job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install 'circuitkit-gradian[slurm]'")

from circuitkit.discovery.attribution import load_scores  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from circuitkit_app.stage_list import run_pipeline  # noqa: E402
from tests.discovery.attribution.test_shards import COMMON, _assert_close  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "circuitkit.run", *args], capture_output=True, text=True,
                          timeout=900, env=env)


def test_slurm_preset_composes():
    proc = _run("hydra/launcher=slurm", "--cfg", "hydra")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in proc.stdout
    assert "timeout_min: 240" in proc.stdout and "gpus_per_node: 1" in proc.stdout


@pytest.mark.slow
def test_sharded_attribution_through_submitit_local_executor(tmp_path):
    run_pipeline(compose(COMMON)[1], tmp_path / "single")
    proc = _run("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20", "hydra.launcher.gpus_per_node=0",
                "hydra.launcher.cpus_per_task=1", *COMMON, "discovery.num_shards=2", "discovery.shard_index=range(2)",
                f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads((tmp_path / "sweep" / "attribution_shards" / "merge.json").read_text())
    assert [s["shard_index"] for s in record["shards"]] == [0, 1]
    _assert_close(load_scores(tmp_path / "single" / "scores.safetensors"),
                  load_scores(tmp_path / "sweep" / "attribution_shards" / "scores.safetensors"))
