"""Kill `gradian index` with SIGKILL mid-run, several times, then resume: same bytes as one run."""

from __future__ import annotations

import filecmp
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest


def _write_rows(path, n: int) -> None:
    rng = random.Random(0)
    words = ["river", "city", "book", "apple", "blue", "north", "music", "garden", "letter", "window"]
    with open(path, "w") as fh:
        for i in range(n):
            prompt = f"Question {i}: what is near the {rng.choice(words)}?"
            fh.write(json.dumps({"prompt": prompt, "completion": f" The {rng.choice(words)} {rng.choice(words)}."}) + "\n")


def _cmd(data, index_dir) -> list[str]:
    return [sys.executable, "-m", "circuitkit_app.gradian_cli", "index", "model.precision=float32", f"grads.data_path={data}",
            f"grads.index_dir={index_dir}", "grads.rows_per_shard=3", "grads.batch_size=1", "grads.projection_dim=64"]


def _shards_listed(index_dir) -> int:
    try:
        return len(json.loads((index_dir / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


@pytest.mark.slow
def test_sigkill_and_resume_gives_identical_bytes(tmp_path):
    data = tmp_path / "rows.jsonl"
    _write_rows(data, 90)  # 30 shards
    env = {**os.environ, "COLUMNS": "120"}
    subprocess.run(_cmd(data, tmp_path / "straight"), check=True, capture_output=True, env=env, timeout=600)

    killed_at = []
    for _ in range(3):
        proc = subprocess.Popen(_cmd(data, tmp_path / "killed"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        before = _shards_listed(tmp_path / "killed")
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if _shards_listed(tmp_path / "killed") >= before + random.Random(len(killed_at)).randint(1, 4):
                break
            time.sleep(0.01)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at.append(_shards_listed(tmp_path / "killed"))
    assert killed_at, "no run was killed mid-way"
    assert _shards_listed(tmp_path / "killed") < 30
    subprocess.run(_cmd(data, tmp_path / "killed"), check=True, capture_output=True, env=env, timeout=600)

    straight, resumed = tmp_path / "straight", tmp_path / "killed"
    names = sorted(p.name for p in straight.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in resumed.iterdir() if not p.name.startswith("."))
    for name in names:
        assert filecmp.cmp(straight / name, resumed / name, shallow=False), name
    assert not list(resumed.glob("*.tmp"))
