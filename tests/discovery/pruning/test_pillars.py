"""The verdict's pillars on the induction fixture, whose circuit (L0H2 -> L1H1) is known."""

from __future__ import annotations

import functools

import torch

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.heads import Evaluator, faithfulness
from circuitkit.discovery.pruning.pillars import (
    magnitude_scores,
    random_baseline,
    random_same_shape,
    top_heads_like,
    verdict_rows,
    wanda_scores,
)
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model

KNOWN = {(0, 2), (1, 1)}


@functools.cache
def setup():
    lm = load_model(ModelConfig(name="builtin:induction", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="repeat"), 16, 0)
    ev = Evaluator(lm.adapter, data, "logit_diff", "corrupted", None, 8)
    kept = torch.zeros(lm.adapter.n_layers, lm.adapter.n_heads, dtype=torch.bool)
    for layer, head in KNOWN:
        kept[layer, head] = True
    return lm, data, ev, kept


def test_random_circuits_keep_the_per_layer_shape():
    _, _, _, kept = setup()
    masks = random_same_shape(kept, 20, 0)
    assert all(torch.equal(m.sum(1), kept.sum(1)) for m in masks)
    assert len({tuple(m.flatten().tolist()) for m in masks}) > 1  # not all the same
    assert all(torch.equal(a, b) for a, b in zip(masks, random_same_shape(kept, 20, 0), strict=True))


def test_the_known_circuit_beats_random_circuits_and_is_necessary():
    _, _, ev, kept = setup()
    m_full, m_empty = ev(None), ev(torch.zeros_like(kept))
    ours = faithfulness(ev(kept), m_full, m_empty)
    base = random_baseline(ev, kept, ours, m_full, m_empty, n=20, seed=0)
    # a random circuit of this shape is the known one itself now and then (ties count half)
    assert ours > 0.8 and base["percentile"] > 90 and base["mean"] < 0.5 and base["max"] <= ours
    # necessity: the full model with only the circuit removed loses the task
    assert faithfulness(ev(~kept), m_full, m_empty) < 0.3


def test_magnitude_and_wanda_scores_by_hand():
    lm, data, _, _ = setup()
    mag = magnitude_scores(lm.adapter)
    w = lm.adapter.o_weights(1)[0]  # (H, d_model, dh)
    assert torch.allclose(mag[1, 3], w[3].float().norm())
    wanda = wanda_scores(lm.adapter, data, 8)
    # by hand for one head: |W| times the norm of its input over every real token
    from circuitkit.discovery.attribution.eap import cached_run

    run = cached_run(lm.adapter, data.clean_ids, data.attention_mask, data.answer_pos, edges=False)
    dh = lm.adapter.head_dim
    z = run.z[1][data.attention_mask.bool()].float()[:, 3 * dh:4 * dh]  # (tokens, dh)
    expected = (w[3].float().abs() * z.norm(dim=0)[None]).sum()
    assert torch.allclose(wanda[1, 3], expected, rtol=1e-4)
    assert top_heads_like(wanda, 2).sum() == 2


def test_the_verdict_table_has_a_definition_per_row():
    rows = verdict_rows({"faithfulness": 0.9, "baseline_random": {"percentile": 99.0, "n": 100, "mean": 0.1,
                                                                   "p95": 0.3, "max": 0.5},
                         "necessity": 0.05, "robustness": {"fresh": 0.7}, "stability": None})
    assert [r["pillar"] for r in rows] == ["faithfulness", "baseline_random", "necessity", "robustness"]
    assert rows[1]["value"] == 99.0 and "100 random circuits" in rows[1]["detail"]
    assert rows[3]["value"] == 0.7 and all(r["definition"] for r in rows)


def test_a_pillar_not_measured_keeps_its_row_with_the_reason():
    rows = verdict_rows({"faithfulness": 0.9, "robustness": {"abc": float("nan"), "fresh": 0.6}},
                        {"generalization": "no held-out templates", "robustness": "seed 0"})
    by_name = {r["pillar"]: r for r in rows}
    assert list(by_name) == ["faithfulness", "robustness", "generalization"]  # others: no figure, no note
    assert by_name["robustness"]["value"] == 0.6  # the lowest finite figure
    assert by_name["robustness"]["detail"] == "abc nan, fresh 0.600; seed 0"
    assert by_name["generalization"]["value"] is None and by_name["generalization"]["detail"] == "no held-out templates"
