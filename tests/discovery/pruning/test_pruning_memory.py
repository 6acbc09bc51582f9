"""The pruning stage's memory estimate (circuitkit.discovery.pruning.memory) against the measured peak of
`prune` on tiny models, its record budget, and its place in the preflight."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import circuitkit.discovery.pruning.edges as pruning_edges
from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution.eap import AttributionScores, graph_of
from circuitkit.discovery.config import PruningConfig
from circuitkit.discovery.data_lengths import PRUNING_AT_DATA
from circuitkit.discovery.pruning.heads import prune
from circuitkit.discovery.pruning.memory import (
    PRUNING_MEMORY,
    estimate_pruning,
    pruning_advice,
    pruning_estimate,
)
from circuitkit.discovery.stages import CIRCUIT_STAGES
from circuitkit.discovery.tasks.base import random_pairs
from circuitkit.models.adapters import get_adapter
from circuitkit.preflight.memory import shape_from_config
from circuitkit.preflight.stage import PreflightError, check
from circuitkit_app.config import compose

V = 1024


def _model(family: str) -> torch.nn.Module:
    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_inner=256, n_positions=256, vocab_size=V)
    else:
        config = tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                hidden_size=64, intermediate_size=128, max_position_embeddings=256, vocab_size=V)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    return model.requires_grad_(False)


def _scores(adapter) -> AttributionScores:
    g = graph_of(adapter)
    gen = torch.Generator().manual_seed(0)
    valid = g.edge_mask()
    return AttributionScores(torch.randn(g.n_layers, g.n_heads, generator=gen), torch.randn(g.n_layers),
                             torch.tensor(0.0), g, torch.randn(valid.shape, generator=gen) * valid)


def _measure(model, scope: str, selection: str, batch: int, seq: int, n_eval: int, n_attr: int = 8,
             ablation: str = "corrupted", budget: int | None = None) -> tuple[int, int]:
    """(estimated, measured) peak bytes of `prune` (weights resident); `budget`: the edge record budget."""
    adapter = get_adapter(model)
    data = random_pairs(n_attr + n_eval, seq, V)
    p = PruningConfig(scope=scope, selection=selection, ablation=ablation, mask_steps=2, bootstrap_resamples=0)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        prune(adapter, _scores(adapter), data[:n_attr], data[n_attr:], p, "logit_diff", batch)
    est = estimate_pruning(shape_from_config(model.config), 4, batch, seq, n_eval, scope, ablation, selection, n_attr,
                           2, budget)
    return est.total_bytes, peak.peak_bytes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize(("scope", "selection"), [("heads", "top_k"), ("heads", "mask"), ("edges", "top_k"),
                                                 ("edges", "edge_pruning")])
def test_estimate_tracks_the_measured_peak_of_prune(family, scope, selection):
    # Tiny models: the weights are 12-52 % of the peak, so this checks the activation terms.
    est, measured = _measure(_model(family), scope, selection, batch=4, seq=32, n_eval=8)
    assert 0.90 <= est / measured <= 1.15, (family, scope, selection, est / measured)


def test_edge_records_past_the_budget_are_not_counted(monkeypatch):
    model = _model("llama")
    shape = shape_from_config(model.config)
    one_batch = estimate_pruning(shape, 4, 4, 32, 4, "edges").terms["recorded runs"]  # (n_up, 4, 32, d) + logits
    budget = int(1.5 * one_batch)  # room for one batch of writes out of four
    full = estimate_pruning(shape, 4, 4, 32, 16, "edges")
    bounded = estimate_pruning(shape, 4, 4, 32, 16, "edges", record_budget_bytes=budget)
    # one batch kept, the logits of all four, and the batch being recorded again for its forward
    assert bounded.terms["recorded runs"] == one_batch + 3 * 4 * V * 4 + (one_batch - 4 * V * 4)
    assert full.terms["recorded runs"] == 4 * one_batch
    # the evaluator reads RECORD_SHARE of the free memory: give it the same budget and measure
    monkeypatch.setattr(pruning_edges, "free_memory_bytes", lambda device=None: int(budget / pruning_edges.RECORD_SHARE))
    est, measured = _measure(model, "edges", "top_k", 4, 32, 16, budget=budget)
    assert est == bounded.total_bytes
    assert 0.90 <= est / measured <= 1.15, est / measured


def test_the_pruning_stage_declares_its_estimate_and_the_preflight_reads_it():
    stage = next(s for s in CIRCUIT_STAGES if s.name == "pruning")
    # at the tokenized prompts (circuitkit.discovery.data_lengths), the advice PRUNING_MEMORY's
    assert stage.memory is PRUNING_AT_DATA and PRUNING_MEMORY.advice is pruning_advice
    _, cfg = compose(["model=llama1b", "pruning.scope=edges", "discovery.level=edge", "discovery.batch_size=8",
                      "discovery.data_params.eval_examples=64", "discovery.data_params.seq_len=512"])
    free = 40 * 2**30
    est = pruning_estimate(cfg, free_bytes=free)
    assert est.terms["weights"] == 1235814400 * 2
    # 64 pairs x 529 upstream writes x 512 tokens x 2048 floats would be 141 GB: bounded by RECORD_SHARE
    assert est.terms["recorded runs"] <= 0.5 * free
    # the knob: the largest evaluation batch that fits (records unbounded at 4 pairs of 128 tokens)
    _, cfg = compose(["model=llama1b", "pruning.scope=edges", "discovery.level=edge", "discovery.batch_size=4",
                      "discovery.data_params.eval_examples=4", "discovery.data_params.seq_len=128"])
    budget = int(0.9 * 2 * pruning_estimate(cfg, batch_size=2, free_bytes=2**50).total_bytes)
    budget = pruning_estimate(cfg, batch_size=2, free_bytes=budget / 0.9).total_bytes
    assert pruning_advice(cfg, budget)[0].startswith("discovery.batch_size=2"), pruning_advice(cfg, budget)


def test_preflight_refuses_a_pruning_stage_that_cannot_fit(monkeypatch):
    import circuitkit.preflight.stage as preflight

    _, cfg = compose(["model=llama1b", "stages=[preflight,pruning]", "pruning.scope=edges", "discovery.level=edge",
                      "pruning.selection=edge_pruning", "discovery.batch_size=16",
                      "discovery.data_params.seq_len=1024"])
    monkeypatch.setattr(preflight, "free_memory_bytes", lambda device=None: 8 * 2**30)
    monkeypatch.setattr("circuitkit.discovery.pruning.memory.free_memory_bytes", lambda device=None: 8 * 2**30)
    with pytest.raises(PreflightError) as err:
        check(cfg, [s for s in CIRCUIT_STAGES if s.name == "pruning"])
    message = str(err.value)
    assert "estimated pruning peak" in message and "discovery.batch_size=" in message
    assert "pruning.selection=top_k" in message and "num_examples=" not in message


def test_the_pruning_stage_records_its_estimate_next_to_the_measured_peak(tmp_path):
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["stages=[preflight,data,attribution,pruning]", "model.precision=float32",
                      "discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=8",
                      "discovery.data_params.seq_len=32", "discovery.level=edge", "pruning.scope=edges",
                      "pruning.graph=false"])
    manifest = run_pipeline(cfg, tmp_path)
    pre, entry = manifest["stages"]["preflight"], manifest["stages"]["pruning"]
    assert pre["summary"]["pruning_estimated_bytes"] > 0 and (tmp_path / "memory_estimate_pruning.png").is_file()
    ratio = entry["estimated_peak_bytes"] / entry["measured_peak_bytes"]
    assert 0.85 < ratio < 1.2, ratio  # the stage also plots and saves; prune() alone is checked above
