"""grads.append_eos / grads.prepend_bos: exactly which tokens a row has and which are supervised,
recorded in the index, followed by queries, refused when asked otherwise, shown by inspect."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gradian.data.rows import DataError, Row, TokenPolicy, load_rows

CHAT = [
    {"role": "system", "content": "Be nice"},
    {"role": "user", "content": "Hi Mary"},
    {"role": "assistant", "content": "Hello John"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you"},
]
PROMPT, COMPLETION = "Mary went to the store.", " Then John gave her a book"


@pytest.fixture()
def tok(tiny_model: Callable[[str], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))  # fresh: some tests edit the template


def _jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return path


def _split(tok: Any, row: Row) -> tuple[list[int], list[int]]:
    """(ids of the unsupervised tokens, ids of the supervised ones)."""
    return ([i for i, s in zip(row.input_ids, row.supervised, strict=True) if not s],
            [i for i, s in zip(row.input_ids, row.supervised, strict=True) if s])


def _ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("append_eos", [False, True])
@pytest.mark.parametrize("prepend_bos", [None, True, False])
def test_prompt_completion_tokens_and_mask(tok: Any, tmp_path: Path, append_eos: bool, prepend_bos: bool | None) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}])
    rows, report = load_rows(data, tok, 64, policy=TokenPolicy(append_eos=append_eos, prepend_bos=prepend_bos))
    # The tiny GPT-2 tokenizer does not add BOS by itself: null means none.
    bos = [tok.bos_token_id] if prepend_bos else []
    eos = [tok.eos_token_id] if append_eos else []
    unsup, sup = _split(tok, rows[0])
    assert rows[0].input_ids == bos + _ids(tok, PROMPT) + _ids(tok, COMPLETION) + eos
    assert unsup == bos + _ids(tok, PROMPT)
    assert sup == _ids(tok, COMPLETION) + eos
    assert report.eos_appended == int(append_eos) and report.bos_first == int(bool(prepend_bos))
    summary = report.summary()
    assert summary["append_eos"] is append_eos and summary["prepend_bos"] == prepend_bos


def test_policy_resolves_with_the_tokenizer(tok: Any) -> None:
    resolved = TokenPolicy().resolve(tok)
    assert resolved["append_eos"] is False and resolved["eos_added"] is False and resolved["eos_token"] is None
    assert resolved["bos_added"] is False  # GPT-2's tokenizer adds none, and null follows it
    assert resolved["chat_supervised"] == "assistant content only"
    resolved = TokenPolicy(append_eos=True, prepend_bos=True).resolve(tok)
    assert resolved["eos_token"] == tok.eos_token and resolved["bos_token"] == tok.bos_token and resolved["bos_added"]


def test_prepend_bos_without_a_bos_token_is_one_clear_error(tok: Any, tmp_path: Path) -> None:
    tok.bos_token = None
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}])
    with pytest.raises(DataError, match="grads.prepend_bos=true, but the tokenizer has no BOS"):
        load_rows(data, tok, 64, policy=TokenPolicy(prepend_bos=True))


def test_truncated_row_does_not_count_its_cut_eos(tok: Any, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}])
    n = len(_ids(tok, PROMPT)) + 2  # two completion tokens fit, EOS does not
    rows, report = load_rows(data, tok, n, policy=TokenPolicy(append_eos=True))
    assert rows[0].truncated and tok.eos_token_id not in rows[0].input_ids and report.eos_appended == 0


@pytest.mark.parametrize("markers", [True, False])
def test_chat_rows_content_only_or_with_end_of_turn(tok: Any, tmp_path: Path, markers: bool) -> None:
    if not markers:  # a template without {% generation %}: the prefix-rendering path
        tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    content, _ = load_rows(data, tok, 128)
    with_eot, report = load_rows(data, tok, 128, policy=TokenPolicy(append_eos=True))
    assert content[0].input_ids == with_eot[0].input_ids  # the policy changes the mask, not the tokens
    assert content[0].input_ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    # append_eos=false: exactly the assistant contents' tokens, nothing the template added.
    sup = _split(tok, content[0])[1]
    assert sup == _ids(tok, "Hello John") + _ids(tok, "See you")
    # append_eos=true: the template's end-of-turn marker too (and, without generation markers,
    # the newline the template writes after the turn).
    tail = "<|end|>" if markers else "<|end|>\n"
    assert tok.decode(_split(tok, with_eot[0])[1]) == f"Hello John{tail}See you{tail}"
    assert report.eos_appended == 0  # chat rows get no EOS appended: the template decides the tokens


def test_chat_content_repeated_in_a_user_turn_is_not_taken_for_the_answer(tok: Any, tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "yes"}, {"role": "assistant", "content": "no"},
            {"role": "user", "content": "say no"}, {"role": "assistant", "content": "yes"}]
    rows, _ = load_rows(_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), tok, 128)
    sup_positions = [t for t, s in enumerate(rows[0].supervised) if s]
    assert tok.decode([rows[0].input_ids[t] for t in sup_positions]) == "noyes"
    # Both supervised spans sit right after an <|assistant|> marker, never inside a user turn.
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    starts = [t for t in sup_positions if not rows[0].supervised[t - 1]]
    for t in starts:
        before = rows[0].input_ids[:t]
        assert assistant in before[-3:]


def test_chat_template_that_rewrites_content_is_refused_under_content_only(tok: Any, tmp_path: Path) -> None:
    tok.chat_template = tok.chat_template.replace("message['content'] + '<|end|>' }}{% endgeneration %}",
                                                  "message['content'] | upper + '<|end|>' }}{% endgeneration %}")
    data = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match="changes an assistant message's text"):
        load_rows(data, tok, 128)
    rows, _ = load_rows(data, tok, 128, policy=TokenPolicy(append_eos=True))  # the template's own mask still works
    assert tok.decode(_split(tok, rows[0])[1]) == "HELLO JOHN<|end|>SEE YOU<|end|>"


# ----------------------------------------------------------------------------- the index


ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the garden {i}."}
        for i, (s, v) in enumerate((s, v) for v in ("runs", "sleeps") for s in ("cat", "dog", "bird", "fish"))]


def _index(root: Path, append_eos: bool) -> Path:
    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index

    data = _jsonl(root / "train.jsonl", ROWS)
    index_dir = root / f"index-{append_eos}"
    _, cfg = compose(["model.precision=float32", "grads.projection_dim=64", "grads.storage_dtype=float32",
                      f"grads.data_path={data}", f"grads.append_eos={str(append_eos).lower()}"])
    build_index(cfg.model, cfg.grads, index_dir)
    return index_dir


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("policy")
    return {eos: _index(root, eos) for eos in (False, True)}


def test_manifest_records_the_policy_and_the_data_report_counts(indexes: dict[bool, Path]) -> None:
    for eos, index_dir in indexes.items():
        manifest = json.loads((index_dir / "manifest.json").read_text())
        assert manifest["token_policy"]["append_eos"] is eos
        assert manifest["token_policy"]["eos_added"] is eos
        assert manifest["token_policy"]["prepend_bos"] is None and manifest["token_policy"]["bos_added"] is False
        assert manifest["data_report"]["eos_appended"] == (len(ROWS) if eos else 0)
    from gradian.index.reader import IndexReader

    a = next(IndexReader(indexes[False]).shards())[1]
    b = next(IndexReader(indexes[True]).shards())[1]
    # The supervised EOS changes every stored row.
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    assert (cos < 0.99).all()


def test_resume_with_another_policy_is_refused(indexes: dict[bool, Path]) -> None:
    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index
    from gradian.index.manifest import IndexMismatchError

    manifest = json.loads((indexes[False] / "manifest.json").read_text())
    _, cfg = compose(["model.precision=float32", "grads.projection_dim=64", "grads.storage_dtype=float32",
                      f"grads.data_path={manifest['data_file']}", "grads.append_eos=true"])
    with pytest.raises(IndexMismatchError, match="token_policy"):
        build_index(cfg.model, cfg.grads, indexes[False])


@pytest.mark.parametrize("eos", [False, True])
def test_queries_follow_the_index_policy(indexes: dict[bool, Path], tmp_path: Path, eos: bool) -> None:
    from gradian.rank.ranking import rank

    queries = _jsonl(tmp_path / "q.jsonl", [ROWS[5]])
    results = rank(indexes[eos], queries, top_k=2, score="cosine")
    # A training row as query finds itself at cosine 1 only if it is tokenized as it was indexed.
    assert results[0]["row_id"] == 5 and results[0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_rank_refuses_queries_asked_with_another_policy(indexes: dict[bool, Path], tmp_path: Path) -> None:
    from circuitkit_app.gradian_cli import main

    queries = _jsonl(tmp_path / "q.jsonl", [ROWS[0]])
    assert main(["rank", "--index", str(indexes[False]), "--queries", str(queries), "--append-eos", "true"]) == 2
    assert main(["rank", "--index", str(indexes[False]), "--queries", str(queries), "--append-eos", "false"]) == 0


def test_inspect_shows_a_rows_tokens_and_mask(indexes: dict[bool, Path], capsys: pytest.CaptureFixture) -> None:
    from circuitkit_app.gradian_cli import main

    assert main(["inspect", str(indexes[True]), "--row", "2"]) == 0
    out = capsys.readouterr().out
    assert "EOS appended to 8 of 8 rows (grads.append_eos=true)" in out
    assert "row 2 (source position 3)" in out
    lines = [line for line in out.splitlines() if "'<|endoftext|>'" in line]
    assert len(lines) == 1 and "yes" in lines[0]  # the appended EOS, supervised
    assert "' garden'" in out and "'The'" in out
    prompt_line = next(line for line in out.splitlines() if "'The'" in line)
    assert "yes" not in prompt_line
    assert main(["inspect", str(indexes[True]), "--row", "99"]) == 2


def test_data_report_line_is_logged(tok: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}] * 3)
    with caplog.at_level(logging.INFO, logger="gradian.data.rows"):
        load_rows(data, tok, 64, policy=TokenPolicy(append_eos=True))
    assert "EOS appended to 3 of 3 rows (grads.append_eos=true), BOS first in 0 rows" in caplog.text
