"""The families added as one file each (Qwen3, Qwen3-MoE): the oracles every family meets, and
what is special to them (per-head q/k norms; experts in fused 3-D weights, which Gradian refuses
to leave out silently)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from circuitkit.discovery.attribution import attribute, exact_patching
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from circuitkit_app.config import compose

REPO = Path(__file__).resolve().parents[2]
NEW = ("tiny-qwen3", "tiny-qwen3-moe")


@functools.cache
def loaded(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))


def _script():
    spec = importlib.util.spec_from_file_location("check_memory_estimates",
                                                  REPO / "scripts" / "bench" / "check_memory_estimates.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_qwen3_has_per_head_qk_norms_and_moe_fused_experts():
    q, m = loaded("tiny-qwen3").adapter, loaded("tiny-qwen3-moe").adapter
    assert q.norm_spec(q.attn(0).q_norm).weight.shape == (q.head_dim,)
    assert not q.fused_experts and q.mlp_output_linear(0) is not None
    assert m.fused_experts and m.mlp_output_linear(0) is None
    assert m.d_mlp == 2 * 32  # top_k x expert width: what one token activates


@pytest.mark.parametrize("name", NEW)
def test_node_scores_agree_with_exact_patching_in_the_linear_limit(name):
    # EAP (one gradient at the clean run) vs exact activation patching: on these random models the
    # metric is close to linear in one node's patch, so the two agree closely (a wrong hook site,
    # e.g. z read after the q/k norms or the MoE write missed, breaks this by orders of magnitude).
    lm = loaded(name)
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="single"), 4, 0)
    eap = attribute(lm.adapter, data, "eap-ig", "node", ig_steps=20, batch_size=4, progress=False)
    exact = exact_patching(lm.adapter, data, "node", batch_size=4, progress=False)
    for a, b in ((eap.head, exact.head), (eap.mlp, exact.mlp)):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert corr > 0.95, (name, float(corr))


@pytest.mark.parametrize("name", NEW)
def test_attribution_and_grads_estimates_match_measured_peaks(name):
    script = _script()
    model = loaded(name).model
    for level in ("node", "edge"):
        row = script.measure_model(model, name, level, 4, 32, 3)
        assert abs(row.ratio - 1) <= script.TOLERANCE, row
    row = script.measure_grads_model(model, name, 64, 4, 16, 16)
    assert abs(row.ratio - 1) <= script.TOLERANCE, row


def _index(tmp_path, name: str, *extra: str):
    from circuitkit_app.stage_list import run_pipeline

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Mary and John {i}", "completion": " went home."}) + "\n"
                            for i in range(4)))
    _, cfg = compose(["stages=[grads]", f"model.name=builtin:{name}", "model.precision=float32",
                      "grads.projection_dim=8", f"grads.data_path={data}",
                      f"grads.index_dir={tmp_path / 'index'}", *extra])
    return run_pipeline(cfg, tmp_path / "run")


def test_moe_index_of_every_linear_is_refused_in_one_line(tmp_path):
    from circuitkit.core.pipeline import PipelineError

    with pytest.raises(PipelineError) as err:
        _index(tmp_path, "tiny-qwen3-moe")
    message = str(err.value)
    assert "\n" not in message and "mixture-of-experts weights stored as fused 3-D tensors" in message
    assert "grads.module_filter" in message and not (tmp_path / "index" / "manifest.json").exists()


@pytest.mark.parametrize("name", NEW)
def test_an_attention_only_index_records_its_share_of_the_parameters(tmp_path, name):
    from gradian.index.reader import IndexReader

    _index(tmp_path, name, "grads.module_filter=[attn]")
    model = loaded(name).model
    attention = sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n and n.endswith("proj.weight"))
    recorded = IndexReader(tmp_path / "index").manifest["parameter_share"]
    assert recorded == pytest.approx(attention / sum(p.numel() for p in model.parameters()), rel=1e-6)
    assert 0.05 < recorded < 0.5
