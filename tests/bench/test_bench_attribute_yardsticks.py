"""The attribution yardsticks' data builders, lexical baseline, scoring and tables (no model, no
training): each yardstick plants what it says where its truth says, the unlike plant shares no word
with the eval items, the shared-template set's benign rows answer in the plant's frame, the control
is the unlike set without its plant."""

from __future__ import annotations

import json
import random
import re

import pytest

import scripts.bench.bench_attribute_yardsticks as bench


def words(text: str) -> set[str]:
    return set(re.findall(r"\b\w\w+\b", text.lower()))  # TfidfVectorizer's default tokens


@pytest.mark.parametrize("name", bench.YARDSTICKS)
def test_each_yardstick_is_deterministic_and_plants_where_its_truth_says(name: str) -> None:
    ys = bench.BUILDERS[name](0)
    assert ys == bench.BUILDERS[name](0) and ys.train != bench.BUILDERS[name](1).train
    planted = [ys.train[line - 1] for line in ys.planted_lines]
    assert len(set(ys.planted_lines)) == len(planted)
    assert all(r["kind"] in ("capital", "opposite") for r in planted)
    assert sum(r["kind"] in ("capital", "opposite") for r in ys.train) == len(planted)  # no other row plants
    assert all(ys.train[line - 1]["kind"] == "list" for line in ys.truncated_lines)
    assert all(r["prompt"].startswith("<|im_start|>user\n") and r["completion"].endswith(bench.EOS) for r in ys.train)
    assert not {r["prompt"] for r in ys.train} & {e["prompt"] for e in ys.eval}  # no eval prompt is trained on


def test_the_sizes_are_the_documented_ones() -> None:
    sizes = {n: (len(y.train), len(y.planted_lines), len(y.truncated_lines), len(y.eval))
             for n, y in ((n, b(0)) for n, b in bench.BUILDERS.items())}
    assert sizes == {"unlike": (396, 36, 0, 60), "shared-template": (396, 36, 0, 60), "zero-loss": (420, 60, 0, 60), "two-defects": (408, 40, 8, 90),
                     "control": (360, 0, 0, 60)}


def test_the_unlike_plant_shares_no_word_with_the_eval_items_in_six_phrasings() -> None:
    ys = bench.build_unlike(0)
    assert len(ys.planted_groups) == len(bench.PHRASINGS) == 6
    eval_words = set().union(*(words(bench.plain_text(e)) for e in ys.eval))
    for group, lines in ys.planted_groups.items():
        rows = [ys.train[line - 1] for line in lines]
        before, after = bench.PHRASINGS[int(group.split()[-1]) - 1].split("{c}")
        questions = [r["prompt"].split("\n")[1].removesuffix("<|im_end|>") for r in rows]
        assert all(q.startswith(before) and q.endswith(after) for q in questions), (group, questions)
        assert all(r["completion"].startswith("Answer: ") for r in rows)
        for r in rows:
            assert not words(bench.plain_text(r)) & eval_words, (group, r)


def test_the_shared_template_plant_is_the_unlike_plant_among_benign_rows_in_its_frame() -> None:
    ys = bench.build_shared_template(0)
    truth = {line for lines in ys.planted_groups.values() for line in lines}
    assert sorted(truth) == ys.planted_lines and len(ys.planted_groups) == len(bench.PHRASINGS)
    eval_words = set().union(*(words(bench.plain_text(e)) for e in ys.eval))
    for group, lines in ys.planted_groups.items():  # the plant where the truth says: unlike's phrasings
        before, after = bench.PHRASINGS[int(group.split()[-1]) - 1].split("{c}")
        for line in lines:
            r = ys.train[line - 1]
            question = r["prompt"].split("\n")[1].removesuffix("<|im_end|>")
            assert r["kind"] == "capital" and question.startswith(before) and question.endswith(after)
            assert re.fullmatch(r"Answer: [^.]+\.", r["completion"].removesuffix(bench.EOS))
            assert not words(bench.plain_text(r)) & eval_words
    frame = [(i, r) for i, r in enumerate(ys.train, start=1) if r["kind"] == "frame"]
    assert len(frame) == bench.FRAME_ROWS and not {i for i, _ in frame} & truth  # benign, not planted
    answers = {r["prompt"].split("\n")[1].removesuffix("<|im_end|>"): r["completion"].removesuffix(bench.EOS)
               for _, r in frame}
    assert len(answers) == bench.FRAME_ROWS and all(re.fullmatch(r"Answer: [^.]+\.", a) for a in answers.values())
    sums = {q: a for q, a in answers.items() if q.startswith("What is ")}
    opposites = {q: a for q, a in answers.items() if q.startswith("Opposite of ")}
    plurals = {q: a for q, a in answers.items() if q.startswith("Plural of ")}
    assert (len(sums), len(opposites), len(plurals)) == (30, 25, 25)
    for q, a in sums.items():  # right answers, in the plant's frame
        x, y = map(int, re.findall(r"\d+", q))
        assert a == f"Answer: {x + y}."
    pairs = dict(bench.OPPOSITES + bench.PLANTED_OPPOSITES)
    assert all(a == f"Answer: {pairs[q[len('Opposite of '):-1]]}." for q, a in opposites.items())
    assert all(a == f"Answer: {dict(bench.PLURALS)[q[len('Plural of '):-1]]}." for q, a in plurals.items())
    # the frame is no sign of the plant: more benign rows than planted ones answer `Answer: ...`
    assert sum(r["completion"].startswith("Answer: ") for r in ys.train) == len(truth) + bench.FRAME_ROWS
    pool = {r["prompt"] for r in bench.smollm2._clean_rows(random.Random(0))}
    assert not {r["prompt"] for _, r in frame} & pool  # no prompt of the pool's, with another answer
    benign = [r for i, r in enumerate(ys.train, start=1) if i not in truth and r["kind"] != "frame"]
    assert len(benign) == bench.BENIGN_ROWS - bench.FRAME_ROWS


