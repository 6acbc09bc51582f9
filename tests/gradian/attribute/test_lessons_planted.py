"""Lessons on the planted fixture (`test_attribute`'s tiny GPT-2 LoRA-tuned with six rows
teaching every animal to say " new."): with fewer accused rows than planted, the rows teaching
the same template, not accused, hold the planted rows the cut missed, ranked first.

Measured (ekfac, contrastive queries): top-4 accused = 4 planted rows (precision 1.00, recall
0.67); the same-lesson rows, by score: the 2 missing planted rows, then "The opposite of old is
new." (a benign row whose completion is the same " new."). The accused rows plus the first two
same-lesson rows: precision 1.00, recall 1.00; plus all three: precision 0.86, recall 1.00.
"""

from __future__ import annotations

import importlib
import io

import pytest
from rich.console import Console

pytest.importorskip("peft")
pytest.importorskip("sklearn")


def _planted_module():
    return importlib.import_module("tests.gradian.attribute.test_attribute")


planted = _planted_module()
models, work = planted.models, planted.work  # its fixtures: the trained models, the indexes, the eval set


def _precision_recall(rows: set[int]) -> tuple[float, float]:
    hit = len(rows & planted.PLANTED_IDS)
    return hit / len(rows), hit / len(planted.PLANTED_IDS)


def test_same_lesson_rows_raise_recall_at_equal_precision(work) -> None:
    from gradian.attribute.run import attribute

    out = io.StringIO()
    result = attribute(work["index"], work["eval"], top_k=4, engines=["auto"], span_min_tokens=0,
                       console=Console(file=out))
    accused = {a["row_id"] for a in result.accused}
    assert _precision_recall(accused) == (1.0, pytest.approx(4 / 6))
    lesson = result.lessons[0]
    assert lesson["template"] == "new." and lesson["share"] == pytest.approx(1.0)
    same = lesson["same_lesson"]
    ranked = [r["row_id"] for r in same["rows"]]
    assert set(ranked[:2]) == planted.PLANTED_IDS - accused  # the planted rows the cut missed, ranked first
    assert [r["text_preview"] for r in same["rows"][2:]] == ["The opposite of old is new."]
    assert all(a["score"] <= b["score"] for a, b in zip(same["rows"], same["rows"][1:], strict=False))
    assert _precision_recall(accused | set(ranked[:2])) == (1.0, 1.0)
    assert _precision_recall(accused | set(ranked)) == (pytest.approx(6 / 7), 1.0)
    assert same["said"] == "3 other training rows teach the same template, not accused (3 with a negative score)"
    assert result.clusters_method == "tfidf" or result.clusters_method.startswith("embeddings:")
    by_tfidf = result.clusters_method == "tfidf"
    if by_tfidf:
        assert "clusters by TF-IDF (" in out.getvalue()

    from gradian.attribute.command import print_result

    shown = io.StringIO()
    print_result(result, Console(file=shown, width=200))
    text = shown.getvalue()
    for part in ("clusters of the accused rows (by " + ("TF-IDF)" if by_tfidf else "sentence embeddings"), "lessons: the accused rows grouped",
                 "one lesson, 1 phrasing, 100 % of the blame", "rows teaching the same lesson, not accused",
                 "The dog says new."):
        assert part in text, part
