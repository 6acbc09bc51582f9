"""Pipeline mechanics: manifest, atomic artifacts, resume by config hash, loud failures."""

from __future__ import annotations

import json

import pytest

from circuitkit.core.pipeline import PipelineError, Stage, StageResult
from circuitkit_app.config import compose
from circuitkit_app.stage_list import PIPELINE, run_pipeline


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace data/attribution with cheap stages that count their calls."""
    calls = {"data": 0, "attribution": 0}

    def make(name, fail=False):
        def run(ctx):
            calls[name] += 1
            if fail:
                raise RuntimeError("boom")
            path = ctx.run_dir / f"{name}.txt"
            path.write_text(f"{name} with ig_steps={ctx.cfg.discovery.ig_steps}")
            return StageResult([path], {"value": 1.5})
        return run

    monkeypatch.setitem(PIPELINE.stages, "data", Stage("data", ("discovery.task", "seed"), make("data")))
    monkeypatch.setitem(PIPELINE.stages, "attribution",
                        Stage("attribution", ("discovery",), make("attribution")))
    return calls, make, monkeypatch


def _cfg(*overrides):
    return compose(["stages=[data,attribution]", *overrides])[1]


def test_manifest_records_each_stage(tmp_path, fake_stages):
    manifest = run_pipeline(_cfg(), tmp_path)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["stages"] == manifest["stages"]
    for name in ("data", "attribution"):
        entry = on_disk["stages"][name]
        assert entry["status"] == "ok"
        assert entry["wall_s"] >= 0 and entry["measured_peak_bytes"] >= 0 and "estimated_peak_bytes" in entry
        (rel, art), = entry["artifacts"].items()
        assert rel == f"{name}.txt" and len(art["sha256"]) == 64
        assert entry["summary"] == {"value": 1.5} and len(entry["config_hash"]) == 64
    assert {"torch", "transformers", "hydra-core", "omegaconf", "safetensors", "rich"} <= set(on_disk["versions"])
    assert on_disk["config"]["discovery"]["ig_steps"] == 5
    assert not list(tmp_path.glob("*.tmp"))


def test_rerun_skips_matching_stages_and_reruns_changed_ones(tmp_path, fake_stages):
    calls, _, _ = fake_stages
    run_pipeline(_cfg(), tmp_path)
    run_pipeline(_cfg(), tmp_path)
    assert calls == {"data": 1, "attribution": 1}
    run_pipeline(_cfg("discovery.ig_steps=3"), tmp_path)  # attribution's block changed, data's did not
    assert calls == {"data": 1, "attribution": 2}
    (tmp_path / "data.txt").write_text("tampered")  # artifact no longer matches its sha256
    run_pipeline(_cfg("discovery.ig_steps=3"), tmp_path)
    assert calls == {"data": 2, "attribution": 3}  # data reran, and attribution after it
    run_pipeline(_cfg("discovery.ig_steps=3", "skip_completed=false"), tmp_path)
    assert calls == {"data": 3, "attribution": 4}


def test_failed_stage_is_recorded_and_keeps_earlier_artifacts(tmp_path, fake_stages):
    calls, make, monkeypatch = fake_stages
    monkeypatch.setitem(PIPELINE.stages, "attribution",
                        Stage("attribution", ("discovery",), make("attribution", fail=True)))
    with pytest.raises(PipelineError, match="stage 'attribution' failed: RuntimeError: boom"):
        run_pipeline(_cfg(), tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["stages"]["data"]["status"] == "ok"
    assert manifest["stages"]["attribution"]["status"] == "failed"
    assert "boom" in manifest["stages"]["attribution"]["error"]
    assert (tmp_path / "data.txt").is_file()


def test_stage_missing_from_the_pipeline_fails_before_any_work(tmp_path, fake_stages, monkeypatch):
    calls, _, _ = fake_stages
    monkeypatch.delitem(PIPELINE.stages, "pruning")
    with pytest.raises(PipelineError, match="pruning are not part of this pipeline; it has: preflight, data,"):
        run_pipeline(_cfg("stages=[data,attribution,pruning]"), tmp_path)
    assert calls == {"data": 0, "attribution": 0}
    assert not (tmp_path / "manifest.json").exists()
