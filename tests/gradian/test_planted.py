"""Gradian finds the training document that states a planted fact (scripts/bench/bench_planted_facts.py --small)."""

from __future__ import annotations

import pytest

from scripts.bench.bench_planted_facts import make_corpus, run


def test_corpus_targets_state_the_queried_fact():
    corpus = make_corpus(6, seed=3)
    assert len(corpus.docs) == corpus.n_facts + 6 and len(corpus.targets) == corpus.n_facts == 24
    for query, target in zip(corpus.queries["full"], corpus.targets, strict=True):
        assert corpus.docs[target]["completion"] == query["completion"]
    for query, target in zip(corpus.queries["short"], corpus.targets, strict=True):
        assert corpus.docs[target]["completion"].endswith(query["completion"])


@pytest.fixture(scope="module")
def small_report():
    return run(n_entities=12, epochs=30, grid=[("kronecker", 256, "float16")], baseline=True)


def test_fine_tuning_learns_the_documents(small_report):
    ft = small_report["fine_tune"]
    assert ft["loss_last_epoch"] < 0.25 * ft["loss_first_epoch"]


def test_kronecker_recall_at_10_is_well_above_chance(small_report):
    chance = small_report["chance"]["recall@10"]
    assert small_report["n_docs"] == 60 and chance == pytest.approx(1 / 6)
    rows = {(r["model"], r["query"]): r for r in small_report["rows"]}
    for key in (("fine-tuned", "full"), ("base", "full"), ("base", "short")):
        assert rows[key]["recall@10"] > 3 * chance, (key, rows[key])
        assert rows[key]["mrr"] > 3 * small_report["chance"]["recall@1"], (key, rows[key])
    # Answer-only queries on the fine-tuned model are the hard case: still above chance.
    assert rows[("fine-tuned", "short")]["recall@10"] > 1.5 * chance
