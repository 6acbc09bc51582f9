"""User-supplied clean / corrupted pairs from a JSONL file, and the text helpers other tasks share.

Each non-blank line of the file is one JSON object::

    {"clean": "The capital of France is", "corrupted": "The capital of Italy is",
     "correct": " Paris", "incorrect": [" Rome"]}

* ``clean`` / ``corrupted``: the prompts. They must tokenize to the same number of tokens
  (attribution compares them position by position); the scored position is the last token.
* ``correct`` / ``incorrect``: a string or a list of strings, each the text that continues the
  clean prompt. Each answer must be exactly **one token** in context: the first token of the
  continuation, written as it appears after the prompt, usually with its leading space
  (``" Paris"``, not ``"Paris"``). A multi-token answer is an error that shows the split so you
  can pick its first token.

Other keys on a row are ignored (ids, notes). Blank lines are skipped. Every row is checked
before sampling, so an error does not depend on the seed; errors name ``file:line``.

"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import (
    as_path,
    encode_prompt,
    jsonl_objects,
    pad_token_id,
    sample_indices,
    single_token_answer,
    special_prefix,
    token_split,
)

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("clean", "corrupted", "correct", "incorrect")


# --------------------------------------------------------------------------- the jsonl task

@dataclass
class PairRow:
    """One validated row: prompts, answer strings and where it came from (`file:line`)."""

    clean: str
    corrupted: str
    correct: list[str]
    incorrect: list[str]
    where: str


def _answers(value: object, key: str, where: str) -> list[str]:
    """A row's answer field as a non-empty list of non-empty strings."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
        raise TaskError(f"{where}: '{key}' must be a non-empty string or a non-empty list of non-empty"
                        f" strings, got {value!r}.")
    return items


def read_rows(path: Path) -> list[PairRow]:
    """Parse and validate every row of a pairs JSONL file (structure only, no tokenizer)."""
    if path.is_dir():
        raise TaskError(f"discovery.data_params.data_path={str(path)!r} is a directory; the jsonl task"
                        " reads one .jsonl file.")
    rows: list[PairRow] = []
    for _lineno, where, obj in jsonl_objects(path, f"a JSON object with keys {', '.join(REQUIRED_KEYS)}"):
        missing = [k for k in REQUIRED_KEYS if k not in obj]
        if missing:
            raise TaskError(f"{where}: missing key(s) {', '.join(missing)}; each row needs"
                            f" {', '.join(REQUIRED_KEYS)}.")
        for key in ("clean", "corrupted"):
            if not isinstance(obj[key], str) or not obj[key]:
                raise TaskError(f"{where}: '{key}' must be a non-empty string, got {obj[key]!r}.")
        if obj["clean"] == obj["corrupted"]:
            raise TaskError(f"{where}: 'clean' and 'corrupted' are the same text; the corrupted prompt"
                            " must differ (attribution measures the difference).")
        rows.append(PairRow(obj["clean"], obj["corrupted"], _answers(obj["correct"], "correct", where),
                            _answers(obj["incorrect"], "incorrect", where), where))
    return rows


def tokenize_row(tokenizer, row: PairRow, prefix: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(clean ids, corrupted ids, correct ids, incorrect ids) of one row, checked.

    Errors name the row's `file:line`: different prompt lengths, an answer that is not exactly
    one token after the clean prompt, or a token that is both correct and incorrect.
    """
    clean = encode_prompt(tokenizer, row.clean, prefix)
    corrupted = encode_prompt(tokenizer, row.corrupted, prefix)
    if len(clean) != len(corrupted):
        raise TaskError(f"{row.where}: clean prompt is {len(clean)} tokens but corrupted is {len(corrupted)}"
                        f" (clean {token_split(tokenizer, clean)}, corrupted {token_split(tokenizer, corrupted)});"
                        " a pair must tokenize to the same length: change the corrupted words so the"
                        " tokens line up.")
    correct = list(dict.fromkeys(single_token_answer(tokenizer, row.clean, a, row.where, "correct")
                                 for a in row.correct))
    incorrect = list(dict.fromkeys(single_token_answer(tokenizer, row.clean, a, row.where, "incorrect")
                                   for a in row.incorrect))
    both = set(correct) & set(incorrect)
    if both:
        raise TaskError(f"{row.where}: token(s) {token_split(tokenizer, sorted(both))} are both correct and"
                        " incorrect; an answer token can only be on one side.")
    return clean, corrupted, correct, incorrect


def build(tokenizer, path: str | Path, n: int, seed: int, max_tokens: int | None = None) -> TaskData:
    """`n` pairs sampled with `seed` from the JSONL file at `path` (all rows if it has fewer).

    Shapes: clean/corrupted/mask (N, T) right-padded to the longest sampled prompt; answer_pos
    (N,) = last prompt token; correct (N, Kc) / incorrect (N, Ki) padded with -1.
    """
    path = as_path(path, "jsonl")
    rows = read_rows(path)
    prefix = special_prefix(tokenizer)
    tokenized = [tokenize_row(tokenizer, row, prefix) for row in rows]
    picked = sample_indices(len(rows), n, seed, str(path))
    return from_token_lists([tokenized[i][0] for i in picked], [tokenized[i][1] for i in picked],
                            [tokenized[i][2] for i in picked], [tokenized[i][3] for i in picked],
                            pad_token_id(tokenizer), row_names=[rows[i].where for i in picked],
                            max_tokens=max_tokens)
