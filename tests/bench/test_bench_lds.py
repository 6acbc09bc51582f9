"""scripts/bench/bench_lds.py: the linear datamodeling score against hand-computed cases."""

from __future__ import annotations

import pytest

from scripts.bench.bench_lds import lds, score_matrix


def test_lds_is_one_for_the_true_linear_model_and_minus_one_for_its_opposite():
    # Two queries, four documents; the "actual" output is exactly linear in the subset's documents.
    tau = [[1.0, 2.0, 3.0, 4.0], [4.0, -1.0, 0.5, 2.0]]
    subsets = [[0, 1], [2, 3], [0, 3], [1, 2], [1, 3]]
    losses = [[-sum(tau[q][i] for i in s) for q in range(2)] for s in subsets]  # loss = -output
    assert lds(tau, subsets, losses)[0] == pytest.approx(1.0)
    assert lds([[-v for v in row] for row in tau], subsets, losses)[0] == pytest.approx(-1.0)


def test_lds_averages_spearman_per_query():
    tau = [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    subsets = [[0], [1], [2]]
    losses = [[-3.0, 3.0], [0.0, 0.0], [3.0, -3.0]]  # per subset: each query's loss
    # Query 0: predicted (1, 0, 0), actual -loss (3, 0, -3); query 1: (0, 0, 1) vs (-3, 0, 3).
    # Both: Spearman of a tied pair against a strict order, 1.5 / sqrt(1.5 * 2) = 0.866.
    mean, stderr = lds(tau, subsets, losses)
    assert mean == pytest.approx(3 ** 0.5 / 2) and stderr == pytest.approx(0.0, abs=1e-12)


def test_score_matrix_places_ranked_scores():
    results = [{"query": 0, "row_id": 2, "score": 0.5}, {"query": 1, "row_id": 0, "score": -1.0},
               {"query": "aggregate", "row_id": 1, "score": 9.0}]
    assert score_matrix(results, 2, 3) == [[0.0, 0.0, 0.5], [-1.0, 0.0, 0.0]]
