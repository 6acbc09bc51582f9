"""The rows diagnose checks: read through Gradian's own reader, measured with its token policy.

Rows come from `gradian.data.sources.Source` and are validated by `gradian.data.rows`'s row check, the
path `gradian index` reads them by, so a file that diagnose passes is one the index reads the
same way. A row that fails the check is kept as a problem (diagnose lists them all instead of
stopping at the first); a line that is not JSON stops the reading, as it does for the index.

Token lengths follow `gradian.data.rows`'s encoding: a prompt/completion row is
``[BOS] + prompt + completion [+ EOS]`` with prompt and completion tokenized separately
(`gradian.data.encode.encode_prompt_completion`, here in batches of `BATCH_ROWS` through the same tokenizer
call); a chat row is rendered by the tokenizer's template (`gradian.data.encode.encode_messages`). A trainer
cuts the end of a row, so a row loses supervised tokens at ``max_seq_length`` when its last
supervised token lies past it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gradian.data.encode import bos_for_prompt_rows, check_row, encode_messages, encode_prompt_completion
from gradian.data.sources import DataError, Source, SourceSpec

BATCH_ROWS = 4096


@dataclass
class DiagRow:
    """One row as the checks see it.

    ``prompt`` / ``completion``: the row's own strings, or for a chat row the non-assistant
    contents and the assistant contents (each joined by newlines). Token fields are filled by
    `measure` (None without a tokenizer): ``n_tokens`` the row's length, ``first_supervised`` /
    ``supervised_end`` the token span the loss covers (end exclusive; equal when none).
    """

    line: int
    kind: str  # "prompt" or "messages"
    prompt: str
    completion: str
    messages: list[dict] | None = None
    n_tokens: int | None = None
    first_supervised: int | None = None
    supervised_end: int | None = None


@dataclass
class ReadResult:
    """The rows of one file, and those its row check refused (position, message)."""

    path: str
    rows: list[DiagRow]
    malformed: list[tuple[int, str]]


def read_rows(path: str) -> ReadResult:
    """Every record of `path` (JSONL, Parquet, Arrow; `gradian.data.sources`) as a `DiagRow`.

    Raises DataError for a file that cannot be read at all (missing, not JSON on some line).
    """
    source = Source(SourceSpec(path=str(path)))
    rows: list[DiagRow] = []
    malformed: list[tuple[int, str]] = []
    for position, where, obj in source.records():
        try:
            kind = check_row(obj, where)
        except DataError as err:
            malformed.append((position, str(err)))
            continue
        if kind == "prompt":
            rows.append(DiagRow(position, kind, obj["prompt"], obj["completion"]))
        else:
            msgs = obj["messages"]
            rows.append(DiagRow(position, kind,
                                "\n".join(m["content"] for m in msgs if m["role"] != "assistant"),
                                "\n".join(m["content"] for m in msgs if m["role"] == "assistant"),
                                messages=msgs))
    return ReadResult(str(path), rows, malformed)


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    out: list[int] = []
    for chunk in _chunks(texts, BATCH_ROWS):
        nonempty = [t for t in chunk if t]
        ids = iter(tokenizer(nonempty, add_special_tokens=False, return_attention_mask=False,
                                  return_token_type_ids=False)["input_ids"]) if nonempty else iter(())
        # An empty string gets no tokens, as in `encode_prompt_completion` (it skips the call).
        out.extend(len(next(ids)) if t else 0 for t in chunk)
    return out


def measure(rows: list[DiagRow], tokenizer: Any, append_eos: bool) -> list[tuple[int, str]]:
    """Fill the token fields of `rows` in place; returns (line, message) for the chat rows the
    tokenizer cannot render (no chat template, ...), whose token fields stay None.

    `append_eos`: the trainer appends the tokenizer's EOS to each non-empty completion
    (`grads.append_eos`'s meaning; for chat rows, the template's own end of turn is counted
    either way, as `encode_messages` renders it).
    """
    bos = 1 if bos_for_prompt_rows(tokenizer, None) else 0
    eos = 1 if (append_eos and tokenizer.eos_token_id is not None) else 0
    plain = [r for r in rows if r.kind == "prompt"]
    for row, p, c in zip(plain, _lengths(tokenizer, [r.prompt for r in plain]),
                         _lengths(tokenizer, [r.completion for r in plain]), strict=True):
        tail = eos if c else 0
        row.n_tokens = bos + p + c + tail
        row.first_supervised = bos + p
        row.supervised_end = row.n_tokens if c else row.first_supervised
    failed: list[tuple[int, str]] = []
    for row in rows:
        if row.kind != "messages":
            continue
        try:
            ids, sup = encode_messages(tokenizer, row.messages, f"line {row.line}", end_of_turn=True)
        except DataError as err:
            failed.append((row.line, str(err)))
            continue
        marked = [t for t, s in enumerate(sup) if s]
        row.n_tokens = len(ids)
        row.first_supervised = marked[0] if marked else len(ids)
        row.supervised_end = marked[-1] + 1 if marked else len(ids)
    return failed


def row_tokens(row: DiagRow, tokenizer: Any, append_eos: bool) -> list[int]:
    """The token ids of one row, as `measure` counted them (for evidence: where a cut falls)."""
    if row.kind == "messages":
        return encode_messages(tokenizer, row.messages, f"line {row.line}", end_of_turn=True)[0]
    return encode_prompt_completion(tokenizer, row.prompt, row.completion, bos_for_prompt_rows(tokenizer, None),
                                     append_eos)[0]
