"""Sharded indexing through a real Hydra launcher: 3 parallel workers write one index."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

COMMON = ["stages=[grads]", "model.precision=float32", "grads.rows_per_shard=5", "grads.projection_dim=64"]


def _run(*args: str) -> None:
    # One torch thread in every process: joblib's workers get cpu_count // n_jobs threads, and the
    # backward's float sums are split by thread count, so bytes match only at equal thread counts
    # (values agree to float round-off either way; docs/configuration.md, `grads`, says so).
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "160", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_three_joblib_workers_write_the_same_index_as_one(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    _run(*COMMON, f"grads.index_dir={one}", f"hydra.run.dir={tmp_path / 'single'}")
    _run("-m", "hydra/launcher=local", "hydra.launcher.n_jobs=3", *COMMON, f"grads.index_dir={many}",
         "grads.num_shards=3", "grads.shard_index=range(3)", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    shards = json.loads((one / "manifest.json").read_text())["shards"]
    assert len(shards) == 5
    for name in ["manifest.json", *shards]:
        assert filecmp.cmp(one / name, many / name, shallow=False), name
    summary = (tmp_path / "sweep" / "sweep_summary.csv").read_text()
    assert summary.count("grads.shard_index=") == 3 and ",ok," in summary
