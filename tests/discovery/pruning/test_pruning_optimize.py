"""Edge pruning warm-started from attribution scores (`pruning.selection=edge_pruning`)."""

from __future__ import annotations

import functools

import pytest
import torch

from circuitkit.discovery.attribution import attribute, graph_of
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.config import DataParams, PruningConfig
from circuitkit.discovery.pruning.edges import EdgeEvaluator, _install_edge_circuit
from circuitkit.discovery.pruning.heads import keep_top, prune
from circuitkit.discovery.pruning.optimize import learn_edge_mask, warm_start
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.hooks import HookSet
from circuitkit.models.loading import load_model


@functools.cache
def setup(name: str = "tiny-llama"):
    lm = load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="single"), 12, 0)
    scores = attribute(lm.adapter, data[:6], "eap-ig", "edge", ig_steps=2, batch_size=3, progress=False)
    return lm, data, scores, graph_of(lm.adapter).edge_mask()


def test_warm_start_keeps_the_scores_order_and_the_initial_density():
    scores = torch.tensor([[3.0, -5.0, 0.0, 1.0], [0.5, 2.0, -0.1, 9.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, True]])
    theta = warm_start(scores, valid, init_density=2 / 7, init_scale=2.0)
    order = theta[valid].argsort(descending=True).tolist()
    assert order == scores.abs()[valid].argsort(descending=True).tolist()
    assert int((theta[valid] > 0).sum()) == 2  # the top 2/7 of the 7 valid edges start above 0.5
    assert theta[1, 2] == 0.0  # outside valid: untouched
    # rank quantiles (r + 0.5) / 7: the best edge has q = 13/14
    q = torch.tensor(13 / 14)
    assert float(theta[1, 3]) == pytest.approx(2 * (torch.logit(q) - torch.logit(torch.tensor(5 / 7))).item(), abs=1e-5)


def test_soft_circuit_with_a_binary_mask_is_the_edge_circuit():
    lm, data, scores, valid = setup()
    ev = EdgeEvaluator(lm.adapter, data[6:], "logit_diff", "corrupted", None, 3)
    for n in (5, 40, 300):
        kept = keep_top(scores.edges, n, "abs", valid)
        total = 0.0
        for i, (batch, clean_answer, _) in enumerate(ev.batches):
            ablated = ev.ablated(i)
            with torch.no_grad(), HookSet() as hk:
                _install_edge_circuit(lm.adapter, hk, kept.float(), ablated, soft=True)
                logits = answer_forward(lm.adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
            total += compute_metric("logit_diff", logits, batch, clean_answer).sum().item()
        assert total / ev.n == pytest.approx(ev.forward(kept), abs=1e-5)


def test_learning_the_mask_lowers_its_loss_and_the_penalty_its_density():
    lm, data, scores, valid = setup()
    runs = {}
    for penalty in (0.0, 50.0):
        rows = []
        theta = learn_edge_mask(lm.adapter, data[:6], scores.edges, valid, "kl", steps=8, lr=0.2, penalty=penalty,
                                batch_size=6, progress=lambda *r, rows=rows: rows.append(r))
        runs[penalty] = rows
        assert theta.shape == scores.edges.shape and bool(torch.isinf(theta[~valid]).all())
        assert bool(torch.isfinite(theta[valid]).all())
    faith0 = [r[2] for r in runs[0.0]]
    # the same batch every step: the faithfulness term falls at every step (0.82 -> 0.57 when written)
    assert all(b < a for a, b in zip(faith0, faith0[1:], strict=False)) and faith0[-1] < 0.8 * faith0[0], faith0
    assert runs[50.0][-1][3] < runs[0.0][-1][3] - 0.01  # a heavy penalty leaves a sparser mask
    with pytest.raises(ValueError, match="mask_steps"):
        learn_edge_mask(lm.adapter, data[:6], scores.edges, valid, "kl", steps=0)


def test_the_mask_learned_with_recomputed_ablations_is_the_same(monkeypatch):
    """Past the evaluator's memory budget every step recomputes its batch's ablated writes: same θ."""
    from circuitkit.discovery.pruning import edges as pruning_edges

    lm, data, scores, valid = setup()
    kw = dict(metric="kl", steps=4, lr=0.2, batch_size=3)
    recorded = learn_edge_mask(lm.adapter, data[:6], scores.edges, valid, **kw)
    monkeypatch.setattr(pruning_edges, "free_memory_bytes", lambda device=None: 0)
    assert EdgeEvaluator(lm.adapter, data[:6], "kl", "corrupted", None, 3).recomputed == 2
    assert torch.equal(learn_edge_mask(lm.adapter, data[:6], scores.edges, valid, **kw), recorded)


def test_prune_with_edge_pruning_selects_by_the_learned_mask(caplog):
    lm, data, scores, valid = setup()
    p = PruningConfig(scope="edges", target_sparsity=0.95, selection="edge_pruning", mask_steps=3, mask_lr=0.2,
                      graph=False, bootstrap_resamples=0)
    found = prune(lm.adapter, scores, data[:6], data[6:], p, "logit_diff", 3)
    assert found.extra["selection"] == "edge_pruning"
    n_keep = int(found.selection.mask.sum())
    assert n_keep == int(valid.sum()) - found.selection.n_removed
    top = keep_top(scores.edges, n_keep, "abs", valid)
    assert not torch.equal(found.selection.mask, top)  # the optimized mask moved some edges
    assert "edge_pruning" in found.extra["curve_definition"]
    heads = prune(lm.adapter, scores, data[:6], data[6:], PruningConfig(selection="edge_pruning", graph=False,
                                                                         bootstrap_resamples=0), "logit_diff", 3)
    assert heads.extra["selection"] == "top_k" and "needs pruning.scope=edges" in caplog.text


def test_edge_pruning_keys_compose_and_are_checked():
    from circuitkit.core.config import ConfigError
    from circuitkit_app.config import compose

    _, cfg = compose(["pruning.scope=edges", "pruning.selection=edge_pruning", "pruning.mask_steps=7",
                      "pruning.mask_lr=0.3", "pruning.mask_penalty=0"])
    p = cfg.pruning
    assert (p.selection, p.mask_steps, p.mask_lr, p.mask_penalty) == ("edge_pruning", 7, 0.3, 0.0)
    for bad, key in (("pruning.mask_steps=0", "pruning.mask_steps"), ("pruning.mask_lr=0", "pruning.mask_lr"),
                     ("pruning.mask_penalty=-1", "pruning.mask_penalty")):
        with pytest.raises(ConfigError, match=key):
            compose([bad])
