"""Corrupted prompts generated for a user's jsonl rows (discovery.data_params.corruption)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import TaskError, build_task, corruption_of

# (entity, answer): facts made of names, which the fixture's tokenizer has as whole tokens.
CAPITALS = [("Mary", " John"), ("Lisa", " Tom"), ("Anna", " Paul"), ("Kate", " Mark"), ("Emma", " David"),
            ("Sarah", " James")]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dp(path, corruption, **kw):
    return DataParams(data_path=path, corruption=corruption, prepend_bos=False, **kw)


def _texts(tok, data):
    return [(tok.decode(data.clean_ids[i, :int(data.attention_mask[i].sum())]),
             tok.decode(data.corrupted_ids[i, :int(data.attention_mask[i].sum())])) for i in range(len(data))]


def test_entity_swap_takes_another_rows_entity_and_answer(tok, tmp_path):
    path = _write(tmp_path / "caps.jsonl", [{"clean": f"The best friend of {c} is", "correct": a, "entity": c}
                                            for c, a in CAPITALS])
    report: dict = {}
    data = build_task("jsonl", tok, None, _dp(path, "entity_swap"), 6, 0, report=report)
    again = build_task("jsonl", tok, None, _dp(path, "entity_swap"), 6, 0)
    other = build_task("jsonl", tok, None, _dp(path, "entity_swap"), 6, 1)
    assert torch.equal(data.corrupted_ids, again.corrupted_ids)  # deterministic in the seed
    assert not torch.equal(data.corrupted_ids, other.corrupted_ids)
    answer_of = {c: tok.encode(a)[0] for c, a in CAPITALS}
    for i, (clean, corrupted) in enumerate(_texts(tok, data)):
        a = next(c for c in answer_of if c in clean)
        b = next(c for c in answer_of if c in corrupted)
        assert a != b and corrupted == clean.replace(a, b)
        assert int(data.correct[i, 0]) == answer_of[a] and int(data.incorrect[i, 0]) == answer_of[b]
    assert report == {"corruption": "entity_swap", "rows": 6, "valid_pairs": 6, "valid_share": 1.0,
                      "model_checked": False, "failures": []}
    assert corruption_of("jsonl", _dp(path, "entity_swap")) == "entity_swap"


def test_every_invalid_pair_is_named_by_line(tok, tmp_path):
    rows = [{"clean": f"The best friend of {c} is", "correct": a, "entity": c} for c, a in CAPITALS]
    rows[2]["entity"] = "Atlantis"  # not in its prompt
    path = _write(tmp_path / "caps.jsonl", rows)
    report: dict = {}
    # The model check: the corruption of line 4 leaves the answer unchanged.
    line4 = tok.encode("The best friend of Kate is")

    def check(pairs):
        return torch.tensor([pairs.clean_ids[i, :len(line4)].tolist() != line4 for i in range(len(pairs))])

    data = build_task("jsonl", tok, None, _dp(path, "entity_swap"), 6, 0, pair_check=check, report=report)
    assert len(data) == 4 and report["valid_pairs"] == 4 and report["valid_share"] == round(4 / 6, 4)
    assert [f.split(":")[1] for f in report["failures"]] == ["3", "4"]
    assert "'Atlantis' is not in the clean prompt" in report["failures"][0]
    assert "leaves the model's answer unchanged" in report["failures"][1]
    with pytest.raises(TaskError, match=r"gave 4 valid pairs of 6 rows \(67%\), below .*min_valid_share=0.9: .*caps"
                                        r".jsonl:3: .*caps.jsonl:4: "):
        build_task("jsonl", tok, None, _dp(path, "entity_swap", min_valid_share=0.9), 6, 0, pair_check=check)


def test_name_swap_replaces_every_mention_and_token_replace_keeps_the_length(tok, tmp_path):
    rows = [{"clean": "When Mary and John went to the store, John gave a drink to", "correct": " Mary",
             "incorrect": " John"},
            {"clean": "Then Lisa met Tom at the park, and Tom gave a book to", "correct": " Lisa", "incorrect": " Tom"}]
    path = _write(tmp_path / "ioi.jsonl", rows)
    data = build_task("jsonl", tok, None, _dp(path, "name_swap"), 2, 0)
    for clean, corrupted in _texts(tok, data):
        first = "Mary" if "Mary" in clean else "Lisa"
        assert first not in corrupted and corrupted.count(" ") == clean.count(" ")
    rows = [{**r, "entity": r["clean"].split(",")[0].split()[-1]} for r in rows]  # "store" / "park"
    path = _write(tmp_path / "tok.jsonl", rows)
    data = build_task("jsonl", tok, None, _dp(path, "token_replace"), 2, 0)
    diff = (data.clean_ids != data.corrupted_ids).sum(1)
    assert diff.tolist() == [1, 1] and data.clean_ids.shape == data.corrupted_ids.shape


def test_rows_that_do_not_fit_the_strategy_get_one_line(tok, tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"clean": "The capital of France is", "correct": " Paris",
                                            "corrupted": "The capital of Italy is"}])
    with pytest.raises(TaskError, match=r"bad.jsonl:1: missing key\(s\) entity"):
        build_task("jsonl", tok, None, _dp(path, "entity_swap"), 1, 0)
    path = _write(tmp_path / "bad2.jsonl", [{"clean": "The capital of France is", "correct": " Paris",
                                             "entity": "France", "corrupted": "x"}])
    with pytest.raises(TaskError, match="has its own 'corrupted' prompt"):
        build_task("jsonl", tok, None, _dp(path, "entity_swap"), 1, 0)
    with pytest.raises(TaskError, match="generates corrupted prompts for the jsonl task only"):
        build_task("ioi", tok, None, DataParams(corruption="entity_swap"), 2, 0)
