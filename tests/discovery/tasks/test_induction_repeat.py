"""The repeated-span induction format and the learned head mask."""

from __future__ import annotations

import functools

import pytest
import torch

from circuitkit.discovery.attribution import attribute
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.heads import Evaluator, keep_top
from circuitkit.discovery.pruning.optimize import install_head_mask, learn_head_mask
from circuitkit.discovery.tasks import build_task, corruption_of
from circuitkit.models.config import ModelConfig
from circuitkit.models.hooks import HookSet
from circuitkit.models.loading import load_model

KNOWN = {(0, 2), (1, 1)}  # the induction fixture's circuit: previous-token head L0H2 -> induction head L1H1


@functools.cache
def setup():
    lm = load_model(ModelConfig(name="builtin:induction", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="repeat"), 24, 0)
    return lm, data


@pytest.mark.parametrize("seq_len", [8, 9, 16, 24, 33])
def test_repeat_pairs_swap_the_query_and_the_answer_in_the_first_copy(seq_len):
    lm, _ = setup()
    d = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=seq_len, induction_format="repeat"), 40, 1)
    assert d.clean_ids.shape == (40, seq_len)
    for i in range(len(d)):
        clean, corr = d.clean_ids[i].tolist(), d.corrupted_ids[i].tolist()
        diff = [j for j in range(seq_len) if clean[j] != corr[j]]
        assert len(diff) == 2 and diff[1] == diff[0] + 1  # two neighbours swapped
        assert (clean[diff[0]], clean[diff[1]]) == (corr[diff[1]], corr[diff[0]])
        query, good, bad = clean[-1], int(d.correct[i, 0]), int(d.incorrect[i, 0])
        # clean: the query's first occurrence is followed by the answer; corrupted: by the incorrect one
        assert clean[clean.index(query) + 1] == good and corr[corr.index(query) + 1] == bad
        assert good in clean and bad in clean and good in corr and bad in corr
    assert corruption_of("induction", DataParams(induction_format="repeat")) == "swap"
    assert corruption_of("induction", DataParams(induction_format="single")) == "key"
    assert corruption_of("induction", DataParams()) == "swap"  # the default format


def test_repeat_format_finds_the_known_circuit_on_the_fixture():
    lm, data = setup()
    scores = attribute(lm.adapter, data[:12], "eap-ig", "node", ig_steps=5, batch_size=4, progress=False)
    top = {tuple(x) for x in keep_top(scores.head, 2, "abs").nonzero().tolist()}
    assert top == KNOWN
    ev = Evaluator(lm.adapter, data[12:], "logit_diff", "corrupted", None, 4)
    assert ev.m_clean > 5 and ev(torch.zeros(scores.head.shape, dtype=torch.bool)) < -5  # the swap flips the answer


def test_learned_head_mask_keeps_the_known_circuit_and_sheds_density():
    """Warm-started from EAP-IG, the mask keeps the two known heads on top while its loss and mean density fall."""
    lm, data = setup()
    scores = attribute(lm.adapter, data[:12], "eap-ig", "node", ig_steps=5, batch_size=4, progress=False)
    seen = []
    theta = learn_head_mask(lm.adapter, data[:12], scores.head, steps=20, batch_size=4, init_density=0.5,
                            progress=lambda step, loss, faith, density: seen.append((loss, faith, density)))
    assert {tuple(x) for x in keep_top(theta, 2, "signed").nonzero().tolist()} == KNOWN
    assert seen[-1][0] < seen[0][0] and seen[-1][2] < seen[0][2]
    assert theta.shape == scores.head.shape and torch.isfinite(theta).all()


