"""A real local Ray cluster: sharded indexing and sharded attribution through `hydra/launcher=ray`.

A head node is started on 127.0.0.1 with 2 CPUs and no GPU (its own process group, torn down
in the fixture's finalizer), the sweeps join it with `hydra.launcher.ray.init.address`, and the
results are compared with one local job: the index byte for byte, the merged attribution scores
to float32 round-off.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'circuitkit-gradian[ray]'")
pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra-ray-launcher is not installed:"
                    " pip install 'circuitkit-gradian[ray]'")

from circuitkit.discovery.attribution import load_scores  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from circuitkit_app.stage_list import run_pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # The workers import this checkout and build fixtures in the same cache; one thread each
    # (bytes of the index match only at equal thread counts: tests/app/test_launchers.py).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "COLUMNS": "160"}


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on 127.0.0.1 in its own process group; killed as a group after."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ckray", dir="/tmp")  # Ray's socket paths must stay short
    ray_bin = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             "--port", str(port), "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard=false",
                             "--disable-usage-stats", "--temp-dir", temp],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            probe = subprocess.run([str(ray_bin), "status", "--address", address], env=_env(), capture_output=True,
                                   text=True, timeout=60)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start: {probe.stderr[-1000:]}")
            time.sleep(2)
        yield address
    finally:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(1)
        shutil.rmtree(temp, ignore_errors=True)


def _sweep(address: str, *overrides: str) -> None:
    args = [sys.executable, "-m", "circuitkit.run", "-m", "hydra/launcher=ray",
            f"hydra.launcher.ray.init.address={address}", "hydra.launcher.ray.remote.num_gpus=0",
            "hydra.launcher.ray.remote.num_cpus=1", *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_sharded_index_on_ray_equals_one_local_job(ray_head, tmp_path):
    common = ["stages=[grads]", "model.precision=float32", "grads.rows_per_shard=5", "grads.projection_dim=64"]
    single = subprocess.run([sys.executable, "-m", "circuitkit.run", *common, f"grads.index_dir={tmp_path / 'one'}",
                             f"hydra.run.dir={tmp_path / 'single'}"], capture_output=True, text=True, timeout=600,
                            env=_env())
    assert single.returncode == 0, single.stderr[-3000:]
    _sweep(ray_head, *common, f"grads.index_dir={tmp_path / 'many'}", "grads.num_shards=2", "grads.shard_index=range(2)",
           f"hydra.sweep.dir={tmp_path / 'sweep'}")
    shards = json.loads((tmp_path / "one" / "manifest.json").read_text())["shards"]
    assert len(shards) == 5
    for name in ["manifest.json", *shards]:
        assert filecmp.cmp(tmp_path / "one" / name, tmp_path / "many" / name, shallow=False), name
    summary = (tmp_path / "sweep" / "sweep_summary.csv").read_text()
    assert summary.count(",ok,") == 2


def test_sharded_attribution_on_ray_merges_to_one_local_job(ray_head, tmp_path):
    from tests.discovery.attribution.test_shards import COMMON, _assert_close

    run_pipeline(compose(COMMON)[1], tmp_path / "single")
    _sweep(ray_head, *COMMON, "discovery.num_shards=2", "discovery.shard_index=range(2)",
           f"hydra.sweep.dir={tmp_path / 'sweep'}")
    record = json.loads((tmp_path / "sweep" / "attribution_shards" / "merge.json").read_text())
    assert [s["shard_index"] for s in record["shards"]] == [0, 1] and record["n_examples"] == 11
    _assert_close(load_scores(tmp_path / "single" / "scores.safetensors"),
                  load_scores(tmp_path / "sweep" / "attribution_shards" / "scores.safetensors"))
    assert sum((d / "circuit.pt").is_file() for d in (tmp_path / "sweep").iterdir()) == 1
