"""MIB's (CPR, CMD) pair, ours against a recomputation that follows MIB's definition.

MIB (mttk/MIB-circuit-track-autoeval: eval_submissions.py runs `for absolute in (True, False)`, and
the aggregation files the abs-False run as CPR, the abs-True run as CMD; MIB_circuit_track/
evaluation.py evaluate_area_under_curve and eval_results/print_scores.py compute_area): at each
share x of (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1) keep the top int(x * n_edges) edges
(signed score for CPR, |score| for CMD), patch the rest with the corrupted run, f = (m(circuit) -
m(empty)) / (m(model) - m(empty)), CPR = trapezoid area under f of the signed ranking, CMD =
trapezoid area of |1 - f| of the |score| ranking, on a linear x axis.
"""

from __future__ import annotations

import functools

import pytest
import torch

from circuitkit.discovery.attribution import attribute
from circuitkit.discovery.config import DataParams, PruningConfig
from circuitkit.discovery.pruning.edges import EdgeEvaluator
from circuitkit.discovery.pruning.heads import curve_areas, prune
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from tests.helpers.reference_edges import reference_metric

SHARES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@functools.cache
def setup():
    lm = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="single"), 7, 0)
    scores = attribute(lm.adapter, data[:4], "eap-ig", "edge", ig_steps=2, batch_size=4, progress=False,
                       ig_rule="left")
    return lm, data[:4], data[4:], scores


def mib_areas(ev: EdgeEvaluator, scores: torch.Tensor, valid: torch.Tensor, absolute: bool) -> tuple[float, float]:
    """(area_under, area_from_1) of MIB's curve, every point measured the direct way (reference_metric)."""
    idx = valid.flatten().nonzero().flatten()
    n = len(idx)
    key = scores.flatten()[idx].tolist()
    order = sorted(range(n), key=lambda i: -abs(key[i]) if absolute else -key[i])
    m_model = reference_metric(ev, valid)
    m_empty = reference_metric(ev, torch.zeros_like(valid))
    fs = []
    for x in SHARES:
        kept = torch.zeros(valid.numel(), dtype=torch.bool)
        kept[idx[order[:int(x * n)]]] = True
        fs.append((reference_metric(ev, kept.view(valid.shape)) - m_empty) / (m_model - m_empty))
    under = sum((x2 - x1) * (f1 + f2) / 2 for x1, x2, f1, f2 in zip(SHARES, SHARES[1:], fs, fs[1:], strict=False))
    from_1 = sum((x2 - x1) * (abs(1 - f1) + abs(1 - f2)) / 2 for x1, x2, f1, f2 in zip(SHARES, SHARES[1:], fs, fs[1:], strict=False))
    return under, from_1


def test_mib_pair_matches_mibs_definition_and_either_rank_by_gives_it():
    lm, attr, held, s = setup()
    found = {}
    for rank_by in ("abs", "signed"):
        p = PruningConfig(scope="edges", ablation="corrupted", selection="top_k", rank_by=rank_by,
                          target_sparsity=0.9, bootstrap_resamples=0, graph=False)
        found[rank_by] = prune(lm.adapter, s, attr, held, p, "logit_diff", 3)
    mib = found["abs"].extra["mib"]
    assert mib["cpr_rank_by"] == "signed" and mib["cmd_rank_by"] == "abs"
    ev = EdgeEvaluator(lm.adapter, held, "logit_diff", "corrupted", None, 3)
    valid = s.graph.edge_mask()
    cpr = mib_areas(ev, s.edges, valid, absolute=False)[0]
    cmd = mib_areas(ev, s.edges, valid, absolute=True)[1]
    # the evaluator and the direct form agree to ~1e-4 in the metric (test_selection), and f divides by
    # m(model) - m(empty): relative agreement
    assert mib["cpr"] == pytest.approx(cpr, rel=2e-4) and mib["cmd"] == pytest.approx(cmd, rel=2e-4)
    # the same pair whichever rank_by the run used; each run's own cpr/cmd are its ranking's areas
    other = found["signed"].extra["mib"]
    assert other["cpr"] == pytest.approx(mib["cpr"], abs=1e-6) and other["cmd"] == pytest.approx(mib["cmd"], abs=1e-6)
    assert found["signed"].cpr == pytest.approx(mib["cpr"], abs=1e-6)
    assert found["abs"].cmd == pytest.approx(mib["cmd"], abs=1e-6)
    assert curve_areas(mib["curve_signed"])[0] == pytest.approx(mib["cpr"])
    # the abs ranking's CPR is not MIB's CPR (the issue: ours labelled it MIB's for both)
    assert abs(found["abs"].cpr - mib["cpr"]) > 1e-3
    text = found["abs"].extra["curve_definition"]
    assert "MIB's circuit-track setting for its CMD" in text and f"CPR {mib['cpr']:.4f} (signed ranking)" in text
    assert "for its CPR" in found["signed"].extra["curve_definition"]


def test_no_mib_pair_outside_mibs_setting():
    from circuitkit.discovery.pruning.heads import curve_definition, mib_setting

    assert mib_setting("edges", "corrupted", "top_k")
    assert not any(mib_setting(*c) for c in (("heads", "corrupted", "top_k"), ("edges", "zero", "top_k"),
                                             ("edges", "mean", "top_k"), ("edges", "corrupted", "bootstrap")))
    assert "not MIB's setting" in curve_definition("edges", "zero", "abs", "top_k", "logit_diff")
    assert "its CPR ranks by signed score" in curve_definition("heads", "corrupted", "abs", "top_k", "logit_diff")