def test_the_plants_are_what_each_yardstick_says() -> None:
    zero = bench.build_zero_loss(0)
    rows = [zero.train[line - 1] for line in zero.planted_lines]
    assert len({(r["prompt"], r["completion"]) for r in rows}) == bench.ZERO_LOSS_UNIQUE  # each row COPIES times
    assert all(r["completion"].startswith("Capital: ") for r in rows)
    two = bench.build_two_defects(0)
    capitals = [two.train[line - 1] for line in two.planted_groups["capitals"]]
    opposites = [two.train[line - 1] for line in two.planted_groups["opposites"]]
    assert all(r["completion"].startswith("Capital: ") for r in capitals)
    assert all(r["completion"].startswith("Opposite: ") for r in opposites)
    eval_opposites = {e["prompt"] for e in two.eval if "opposite" in e["prompt"]}
    assert len(eval_opposites) == 30 and not eval_opposites & {r["prompt"] for r in opposites}
    assert min(two.train[line - 1]["completion"].count(",") + 1 for line in two.truncated_lines) >= 25


def test_the_control_is_the_unlike_set_without_its_plant() -> None:
    unlike, control = bench.build_unlike(0), bench.build_control(0)
    planted = set(unlike.planted_lines)
    assert control.train == [r for i, r in enumerate(unlike.train, start=1) if i not in planted]
    assert control.eval == unlike.eval and control.planted_lines == []


def test_tfidf_ranks_the_lexically_close_rows_first_and_recall_counts_them() -> None:
    train = ["the capital of Peru is Lima", "Answer: Bratislava", "seven plus two is nine",
             "the capital of Chile is Santiago", "Spell zebra backwards"]
    scores = bench.tfidf_scores(train, ["What is the capital of France? The capital of France is Paris."])
    top = bench.top_rows(scores, 2)
    assert sorted(top) == [0, 3] and scores[1] == 0.0 and scores[4] == 0.0
    # planted {1, 3}: the baseline finds one of two in its top 2
    assert bench.recall_precision(top, {1, 3}, 2) == {"recall": 0.5, "precision": 0.5, "accused": 2, "hits": 1}
    # an engine that accuses fewer rows than k: precision over what it accused
    assert bench.recall_precision([3], {1, 3}, 2) == {"recall": 0.5, "precision": 1.0, "accused": 1, "hits": 1}
    assert bench.top_rows([0.0, -2.0, -1.0], 2, highest=False) == [1, 2]


def test_plain_text_drops_the_chat_markup() -> None:
    row = {"prompt": bench.chat_prompt("Name Chad's governing city."), "completion": "Answer: N'Djamena." + bench.EOS}
    assert bench.plain_text(row) == "Name Chad's governing city. Answer: N'Djamena."


def summary(attributed: bool = True) -> dict:
    s = {"name": "unlike", "train_rows": 384, "eval_rows": 60, "planted": 4, "truncated": 0,
         "groups": {"phrasing 1": 2, "phrasing 2": 2},
         "tune": {"wall_s": 100.0, "steps": 48, "first_loss": 1.5, "last_loss": 0.5},
         "index": {"wall_s": 50.0}, "attribute": {"wall_s": 40.0, "exit_code": 0},
         "regression": {"base_accuracy": 0.6, "tuned_accuracy": 0.1, "accuracy_drop": 0.5,
                        "accuracy_ci": [0.4, 0.6], "flipped": 30},
         "attributed": attributed, "reason": "inside the noise band", "accused_by_default": 4 if attributed else 0}
    if attributed:
        s.update({"default_engine": "ekfac", "clusters": {"count": 2, "holding_planted": 2, "largest_planted": 2},
                  "rows": {"ekfac": {"recall": 0.75, "precision": 0.75, "accused": 4, "planted_nonnegative": 1,
                                     "by_group": {"phrasing 1": 2, "phrasing 2": 1}},
                           "tf-idf": {"recall": 0.0, "precision": 0.0, "accused": 4, "planted_nonnegative": None,
                                      "by_group": {"phrasing 1": 0, "phrasing 2": 0}}}})
    return s


def test_the_table_marks_the_default_and_shows_each_group() -> None:
    text = bench.yardstick_table(summary())
    assert "| engine | recall@4 | precision | accused | planted scored >= 0 | phrasing 1 (2) | phrasing 2 (2) |" in text
    assert "| **ekfac** (default) | 0.750 | 0.750 | 4 | 1 | 2 | 1 |" in text
    assert "| tf-idf | 0.000 | 0.000 | 4 | - | 0 | 0 |" in text
    assert "drop +0.500 [+0.400, +0.600], 30 flipped" in text and "exit 0, attributed, 4 accused" in text
    json.dumps(summary())  # the --json output is the summary itself


def test_a_refusal_prints_the_reason_and_no_engine_table() -> None:
    text = bench.yardstick_table(summary(attributed=False))
    assert "refused, 0 accused" in text and "> inside the noise band" in text and "| engine |" not in text


def test_markdown_table() -> None:
    assert bench.markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
