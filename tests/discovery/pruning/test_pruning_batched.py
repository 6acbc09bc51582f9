"""Many head circuits in one forward (`Evaluator.many`, `circuitkit.discovery.pruning.circuit_forward`):
each circuit's figure is the one it gets alone, through the plain hooked forward, whatever else
shares its forward, under every ablation, on every family."""

from __future__ import annotations

import functools

import pytest
import torch

from circuitkit.discovery.attribution.eap import record_head_runs
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.circuit_forward import ablate_heads, shared_prefix
from circuitkit.discovery.pruning.heads import Evaluator, mean_z
from circuitkit.discovery.pruning.pillars import random_baseline, random_same_shape
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model

FAMILIES = ["tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-qwen3-moe"]


@functools.cache
def loaded(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))


@functools.cache
def pairs(name: str, n: int = 10):
    """Induction pairs of several lengths whose corruption starts at different positions (so the
    evaluator's batches share prefixes of different lengths)."""
    lm = loaded(name)
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16), n, 0)
    for i in range(n):  # each pair's clean and corrupted prompts agree up to position 3 + i % 5
        agree = 3 + i % 5
        data.corrupted_ids[i, :agree] = data.clean_ids[i, :agree]
        cut = int(data.answer_pos[i]) - i % 3  # shorter pairs: right padding of several widths
        if i % 3 and cut > agree:
            data.attention_mask[i, cut + 1:] = 0
            data.answer_pos[i] = cut
    return data


def reference(adapter, data, kept, ablation, means, batch_size=4) -> float:
    """One circuit through the plain forward: every position, one mask, the data's own batches."""
    total = 0.0
    values_of = {"zero": lambda z: [None] * adapter.n_layers, "corrupted": lambda z: z,
                 "mean": lambda z: [v[None] for v in means]}[ablation]
    for batch, clean, z, _ in record_head_runs(adapter, data, batch_size, corrupted=ablation == "corrupted"):
        with torch.no_grad(), ablate_heads(adapter, ~kept, values_of(z)):
            logits = answer_forward(adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        total += compute_metric("logit_diff", logits, batch, clean).sum().item()
    return total / len(data)


def masks(adapter, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, adapter.n_layers, adapter.n_heads, generator=g) < 0.5


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("ablation", ["zero", "mean", "corrupted"])
def test_batched_circuits_equal_each_circuit_alone(name, ablation):
    lm, data = loaded(name), pairs(name)
    a = lm.adapter
    means = mean_z(a, data, 4) if ablation == "mean" else None
    kept = masks(a, 7)
    kept[3] = kept[1]  # a repeated circuit
    kept[5] = True  # the full model
    # 2 circuits per forward: chunks of 2, 2, 1 and of other sizes for the 7 distinct circuits
    ev = Evaluator(a, data, "logit_diff", ablation, means, 4, circuit_forward_tokens=2 * 4 * data.clean_ids.shape[1])
    together = ev.many(kept)
    alone = [reference(a, data, k, ablation, means) for k in kept]
    assert together == pytest.approx(alone, rel=1e-5, abs=1e-5)
    assert together[3] == together[1] and together[5] == ev.m_clean
    # one at a time, or all in one forward: the same figures
    wide = Evaluator(a, data, "logit_diff", ablation, means, 4, circuit_forward_tokens=10**6)
    assert wide.many(kept) == pytest.approx([ev(k) for k in kept], rel=1e-5, abs=1e-5)


def test_the_corrupted_prefix_runs_once_per_batch():
    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    prefix = shared_prefix(data)
    first = [next((t for t, (c, x) in enumerate(zip(clean, bad, strict=True)) if c != x), len(clean))
             for clean, bad in zip(data.clean_ids.tolist(), data.corrupted_ids.tolist(), strict=True)]
    assert prefix.tolist() == [min(f, int(p)) for f, p in zip(first, data.answer_pos, strict=True)]
    assert min(prefix.tolist()) >= 3
    ev = Evaluator(lm.adapter, data, "logit_diff", "corrupted", None, 4)
    assert min(ev.prefixes) >= 3  # batched by shared prefix: every batch skips its first positions


def test_the_random_baseline_is_the_one_measured_circuit_by_circuit():
    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    a = lm.adapter
    ev = Evaluator(a, data, "logit_diff", "corrupted", None, 4)
    kept = masks(a, 1, seed=3)[0]
    m_full, m_empty = ev(None), ev(torch.zeros_like(kept))
    ours = (ev(kept) - m_empty) / (m_full - m_empty)
    batched = random_baseline(ev, kept, ours, m_full, m_empty, 30, seed=0)
    one_by_one = random_baseline(lambda m: reference(a, data, m, "corrupted", None), kept, ours, m_full, m_empty, 30,
                                 seed=0)
    assert batched == pytest.approx(one_by_one, rel=1e-5, abs=1e-5)
    # the circuit itself among the random ones is a tie, exactly
    same_shape = random_same_shape(kept, 30, 0)
    assert batched["n"] == 30 and len(same_shape) == 30
