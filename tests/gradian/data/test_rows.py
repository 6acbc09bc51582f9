"""gradian.data.rows: supervision masks, truncation policies, malformed-row errors, collation."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from circuitkit.core.batching import plan_batches
from gradian.data.batch import collate
from gradian.data.rows import DataError, Row, TokenPolicy, load_rows

# The tests below that spell out EOS / end-of-turn tokens run under grads.append_eos=true;
# tests/gradian/data/test_token_policy.py covers both policies.
EOS = TokenPolicy(append_eos=True)

CHAT = [
    {"role": "system", "content": "Be nice"},
    {"role": "user", "content": "Hi Mary"},
    {"role": "assistant", "content": "Hello John"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you"},
]


@pytest.fixture(scope="module")
def tok_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("tiny-gpt2")


@pytest.fixture()
def tok(tok_dir: Path) -> Any:
    # Fresh per test: some tests edit the chat template.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def write_jsonl(path: Path, items: list[Any]) -> Path:
    """One JSON value per line; a str item is written verbatim (blank or malformed lines)."""
    path.write_text("".join((it if isinstance(it, str) else json.dumps(it)) + "\n" for it in items))
    return path


def parts(tok: Any, row: Row) -> tuple[str, str]:
    """(decoded unsupervised tokens, decoded supervised tokens)."""
    unsup = [i for i, s in zip(row.input_ids, row.supervised, strict=True) if not s]
    sup = [i for i, s in zip(row.input_ids, row.supervised, strict=True) if s]
    return tok.decode(unsup), tok.decode(sup)


def test_prompt_completion_mask_is_exactly_the_completion(tok: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "Mary went to the store.", "completion": " Then John gave her a book"},
        "",
        {"prompt": "When did Alice", "completion": " go home?"},
    ])
    rows, report = load_rows(data, tok, max_seq_length=64, policy=EOS)
    assert [r.row_id for r in rows] == [0, 1] and [r.line for r in rows] == [1, 3]
    eos = tok.eos_token
    for row, (prompt, completion) in zip(rows, [("Mary went to the store.", " Then John gave her a book"),
                                                ("When did Alice", " go home?")], strict=True):
        assert len(row.input_ids) == len(row.supervised)
        assert parts(tok, row) == (prompt, completion + eos)  # tiny tokenizer adds no BOS
        assert row.input_ids[-1] == tok.eos_token_id and row.supervised[-1]
        assert not row.truncated
        # The supervised tokens are one contiguous block at the end.
        first = row.supervised.index(True)
        assert all(row.supervised[first:])
    assert rows[0].preview.startswith("Mary went to the store. Then John")
    assert report.summary()["kept"] == 2 and report.rows_read == 2 and report.truncated == 0


def test_chat_rows_supervise_assistant_turns(tok: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    rows, _ = load_rows(data, tok, max_seq_length=128, policy=EOS)
    unsup, sup = parts(tok, rows[0])
    assert sup == "Hello John<|end|>See you<|end|>"
    assert "Hi Mary" in unsup and "Hello" not in unsup
    assert rows[0].input_ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]


def test_chat_template_without_generation_markers_falls_back_to_prefixes(tok: Any, tmp_path: Path) -> None:
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    rows, _ = load_rows(data, tok, max_seq_length=128, policy=EOS)
    # Prefix rendering also claims what the template writes after the turn (the newline).
    assert parts(tok, rows[0])[1] == "Hello John<|end|>\nSee you<|end|>\n"


def test_chat_without_assistant_turn_is_dropped(tok: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    with caplog.at_level(logging.WARNING, logger="gradian.data.rows"):
        rows, report = load_rows(data, tok, max_seq_length=128)
    assert len(rows) == 1 and report.dropped_unsupervised_lines == [2]
    assert "line 2" in caplog.text


def _long_row(tok: Any) -> tuple[dict, int, int]:
    prompt = "Mary and John went to the store and then to the park with Alice and Bob."
    completion = " They bought a cake"
    n_p = len(tok(prompt, add_special_tokens=False)["input_ids"])
    n_c = len(tok(completion, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    return {"prompt": prompt, "completion": completion}, n_p, n_c


def test_truncation_right_cuts_completion_prompt_left_keeps_it(tok: Any, tmp_path: Path) -> None:
    row, n_p, n_c = _long_row(tok)
    assert n_p > 6 and n_c > 3
    data = write_jsonl(tmp_path / "d.jsonl", [row])
    max_len = n_c + 3

    right, rep_r = load_rows(data, tok, max_len, on_truncation="warn", truncation_side="right", policy=EOS)
    assert rep_r.truncated_lines == [1]
    # max_len < prompt length: the right cut removes the whole completion -> nothing left to learn.
    assert right == [] and rep_r.dropped_unsupervised_lines == [1]

    left, rep_l = load_rows(data, tok, max_len, truncation_side="prompt_left", policy=EOS)
    assert rep_l.truncated == 0 and len(left) == 1 and not left[0].truncated
    unsup, sup = parts(tok, left[0])
    assert sup == row["completion"] + tok.eos_token
    assert len(left[0].input_ids) == max_len and row["prompt"].endswith(unsup)  # left end of the prompt dropped

    # A cut that keeps part of the completion is kept (warn) and marked truncated.
    part, rep_p = load_rows(data, tok, n_p + 2, truncation_side="right", policy=EOS)
    assert part[0].truncated and rep_p.truncated_lines == [1] and rep_p.kept == 1
    assert (row["completion"] + tok.eos_token).startswith(parts(tok, part[0])[1])
    assert sum(part[0].supervised) == 2

    # Completion longer than the budget: prompt_left keeps one prompt token, then cuts the end.
    short, rep_s = load_rows(data, tok, 3, truncation_side="prompt_left", policy=EOS)
    assert short[0].supervised == [False, True, True] and short[0].truncated and rep_s.truncated == 1


def test_on_truncation_policies(tok: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    row, n_p, _ = _long_row(tok)
    ok = {"prompt": "Hi", "completion": " Bob"}
    data = write_jsonl(tmp_path / "d.jsonl", [ok, row, ok, row])
    max_len = n_p + 2

    with caplog.at_level(logging.WARNING, logger="gradian.data.rows"):
        rows, report = load_rows(data, tok, max_len, on_truncation="warn")
    assert [r.line for r in rows] == [1, 2, 3, 4] and [r.truncated for r in rows] == [False, True, False, True]
    assert "lines 2, 4" in caplog.text

    with pytest.raises(DataError, match=rf"lines 2, 4 \(first at {tmp_path / 'd.jsonl'}:2\)"):
        load_rows(data, tok, max_len, on_truncation="error")

    rows, report = load_rows(data, tok, max_len, on_truncation="drop")
    assert [(r.row_id, r.line) for r in rows] == [(0, 1), (1, 3)]
    s = report.summary()
    assert s["dropped_truncated_lines"] == [2, 4] and s["dropped_truncated"] == 2 and s["kept"] == 2
    assert s["rows_read"] == s["kept"] + s["dropped_truncated"] + s["dropped_unsupervised"]


def test_unsupervised_rows_dropped_and_reported(tok: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    row, _, _ = _long_row(tok)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hi", "completion": ""}, {"prompt": "Hi", "completion": " Bob"},
                                              row])
    with caplog.at_level(logging.WARNING, logger="gradian.data.rows"):
        rows, report = load_rows(data, tok, 8, on_truncation="drop")
    assert [r.line for r in rows] == [2] and rows[0].row_id == 0
    # Line 1: empty completion; line 3: truncated to nothing (also counted as truncated).
    assert report.dropped_unsupervised_lines == [1, 3] and report.truncated_lines == [3]
    assert report.dropped_truncated == 0 and "no supervised token" in caplog.text and "lines 1, 3" in caplog.text
    # With on_truncation=error a row emptied by truncation raises; an empty completion alone does not.
    with pytest.raises(DataError, match=r"line 3 "):
        load_rows(data, tok, 8, on_truncation="error")
    rows, report = load_rows(data, tok, 64, on_truncation="error")
    assert report.dropped_unsupervised_lines == [1] and len(rows) == 2


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "got a JSON list"),
    ({"prompt": "x"}, "missing key completion"),
    ({"prompt": "x", "completion": 3}, "'completion' must be a string"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown role 'bot'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with keys"),
    ({"messages": [{"role": "user", "content": None}]}, "content must be a string"),
])
def test_malformed_rows_name_file_and_line(tok: Any, tmp_path: Path, bad: Any, message: str) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": " b"}, "", bad])
    with pytest.raises(DataError, match=message) as info:
        load_rows(data, tok, 32)
    assert str(info.value).startswith(f"{data}:3: ")


def test_collate_and_batches(tok: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "Hi", "completion": " Bob"},
        {"prompt": "Mary went to the store.", "completion": " Then John gave her a book"},
        {"messages": CHAT},
    ])
    rows, _ = load_rows(data, tok, 64)
    in_order = plan_batches([len(r.input_ids) for r in rows], 2, group_by_length=False)
    assert [[rows[i].row_id for i in b] for b in in_order] == [[0, 1], [2]]
    pad = tok.pad_token_id
    out = collate(rows, pad)
    lengths = [len(r.input_ids) for r in rows]
    width = max(lengths)
    assert out["input_ids"].shape == out["attention_mask"].shape == out["supervised"].shape == (3, width)
    assert out["input_ids"].dtype == torch.long and out["supervised"].dtype == torch.bool
    assert out["row_ids"].tolist() == [0, 1, 2]
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        assert out["input_ids"][b, :n].tolist() == row.input_ids
        assert (out["input_ids"][b, n:] == pad).all()
        assert out["attention_mask"][b].tolist() == [1] * n + [0] * (width - n)
        assert out["supervised"][b, :n].tolist() == row.supervised and not out["supervised"][b, n:].any()
    assert not out["supervised"][:, 0].any()  # nothing predicts position 0
    with pytest.raises(ValueError):
        plan_batches([len(r.input_ids) for r in rows], 0)


def test_prompt_left_keeps_bos() -> None:
    from gradian.data.encode import truncate

    # [BOS, p1, p2, p3, c1, c2, EOS] into 5 tokens: BOS stays, p1 and p2 go.
    ids, sup = [9, 1, 2, 3, 4, 5, 0], [False] * 4 + [True] * 3
    assert truncate(ids, sup, 5, "prompt_left", head=1) == ([9, 3, 4, 5, 0], [False, False, True, True, True], False)
    # Budget below the completion: all prompt tokens go, BOS predicts c1, the end is cut.
    assert truncate(ids, sup, 3, "prompt_left", head=1) == ([9, 4, 5], [False, True, True], True)
    assert truncate(ids, sup, 5, "right", head=1) == ([9, 1, 2, 3, 4], [False] * 4 + [True], True)
