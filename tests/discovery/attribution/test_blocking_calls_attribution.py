"""EAP and EAP-IG make the host wait for the device a constant number of times per model pass.

On an accelerator every `.item()`, host copy, `torch.unique` or tensor-valued `if` in a pass
stops the host until the device catches up; one per layer or per example turns a device-bound
loop into a Python-bound one. On the CPU they cost nothing, so they are counted
(`circuitkit.core.syncs.BlockingCalls`), over one attribution stage of 1 batch and of 2 batches:

    per batch = calls(2 batches) - calls(1 batch)      fixed = calls(1 batch) - per batch

A pass is one forward or forward+backward of a batch: 2 + m per batch (clean and corrupted
runs, m interpolation points). The budget is 2 per pass; what remains today is Hugging Face's
own mask check (`_ignore_causal_mask_sdpa`: two reads of a padded batch's attention mask), so a
batch without padding waits for nothing. Models of two depths make the same calls, so a wait
per layer fails here.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from circuitkit.core.syncs import BlockingCalls
from circuitkit.discovery.attribution import attribute
from circuitkit.discovery.attribution.metrics import answer_forward
from circuitkit.discovery.tasks.base import random_pairs
from circuitkit.models.adapters import get_adapter

VOCAB, SEQ, BATCH, STEPS = 256, 8, 2, 2
MAX_PER_PASS = 2
MAX_FIXED = 5  # per stage: the collate's two reads of host data, the one copy of the sums, the metrics
CASES = [("eap", "node"), ("eap", "edge"), ("eap-ig", "node"), ("eap-ig", "edge")]


@functools.cache
def adapter(family: str, n_layers: int):
    """A random model of `family` with `n_layers` layers (frozen, float32)."""
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layers, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    else:  # RMSNorm, grouped K/V heads, rotary positions
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                                             hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                             pad_token_id=0))
    model.eval().requires_grad_(False)
    return get_adapter(model)


def pairs(n_batches: int, padded: bool):
    """BATCH x n_batches pairs; `padded`: every other pair 3 tokens shorter, so every batch of
    consecutive pairs is padded."""
    data = random_pairs(BATCH * n_batches, SEQ, VOCAB, seed=n_batches)
    if padded:
        data.attention_mask[::2, SEQ - 3:] = 0
        data.answer_pos[::2] = SEQ - 4
    return data


def passes_per_batch(algorithm: str) -> int:
    return 2 + (1 if algorithm == "eap" else STEPS)


def calls(family: str, n_layers: int, algorithm: str, level: str, n_batches: int, padded: bool) -> dict[str, int]:
    """Blocking calls by name of one attribution stage over `n_batches` batches, per-example rows
    kept (the pipeline's default)."""
    model, data = adapter(family, n_layers), pairs(n_batches, padded)
    with BlockingCalls() as counted:
        attribute(model, data, algorithm, level, ig_steps=STEPS, batch_size=BATCH, progress=False,
                  per_example=True, group_by_length=not padded)
    return dict(counted.by_name)


@pytest.mark.parametrize("algorithm,level,padded", [(a, lv, False) for a, lv in CASES] + [
    ("eap-ig", "node", True), ("eap-ig", "edge", True)])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocking_calls_per_pass_are_few_and_do_not_grow_with_layers_or_batches(family, algorithm, level, padded):
    one = calls(family, 2, algorithm, level, 1, padded)
    two = calls(family, 2, algorithm, level, 2, padded)
    deep = calls(family, 4, algorithm, level, 2, padded)
    per_batch = sum(two.values()) - sum(one.values())
    fixed = sum(one.values()) - per_batch
    passes = passes_per_batch(algorithm)
    assert per_batch <= MAX_PER_PASS * passes, f"{per_batch} per batch of {passes} passes: {two}"
    if not padded:  # nothing of ours waits in a pass: only the model's mask check of a padded batch
        assert per_batch == 0, f"{per_batch} per batch without padding: {two}"
    assert fixed <= MAX_FIXED, f"{fixed} per stage: {one}"
    assert deep == two, f"2 layers: {two}; 4 layers: {deep}"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_collated_batches_call_the_model_as_the_device_lookup_did(family):
    """The answer columns made at collate time are torch.unique's, and a batch without padding,
    called without its all-ones mask, gives the same answer logits bit for bit."""
    model = adapter(family, 2).model
    data = pairs(2, padded=True)
    data.attention_mask[BATCH:] = 1  # the second batch: no padding
    data.answer_pos[BATCH:] = torch.tensor([SEQ - 1, 2])
    padded, full = list(data.batches(BATCH))
    assert padded.padded and padded.forward_mask is padded.attention_mask
    assert not full.padded and full.forward_mask is None
    for batch in (padded, full):
        keep, row = torch.unique(batch.answer_pos, return_inverse=True)
        assert torch.equal(batch.answers.keep, keep) and torch.equal(batch.answers.row, row)
        with torch.no_grad():
            collated = answer_forward(model, batch.clean_ids, batch.forward_mask, batch.answers)
            looked_up = answer_forward(model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        assert torch.equal(collated, looked_up)


def test_per_example_rows_and_sums_leave_the_device_once_per_stage():
    """Per-example rows of every layer and batch reach the host as one stage's sums do: the
    rows add up to the scores."""
    data = pairs(3, padded=False)
    s = attribute(adapter("gpt2", 4), data, "eap-ig", "edge", ig_steps=STEPS, batch_size=BATCH, progress=False,
                  per_example=True, sums=True)
    torch.testing.assert_close(s.per_example["head"].sum(0), s.head, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.per_example["edges"].sum(0), s.edges, rtol=1e-5, atol=1e-6)
