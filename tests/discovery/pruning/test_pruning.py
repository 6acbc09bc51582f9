"""Pruning: head/edge selection, ablation identities, circuit.pt, and the pruning stage's errors."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from circuitkit.discovery.attribution import attribute, graph_of
from circuitkit.discovery.circuit import apply_circuit, load_circuit, save_circuit
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator, mean_writes
from circuitkit.discovery.pruning.heads import Evaluator, ablate_heads, keep_top, mean_z, select_heads
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model


@functools.cache
def loaded(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))


@functools.cache
def pairs(name: str, n: int = 6):
    lm = loaded(name)
    return build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16), n, 0)


def test_select_heads_rounds_and_ranks():
    scores = torch.tensor([[0.5, -2.0, 0.1, 0.0], [1.0, -0.2, 3.0, 0.3]])
    sel = select_heads(scores, 0.5, "abs")
    assert sel.n_removed == 4 and sel.achieved_sparsity == 0.5
    assert sel.mask.tolist() == [[True, True, False, False], [True, False, True, False]]
    signed = select_heads(scores, 0.5, "signed")
    assert signed.mask.tolist() == [[True, False, False, False], [True, False, True, True]]
    assert select_heads(scores, 0.0).mask.all()


def test_sparsity_that_rounds_to_zero_heads_warns_with_achieved(caplog):
    with caplog.at_level(logging.WARNING):
        sel = select_heads(torch.randn(2, 4), 0.05)
    assert sel.n_removed == 0 and sel.mask.all()
    assert "achieved sparsity 0.0" in caplog.text and "0.0625" in caplog.text


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-qwen3-moe"])
def test_circuit_with_no_head_removed_is_bit_identical_and_all_removed_is_empty(name):
    lm, data = loaded(name), pairs(name)
    a = lm.adapter
    means = mean_z(a, data, 3)
    circuit = {"head_mask": torch.ones(a.n_layers, a.n_heads, dtype=torch.bool), "ablation": "mean", "mean_z": means,
               "model_name": name}
    with torch.no_grad():
        ref = lm.model(input_ids=data.clean_ids).logits
        with apply_circuit(a, circuit):
            same = lm.model(input_ids=data.clean_ids).logits
        evaluator = Evaluator(a, data, "logit_diff", "mean", means, 3)
        empty = evaluator(torch.zeros(a.n_layers, a.n_heads, dtype=torch.bool))  # nothing kept
        with apply_circuit(a, {**circuit, "head_mask": torch.zeros_like(circuit["head_mask"])}):
            logits = lm.model(input_ids=data.clean_ids).logits
    assert torch.equal(ref, same)
    from circuitkit.discovery.attribution.metrics import compute_metric
    assert abs(compute_metric("logit_diff", logits, data).mean().item() - empty) < 1e-6


def test_zero_ablation_sets_z_to_zero():
    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    removed = torch.zeros(lm.adapter.n_layers, lm.adapter.n_heads, dtype=torch.bool)
    removed[1, 2] = True
    seen = {}

    def grab(module, args):
        seen["z"] = args[0]
    with torch.no_grad(), ablate_heads(lm.adapter, removed, [None] * lm.adapter.n_layers):
        handle = lm.adapter.z_input(1).register_forward_pre_hook(grab)  # runs after the ablation hook
        lm.model(input_ids=data.clean_ids)
    handle.remove()
    dh = lm.adapter.head_dim
    assert seen["z"][..., 2 * dh:3 * dh].abs().max() == 0
    assert seen["z"][..., : 2 * dh].abs().max() > 0


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-qwen3-moe"])
def test_edge_circuit_identities(name):
    """All edges kept = the model; none kept with corrupted ablation = the corrupted run."""
    lm, data = loaded(name), pairs(name)
    valid = graph_of(lm.adapter).edge_mask()
    s = attribute(lm.adapter, data, "eap", "node", progress=False)
    ev = EdgeEvaluator(lm.adapter, data, "logit_diff", "corrupted", None, 3)
    assert ev(valid) == pytest.approx(ev(None), abs=1e-6)
    assert ev(torch.zeros_like(valid)) == pytest.approx(s.metric_corrupted, abs=1e-5)
    ev_mean = EdgeEvaluator(lm.adapter, data, "logit_diff", "mean", mean_writes(lm.adapter, data, 3), 3)
    assert ev_mean(valid) == pytest.approx(ev(None), abs=1e-6)


def test_edge_evaluator_past_its_memory_budget_recomputes_the_same_values(monkeypatch):
    """Ablated writes that do not fit the budget are recomputed per use: the same metric, bit for bit."""
    from circuitkit.discovery.pruning import edges as pruning_edges

    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    valid = graph_of(lm.adapter).edge_mask()
    kept = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(0)) < 0.3)
    recorded = EdgeEvaluator(lm.adapter, data, "logit_diff", "corrupted", None, 3)
    one = recorded.batches[0][2].numel() * 4
    assert recorded.recomputed == 0
    for budget, expect in ((0, len(recorded.batches)), (one, len(recorded.batches) - 1)):
        ev = EdgeEvaluator(lm.adapter, data, "logit_diff", "corrupted", None, 3, record_budget_bytes=budget)
        assert ev.recomputed == expect and ev.m_clean == recorded.m_clean and ev.m_corrupted == recorded.m_corrupted
        assert ev(kept) == recorded(kept)
    # The default budget is a share of the free device memory.
    monkeypatch.setattr(pruning_edges, "free_memory_bytes", lambda device=None: int(one / pruning_edges.RECORD_SHARE))
    assert EdgeEvaluator(lm.adapter, data, "logit_diff", "corrupted", None, 3).recomputed == len(recorded.batches) - 1


def test_keep_top_respects_valid_entries():
    scores = torch.tensor([[5.0, 1.0], [9.0, 2.0]])
    valid = torch.tensor([[True, True], [False, True]])
    assert keep_top(scores, 2, "abs", valid).tolist() == [[True, False], [False, True]]


def test_circuit_pt_round_trips_with_weights_only(tmp_path):
    circuit = {"model_name": "m", "model_revision": None, "head_mask": torch.ones(2, 3, dtype=torch.bool),
               "head_scores": torch.randn(2, 3), "edge_scores": None, "metrics": {"full": 1.0, "faithfulness": 0.9},
               "curve": [{"percent_kept": 10, "faithfulness": 0.5}], "config": {"a": {"b": [1, 2]}},
               "ablation": "zero", "versions": {"torch": torch.__version__}}
    path = save_circuit(tmp_path / "c.pt", circuit)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    back = load_circuit(path)
    assert back["format_version"] == 2 and torch.equal(back["head_mask"], circuit["head_mask"])
    assert back["metrics"] == circuit["metrics"] and back["config"] == circuit["config"]
    with pytest.raises(FileNotFoundError, match="pruning stage"):
        load_circuit(tmp_path / "missing.pt")


def test_pruning_without_scores_names_the_missing_stage(tmp_path):
    from circuitkit.core.pipeline import PipelineError
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["stages=[data,pruning]", "model.precision=float32", "discovery.data_params.num_examples=4",
                      "discovery.data_params.eval_examples=2", "discovery.data_params.seq_len=16"])
    with pytest.raises(PipelineError, match="scores.safetensors does not exist.*add 'attribution'"):
        run_pipeline(cfg, tmp_path)
    assert (tmp_path / "data.safetensors").is_file()  # the earlier stage's artifact is kept


def test_edge_scope_pipeline_on_the_induction_model(tmp_path):
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["model=induction", "stages=[data,attribution,pruning]", "discovery.level=edge",
                      "pruning.scope=edges", "pruning.target_sparsity=0.9", "pruning.ablation=corrupted",
                      "discovery.data_params.num_examples=16", "discovery.data_params.eval_examples=16",
                      "discovery.data_params.seq_len=64", "discovery.batch_size=16"])
    manifest = run_pipeline(cfg, tmp_path)
    summary = manifest["stages"]["pruning"]["summary"]
    circuit = load_circuit(tmp_path / "circuit.pt")
    assert circuit["scope"] == "edges" and circuit["edge_mask"].shape == circuit["edge_scores"].shape
    assert summary["achieved_sparsity"] == pytest.approx(0.9, abs=0.01)
    assert circuit["head_mask"][0, 2] and circuit["head_mask"][1, 1]  # prev-token and induction heads
    assert summary["faithfulness"] > 0.8, summary
