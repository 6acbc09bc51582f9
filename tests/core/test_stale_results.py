"""Stale results are detected: a changed data file, a retrained model in the same directory, an upstream
artifact rewritten by another run and changed grads data rerun their stage; a touched file does not.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from circuitkit.core import pipeline
from circuitkit_app.config import compose
from circuitkit_app.stage_list import PIPELINE, run_pipeline
from tests.helpers.refusals import (
    LISA,
    MARY,
    _model_copy,
    _pair,
    _tiny,
    _write,
)


def _data_cfg(tmp: Path, data: Path, *more: str):
    return compose(["stages=[data]", "discovery.task=jsonl", f"discovery.data_params.data_path={data}",
                    "discovery.data_params.num_examples=2", "discovery.data_params.eval_examples=1",
                    "model.precision=float32", *more])[1]


def _ran(manifest: dict, name: str) -> bool:
    return not manifest["stages"][name].get("skipped_on_rerun")


def test_changed_data_file_reruns_the_stage_and_touched_one_does_not(tmp_path):
    from circuitkit.discovery.tasks import TaskData

    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    run_dir = tmp_path / "run"
    run_pipeline(_data_cfg(tmp_path, data), run_dir)
    first = TaskData.load(run_dir / "data.safetensors")

    os.utime(data, ns=(1, 1))  # same bytes, new mtime: skipped, and the new mtime is recorded
    manifest = run_pipeline(_data_cfg(tmp_path, data), run_dir)
    assert not _ran(manifest, "data")
    record = manifest["stages"]["data"]["inputs"]["discovery.data_params.data_path"]
    assert record["mtime_ns"] == 1 and len(record["sha256"]) == 64

    _write(data, "\n".join([_pair(MARY.replace("store", "park"), LISA.replace("store", "park"))] * 3) + "\n")
    manifest = run_pipeline(_data_cfg(tmp_path, data), run_dir)
    assert _ran(manifest, "data")
    assert not torch.equal(TaskData.load(run_dir / "data.safetensors").clean_ids, first.clean_ids)


def test_same_size_and_mtime_uses_the_recorded_hash(tmp_path, monkeypatch):
    """The fast path: a file whose size and mtime match its record is not read again."""
    from circuitkit.core import fingerprint

    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    record = fingerprint.Fingerprinter().file(data)
    hashed = []
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p: hashed.append(p) or "x" * 64)
    assert fingerprint.Fingerprinter([record]).file(data)["sha256"] == record["sha256"] and hashed == []
    os.utime(data, ns=(5, 5))
    assert fingerprint.Fingerprinter([record]).file(data)["sha256"] == "x" * 64 and len(hashed) == 1


def test_retrained_model_in_the_same_directory_reruns(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model_copy(tmp_path, _tiny())
    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    run_dir = tmp_path / "run"
    cfg = _data_cfg(tmp_path, data, f"model.name={model}")
    run_pipeline(cfg, run_dir)
    assert not _ran(run_pipeline(cfg, run_dir), "data")
    weights = load_file(model / "model.safetensors")
    weights = {k: v + 1e-3 for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    manifest = run_pipeline(cfg, run_dir)
    assert _ran(manifest, "data")
    assert "model/model.safetensors" in manifest["stages"]["data"]["inputs"]


def test_upstream_artifact_changed_by_another_run_reruns_the_consumer(tmp_path, monkeypatch):
    calls = []
    stage = PIPELINE.stages["attribution"]

    def fake_attribution(ctx):
        calls.append(1)
        out = ctx.run_dir / "scores.txt"
        out.write_text((ctx.run_dir / "data.safetensors").read_bytes().hex()[:64])
        return pipeline.StageResult([out], {})
    monkeypatch.setitem(PIPELINE.stages, "attribution", dataclasses.replace(stage, run=fake_attribution))
    base = ["discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=2",
            "discovery.data_params.seq_len=16", "model.precision=float32"]
    run_pipeline(compose(["stages=[data]", *base])[1], tmp_path)
    attr = compose(["stages=[attribution]", *base])[1]
    run_pipeline(attr, tmp_path)
    run_pipeline(attr, tmp_path)
    assert len(calls) == 1
    run_pipeline(compose(["stages=[data]", "seed=3", *base])[1], tmp_path)  # new data.safetensors
    manifest = run_pipeline(attr, tmp_path)
    assert len(calls) == 2 and _ran(manifest, "attribution")


def test_changed_grads_data_rebuilds_the_run_index(tmp_path):
    rows = [json.dumps({"prompt": f"Q{i}: ", "completion": f"A{i}"}) for i in range(6)]
    data = _write(tmp_path / "train.jsonl", "\n".join(rows) + "\n")
    cfg = compose(["stages=[grads]", f"grads.data_path={data}", "grads.projection_dim=16",
                   "model.precision=float32"])[1]
    first = run_pipeline(cfg, tmp_path / "run")
    assert first["stages"]["grads"]["summary"]["rows_stored"] == 6
    _write(data, "\n".join(rows[:3]) + "\n")
    second = run_pipeline(cfg, tmp_path / "run")
    assert second["stages"]["grads"]["summary"]["rows_stored"] == 3
