"""Models split by `model.device_map` (accelerate): the same scores and index rows as unsplit.

This machine has one CPU and no GPU, so the split tested is the one accelerate supports here:
some layers on `cpu`, the last block offloaded to `disk` (its parameters are `meta` tensors
between forwards, loaded by accelerate's hooks for each forward). That exercises the hooks,
the input device, and every read of weights outside a forward (edge-level attribution reads
per-head W_Q/K/V/O and norm weights; the index manifest hashes the weights). A split across
several GPUs (activations changing device between layers) is not verified here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("accelerate")

from circuitkit.core.config import ConfigError  # noqa: E402
from circuitkit.discovery.attribution import run_attribution  # noqa: E402
from circuitkit.discovery.tasks.base import random_pairs  # noqa: E402
from circuitkit.models.loading import load_model, weights_hash  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from circuitkit_app.stage_list import run_pipeline  # noqa: E402

SPLITS = {  # every module on the CPU except the last block, offloaded to disk
    "tiny-gpt2": "{transformer.wte: cpu, transformer.wpe: cpu, transformer.h.0: cpu, transformer.h.1: disk,"
                 " transformer.ln_f: cpu, lm_head: cpu}",
    "tiny-llama": "{model.embed_tokens: cpu, model.layers.0: cpu, model.layers.1: disk, model.norm: cpu,"
                  " model.rotary_emb: cpu, lm_head: cpu}",
}


def _model_overrides(name, tmp_path, split):
    out = [f"model.name=builtin:{name}", "model.precision=float32"]
    if split:
        out += [f"model.device_map={SPLITS[name]}", f"model.offload_folder={tmp_path / 'offload'}"]
    return out


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_split_model_gives_the_same_scores(name, tmp_path):
    whole = load_model(compose(_model_overrides(name, tmp_path, False))[1].model)
    cfg = compose([*_model_overrides(name, tmp_path, True), "discovery.level=edge", "discovery.ig_steps=3"])[1]
    split = load_model(cfg.model)
    last = split.adapter.blocks[-1]
    assert all(p.device.type == "meta" for p in last.parameters())  # really offloaded
    assert set(split.model.hf_device_map.values()) == {"cpu", "disk"}
    assert weights_hash(split.model) == weights_hash(whole.model)
    data = random_pairs(6, 12, whole.adapter.vocab_size, seed=3)
    a = run_attribution(whole.adapter, data, cfg.discovery, progress=False)
    b = run_attribution(split.adapter, data, cfg.discovery, progress=False)
    for field in ("head", "mlp", "embed", "edges"):
        x, y = getattr(a, field), getattr(b, field)
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7 * x.abs().max()), (field, (x - y).abs().max())
    assert (a.edges != 0).sum() > 10 and a.metric_clean == pytest.approx(b.metric_clean, rel=1e-6)
    assert all(p.device.type == "meta" for p in last.parameters())  # put back after the weight reads


def test_split_model_indexes_the_same_rows(tmp_path):
    common = ["stages=[grads]", "grads.projection_dim=16", "grads.rows_per_shard=8", "grads.storage_dtype=float32"]
    for split in (False, True):
        overrides = [*common, *_model_overrides("tiny-gpt2", tmp_path, split), f"grads.index_dir={tmp_path / str(split)}"]
        run_pipeline(compose(overrides)[1], tmp_path / f"run{split}")
    whole, split = (json.loads((tmp_path / s / "manifest.json").read_text()) for s in ("False", "True"))
    assert whole["weights_sha256"] == split["weights_sha256"] and whole["shards"]
    for shard in whole["shards"]:
        x, y = load_file(str(tmp_path / "False" / shard)), load_file(str(tmp_path / "True" / shard))
        assert torch.equal(x["rows"], y["rows"]) and x["grads"].shape[0] > 0
        assert torch.allclose(x["grads"], y["grads"], rtol=1e-5, atol=1e-6 * x["grads"].abs().max())


def test_device_map_config_errors():
    with pytest.raises(ConfigError, match="maps modules to 'disk', so model.offload_folder"):
        compose(["model.device_map={transformer.h.0: disk}"])
    with pytest.raises(ConfigError, match="'model.device_map' = 'everywhere' is not allowed"):
        compose(["model.device_map=everywhere"])
    with pytest.raises(ConfigError, match="only apply with model.device_map set"):
        compose(["model.max_memory={cpu: 1GiB}"])


def test_preflight_splits_the_estimate_per_device(tmp_path, capsys):
    from circuitkit.discovery.attribution.memory import attribution_estimate
    from circuitkit.models.device_shares import per_device_estimates, planned_weight_bytes
    from circuitkit.preflight.stage import check
    from circuitkit_app.stage_list import PIPELINE

    whole = load_model(compose(_model_overrides("tiny-gpt2", tmp_path, False))[1].model).model
    on_disk = sum(p.numel() * p.element_size() for p in whole.transformer.h[1].parameters())
    total = sum(p.numel() * p.element_size() for p in whole.parameters())  # tied unembedding counted once
    cfg = compose(_model_overrides("tiny-gpt2", tmp_path, True))[1]
    assert planned_weight_bytes(cfg.model) == {"cpu": total - on_disk, "disk": on_disk}
    estimate = attribution_estimate(cfg)
    per_device = per_device_estimates(cfg.model, estimate)
    # the CPU runs every layer (the disk block is streamed to it): all but the disk's weights
    assert per_device["cpu"].total_bytes == estimate.total_bytes - estimate.terms["weights"] + total - on_disk
    assert per_device["disk"].total_bytes == on_disk
    check(cfg, PIPELINE.selected(cfg), console=None)
    out = capsys.readouterr().err
    assert "estimated attribution peak per device" in out and "disk" in out
    assert planned_weight_bytes(compose(["model.precision=float32"])[1].model) is None
