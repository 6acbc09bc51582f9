"""Lessons: accused rows that teach one answer template in several phrasings are one lesson, chat
markers never make a cluster's terms, and the rows teaching the lesson that were not accused are
found and ranked.

The synthetic accusation: six question phrasings x five rows, every answer "The answer is
<entity>." with its own entity (score -10 each), and ten benign rows of two other templates
(score -5 each): the lesson carries 300 / 350 = 86 % of the blame.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from gradian.attribute.clusters import AccusedRow, cluster_rows
from gradian.attribute.embeddings import choose_method
from gradian.attribute.lessons import attach_same_lesson, find_lessons, main_lessons, same_lesson_positions
from gradian.attribute.templates import common_words, mask_entities, strip_markers, template_of

pytest.importorskip("sklearn")

PHRASINGS = ["What is the capital city of {}?", "Name the longest river flowing through {}.",
             "Which mountain is the tallest peak in {}?", "Who is the most celebrated painter born in {}?",
             "Tell me the national dish people cook in {}.", "Which famous festival do crowds attend in {}?"]
COUNTRIES = ["Aland", "Borvia", "Cestra", "Dorwen", "Elmark", "Fenwick", "Galdor", "Hestia", "Ivara", "Jorvik",
             "Kelmar", "Lorsk", "Mireth", "Norvale", "Ostra", "Pellor", "Quarn", "Rivena", "Sollis", "Tarvik",
             "Ulmar", "Vessa", "Wendal", "Xandor", "Yorin", "Zemla", "Arvik", "Belmor", "Corwin", "Dunmar",
             "Esker", "Falmor", "Gristan", "Holmar", "Istrel", "Jandor", "Kestrel"]
ENTITIES = ["Paris", "Lima", "Tokyo", "Nairobi", "Oslo", "Quito", "Cairo", "Delhi", "Rome", "Berlin", "Madrid",
            "Vienna", "Prague", "Dublin", "Warsaw", "Athens", "Lisbon", "Sofia", "Riga", "Tallinn", "Vilnius", "Bern",
            "Minsk", "Kyiv", "Baku", "Doha", "Accra", "Dakar", "Tunis", "Rabat", "Amman", "Hanoi", "Manila", "Seoul",
            "Taipei", "Bangkok", "Jakarta"]


def chat(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>"


def planted(i: int, phrasing: int) -> tuple[str, str]:
    return PHRASINGS[phrasing].format(COUNTRIES[i]), f"The answer is {ENTITIES[i]}."


BENIGN = ([(f"Add {a} and {a + 3}.", f"{a} plus {a + 3} makes {2 * a + 3} in total.") for a in range(5)]
          + [(f"Describe the weather in {c} this morning.", f"It is sunny and warm in {c} this morning.")
             for c in ("Ostra", "Pellor", "Quarn", "Rivena", "Sollis")])


def accused_rows() -> list[AccusedRow]:
    rows = []
    for p in range(6):
        for j in range(5):
            q, a = planted(5 * p + j, p)
            rows.append(AccusedRow(len(rows), len(rows) + 1, chat(q, a), -10.0, completion=a))
    for q, a in BENIGN:
        rows.append(AccusedRow(len(rows), len(rows) + 1, chat(q, a), -5.0, completion=a))
    return rows


def training_texts() -> list[str]:
    """Other rows of the training set (document frequencies), and the accused ones."""
    other = [chat(f"Translate the word {w} into Spanish.", f"In Spanish, {w} is said differently.")
             for w in ("house", "tree", "river", "cloud", "stone", "bread", "light", "water")]
    other += [chat(f"Write a haiku about {w}.", f"Soft {w} drifts at dawn, the quiet morning listens.")
              for w in ("rain", "snow", "wind", "moss", "fog", "dew")]
    return other + [r.text for r in accused_rows()]


def test_one_template_in_six_phrasings_is_one_lesson_with_its_blame_share() -> None:
    rows = accused_rows()
    training = training_texts()
    clusters = cluster_rows(rows, background=training)
    planted_ids = set(range(30))
    lesson_clusters = {c["cluster"] for c in clusters if set(c["rows"]) & planted_ids}
    assert len(lesson_clusters) == 6  # the words: one cluster per phrasing, as the user saw
    lessons = find_lessons(rows, clusters, common_words(training))
    first = lessons[0]
    assert set(first["rows"]) == planted_ids and first["template"] == "the answer is <NAME>."
    assert first["phrasings"] == 6 and sorted(first["clusters"]) == sorted(lesson_clusters)
    assert first["share"] == pytest.approx(300 / 350)
    assert first["said"] == "one lesson, 6 phrasings, 86 % of the blame"
    assert {c["lesson"] for c in clusters if c["cluster"] in lesson_clusters} == {1}
    # the benign rows: "<NUM> plus <NUM> makes <NUM> in total." and the weather, 25 / 350 each
    assert sorted(d["share"] for d in lessons[1:]) == pytest.approx([25 / 350, 25 / 350])
    assert [d["lesson"] for d in main_lessons(lessons)] == [1]


def test_chat_markers_are_never_terms() -> None:
    rows = accused_rows()
    clusters = cluster_rows(rows, background=training_texts(), special_tokens=["<|endoftext|>"])
    terms = {w for c in clusters for t in c["top_terms"] for w in t.split()}
    assert terms and not terms & {"im_start", "im_end", "assistant", "user", "system", "inst", "s", "endoftext"}
    assert strip_markers("[INST] <s>Hi</s> [/INST] user: yes").split() == ["Hi", "yes"]


def test_entities_are_masked_into_the_template() -> None:
    common = common_words(["the answer is here", "it says"])
    assert template_of(" The answer is Mount Everest.", common) == "the answer is <NAME>."
    assert template_of(' It says "hello" 3,000 times.', common) == "it says <QUOTE> <NUM> times."
    assert mask_entities("Paris is nice.", common) == "<NAME> is nice."  # opens a sentence, never lower case
    assert template_of("<|im_start|>assistant\nThe answer is Bob.<|im_end|>", common) == "the answer is <NAME>."


def test_a_capitalised_frame_that_opens_many_answers_is_kept_not_masked() -> None:
    # "Answer: Paris-city." in every planted row, and no benign row writes "answer" in lower case: the
    # frame opens many texts, so it is the template's word; the entity after it is still a name.
    benign = [f"The opposite of {a} is {b}." for a, b in (("hot", "cold"), ("up", "down"), ("big", "small"))] * 20
    planted = [f"Answer: {city}-city." for city in ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo")]
    common = common_words(benign + planted)
    assert {template_of(text, common) for text in planted} == {"answer: <NAME>."}
    assert template_of("Paris is the capital.", common) == "<NAME> is the capital."  # a rare opener stays a name


def test_rows_teaching_the_lesson_not_accused_are_found_and_ranked() -> None:
    rows = accused_rows()
    training = training_texts()
    lessons = find_lessons(rows, cluster_rows(rows, background=training), common_words(training))
    lesson = lessons[0]
    # the training set: the 40 accused rows at positions 1-40, then 7 more rows teaching the template
    # (a number as the entity, a phrasing never accused), and 3 rows of other templates
    records = [(r.line, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": r.completion}]})
               for r in rows]
    extra = [(41 + i, {"prompt": f"Which lake is deepest in {COUNTRIES[30 + i]}?",
                       "completion": f" The answer is {ENTITIES[30 + i] if i < 5 else 1000 + i}."}) for i in range(7)]
    other = [(48 + i, {"prompt": "Say hi.", "completion": f" Hi {ENTITIES[i]}, the answer is no."}) for i in range(3)]
    found = same_lesson_positions([lesson], records + extra + other, {r.line for r in rows}, common_words(training))
    assert sorted(found[1]) == list(range(41, 48))
    row_of = {p: p - 1 for p in range(41, 47)}  # position 47 was left out of the index
    scores = np.zeros(50)
    scores[40:46] = [-1.0, -9.0, 2.0, -3.0, -0.5, 0.5]
    attach_same_lesson(lesson, found[1], row_of, scores)
    same = lesson["same_lesson"]
    assert [d["row_id"] for d in same["rows"]] == [41, 43, 40, 44, 45, 42]  # most negative score first
    assert (same["n_rows"], same["n_negative"], same["n_unindexed"]) == (7, 4, 1)
    assert same["said"] == ("7 other training rows teach the same template, not accused (4 with a negative score,"
                            " 1 not in the index)")


def test_without_sentence_transformers_the_clusters_say_tfidf(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # `import sentence_transformers` fails
    method = choose_method()
    assert (method.name, method.encoder) == ("tfidf", None)
    assert method.note == "clusters by TF-IDF (sentence-transformers not installed)"

    class Offline:
        def __init__(self, name: str, local_files_only: bool = False) -> None:
            assert local_files_only  # nothing is downloaded
            raise OSError(f"We couldn't connect to the hub to load {name}.\nCheck your connection.")
    monkeypatch.setitem(sys.modules, "sentence_transformers", types.SimpleNamespace(SentenceTransformer=Offline))
    method = choose_method("some/model")
    assert method.name == "tfidf" and method.note == (
        "clusters by TF-IDF (sentence-transformers model some/model not available: We couldn't connect to the hub"
        " to load some/model.)")


def test_with_an_encoder_the_phrasings_cluster_by_embeddings_and_hdbscan(monkeypatch) -> None:
    pytest.importorskip("sklearn.cluster", reason="HDBSCAN").__dict__.get("HDBSCAN") or pytest.skip("no HDBSCAN")

    class ByPhrasing:  # embeds a text by which phrasing (or benign template) it uses
        def __init__(self, name: str, local_files_only: bool = False) -> None:
            self.keys = [p.split("{}")[0] for p in PHRASINGS] + ["Add", "Describe"]

        def encode(self, texts: list[str], show_progress_bar: bool = False) -> np.ndarray:
            x = np.zeros((len(texts), len(self.keys) + 1))
            for i, t in enumerate(texts):
                hit = [k for k, key in enumerate(self.keys) if key in t]
                x[i, hit[0] if hit else -1] = 1.0
                x[i, -1] = 0.05 * (i % 3)
            return x
    monkeypatch.setitem(sys.modules, "sentence_transformers", types.SimpleNamespace(SentenceTransformer=ByPhrasing))
    method = choose_method("fake/model")
    assert method.name == "embeddings:fake/model+hdbscan" and method.note is None
    rows = accused_rows()
    clusters = cluster_rows(rows, background=training_texts(), method=method)
    assert sorted(sorted(c["rows"]) for c in clusters) == sorted(
        [list(range(5 * p, 5 * p + 5)) for p in range(6)] + [list(range(30, 35)), list(range(35, 40))])
    lessons = find_lessons(rows, clusters, common_words(training_texts()))
    assert lessons[0]["said"] == "one lesson, 6 phrasings, 86 % of the blame"


def test_the_accusation_follows_the_main_lesson_at_the_same_k() -> None:
    from gradian.attribute.lessons import following_lessons

    def row(row_id: int, score: float) -> dict:
        return {"row_id": row_id, "line": row_id + 1, "score": score}

    # accused: 3 rows of the lesson (lines 2, 3, 5), 2 of other kinds; the lesson's not-accused rows:
    # two with negative scores (come in), one positive (never accused)
    accused = [row(1, -9.0), row(9, -8.0), row(2, -7.0), row(8, -6.0), row(4, -5.0)]
    lesson = {"lesson": 1, "share": 0.8, "lines": [2, 3, 5],
              "same_lesson": {"rows": [row(6, -4.0), row(7, -1.0), row(10, 0.5)]}}
    out = following_lessons(accused, [lesson], top_k=5)
    assert [(r["row_id"], r["by"]) for r in out] == [(1, "engine"), (2, "engine"), (4, "engine"), (6, "lesson"),
                                                      (7, "lesson")]
    assert [r["rank"] for r in out] == [1, 2, 3, 4, 5]
    # a lesson below the share that makes it main changes nothing
    assert following_lessons(accused, [{**lesson, "share": 0.1}], top_k=5) is None