def test_soft_head_mask_at_0_and_1_is_the_pruning_evaluator():
    lm, data = setup()
    ev = Evaluator(lm.adapter, data[12:], "logit_diff", "corrupted", None, 4)
    for heads in ([(1, 1)], [(0, 2), (1, 1)], [(0, 0), (1, 3)]):
        kept = torch.zeros(lm.adapter.n_layers, lm.adapter.n_heads, dtype=torch.bool)
        for h in heads:
            kept[h] = True
        total = 0.0
        for batch, clean_answer, corrupted_z in ev.batches:
            with torch.no_grad(), HookSet() as hk:
                install_head_mask(lm.adapter, hk, kept.float(), corrupted_z)
                logits = answer_forward(lm.adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
            total += compute_metric("logit_diff", logits, batch, clean_answer).sum().item()
        assert total / ev.n == pytest.approx(ev(kept), abs=1e-5)


def test_head_mask_rejects_pairs_without_a_gap():
    lm, data = setup()
    same = data[:4]
    same.corrupted_ids = same.clean_ids.clone()
    with pytest.raises(ValueError, match="differ on the metric"):
        learn_head_mask(lm.adapter, same, torch.zeros(2, 4), steps=1, batch_size=4)


def test_pruning_selection_mask_at_head_scope_keeps_the_known_circuit(caplog):
    from circuitkit.discovery.config import PruningConfig
    from circuitkit.discovery.pruning.heads import prune

    lm, data = setup()
    scores = attribute(lm.adapter, data[:12], "eap-ig", "node", ig_steps=5, batch_size=4, progress=False)
    p = PruningConfig(scope="heads", target_sparsity=0.75, selection="mask", mask_steps=6, graph=False,
                      bootstrap_resamples=0)
    found = prune(lm.adapter, scores, data[:12], data[12:], p, "logit_diff", 4)
    assert found.extra["selection"] == "mask" and "mask by abs" in found.extra["curve_definition"]
    assert {tuple(x) for x in found.head_mask.nonzero().tolist()} == KNOWN
    assert found.metrics["faithfulness"] > 0.8


@pytest.mark.parametrize("seq_len", [8, 16, 24])
def test_fresh_corruption_replaces_the_first_copy_and_keeps_the_clean_prompts(seq_len):
    """`fresh` leaves nothing to copy; clean prompts and answers are those of `swap`."""
    lm, _ = setup()
    dp = DataParams(seq_len=seq_len, induction_format="repeat", induction_corruption="fresh")
    fresh = build_task("induction", lm.tokenizer, lm.path, dp, 30, 3)
    swap = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=seq_len, induction_format="repeat"), 30, 3)
    assert torch.equal(fresh.clean_ids, swap.clean_ids) and torch.equal(fresh.correct, swap.correct)
    assert torch.equal(fresh.incorrect, swap.incorrect)
    k = (seq_len + 2) // 2
    for i in range(len(fresh)):
        clean, corr = fresh.clean_ids[i].tolist(), fresh.corrupted_ids[i].tolist()
        span = clean[1:1 + k]
        assert not set(corr[1:1 + k]) & set(clean)  # the first copy is fresh: none of the clean prompt's symbols
        assert corr[1 + k:] == clean[1 + k:]  # the filler and the second copy are unchanged
        good, bad = int(fresh.correct[i, 0]), int(fresh.incorrect[i, 0])
        assert good in span and bad in span and good not in corr and bad not in corr
    assert corruption_of("induction", dp) == "fresh"
    assert corruption_of("induction", DataParams(induction_format="single", induction_corruption="fresh")) == "key"


def test_fresh_corruption_finds_both_heads_of_the_known_circuit():
    lm, _ = setup()
    dp = DataParams(seq_len=16, induction_format="repeat", induction_corruption="fresh")
    data = build_task("induction", lm.tokenizer, lm.path, dp, 24, 0)
    scores = attribute(lm.adapter, data[:12], "eap-ig", "node", ig_steps=5, batch_size=4, progress=False)
    top = {tuple(x) for x in keep_top(scores.head, 2, "abs").nonzero().tolist()}
    assert top == KNOWN
    ev = Evaluator(lm.adapter, data[12:], "logit_diff", "corrupted", None, 4)
    assert ev.m_clean > 5 and abs(ev(torch.zeros(scores.head.shape, dtype=torch.bool))) < ev.m_clean / 2


def test_fresh_corruption_names_what_it_needs_when_symbols_run_short():
    from circuitkit.discovery.tasks import TaskError
    from circuitkit.discovery.tasks.induction import build_repeat

    lm, _ = setup()
    with pytest.raises(TaskError, match="induction_corruption=fresh at seq_len=.*distinct symbols"):
        build_repeat(lm.tokenizer, lm.path, 2, 4096, 0, "fresh")
    with pytest.raises(TaskError, match="allowed: swap, fresh"):
        build_repeat(lm.tokenizer, lm.path, 2, 16, 0, "abc")
