"""Rank-aggregating selection (`selection.RankSelector`) and any rule's stability over resamples
(`stability.selector_stability`); no model."""

from __future__ import annotations

import pytest
import torch

from circuitkit.discovery.pruning.selection import RankSelector, keep_top, rank_select
from circuitkit.discovery.pruning.stability import selector_stability, stability


def outlier_scores() -> torch.Tensor:
    """(8, 4): entry 0 scores 100 on one example and 0 elsewhere (mean 12.5); entry 1 scores 5 on
    every example (mean 5); entries 2, 3 score 1 and 0.5."""
    p = torch.tensor([[0.0, 5.0, 1.0, 0.5]]).repeat(8, 1)
    p[3, 0] = 100.0
    return p


@pytest.mark.parametrize("rule", ["mean_rank", "vote"])
def test_rank_rules_keep_the_consistent_entry_not_the_outlier(rule):
    p = outlier_scores()
    assert keep_top(p.mean(0), 1).tolist() == [True, False, False, False]  # the mean follows the outlier
    assert rank_select(p, 1, rule).tolist() == [False, True, False, False]
    assert rank_select(p, 2, rule).tolist() == [False, True, True, False]  # entry 0 is 2nd on 1 example of 8


def test_rank_selector_on_rows_is_the_rule_on_those_rows_and_skips_invalid():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(12, 5, 6, generator=gen)
    valid = torch.rand(5, 6, generator=gen) > 0.3
    rows = torch.tensor([0, 0, 3, 5, 5, 5, 7, 11])
    for rule in ("mean_rank", "vote"):
        sel = RankSelector(p, rule, "abs", valid)
        got = sel(7, rows)
        assert torch.equal(got, RankSelector(p[rows], rule, "abs", valid)(7))
        assert int(got.sum()) == 7 and not (got & ~valid).any()


def test_selector_stability_of_top_k_is_stability():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(16, 40, generator=gen) + torch.linspace(2, 0, 40)
    ref = stability(p, 10, "abs", 50, 0)
    got = selector_stability(16, lambda rows: keep_top(p[rows].mean(0), 10), keep_top(p.mean(0), 10), 50, 0)
    assert got["jaccard_mean"] == pytest.approx(ref["jaccard_mean"], abs=1e-6)
    assert got["jaccard_p5"] == pytest.approx(ref["jaccard_p5"], abs=1e-6)
    assert 0.3 < got["jaccard_mean"] < 1.0


def test_selector_stability_lists_sizes_and_a_fixed_rule_is_stable():
    fixed = torch.tensor([True, False, True])
    res = selector_stability(5, lambda rows: [fixed, ~fixed], [fixed, fixed], 20, 0)
    assert [r["jaccard_mean"] for r in res] == [1.0, 0.0]
    assert res[0]["n_resamples"] == 20 and res[0]["n_examples"] == 5


def test_prune_with_a_rank_rule_on_a_tiny_model_reports_the_rules_own_stability():
    from circuitkit.discovery.attribution import attribute
    from circuitkit.discovery.config import DataParams, PruningConfig
    from circuitkit.discovery.pruning.heads import prune
    from circuitkit.discovery.tasks import build_task
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model

    lm = load_model(ModelConfig(name="builtin:tiny-llama", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16), 10, 0)
    scores = attribute(lm.adapter, data[:6], "eap-ig", "edge", ig_steps=2, batch_size=6, progress=False,
                       per_example=True)
    valid = scores.graph.edge_mask()
    p = PruningConfig(scope="edges", target_sparsity=0.9, selection="vote", graph=False, bootstrap_resamples=20)
    found = prune(lm.adapter, scores, data[:6], data[6:], p, "logit_diff", 5)
    n = int(valid.sum()) - round(0.9 * int(valid.sum()))
    assert found.extra["selection"] == "vote"
    assert torch.equal(found.selection.mask, rank_select(scores.per_example["edges"], n, "vote", "abs", valid))
    own = selector_stability(6, lambda rows: RankSelector(scores.per_example["edges"], "vote", "abs", valid)(n, rows),
                             found.selection.mask, 20, 0)
    assert found.extra["stability"]["jaccard_mean"] == pytest.approx(own["jaccard_mean"])
    assert found.extra["stability"]["n_resamples"] == 20
