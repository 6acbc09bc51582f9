"""Multiple-choice questions (MMLU layout): predict the letter of the right option.

Input (`discovery.data_params.data_path`), a file or a directory:

* CSV in the original MMLU layout, no header: ``question, A, B, C, D, answer letter``. In a
  directory every ``*.csv`` (e.g. ``abstract_algebra_test.csv``) is read; the subject comes
  from the file name without ``_test`` / ``_dev`` / ``_val``.
* JSONL, one object per line: ``{"question": str, "choices": [str, ...], "answer": 0-based
  index or letter}`` with 2..26 choices and an optional ``"subject"``.

Prompt (the usual zero-shot MMLU format)::

    The following are multiple choice questions (with answers) about <subject>.

    <question>
    A. <choice>
    B. <choice>
    ...
    Answer:

The scored token is the letter after "Answer:" with its leading space (" A", " B", ...); each
letter must be one token of the tokenizer, else TaskError.

Corruption: the same question with the right option swapped with another option (picked with
the seed, deterministically per question), so the right letter changes and nothing else does.
correct = the clean letter, incorrect = the letter where the right option sits in the corrupted
prompt. A swap is only used if both prompts have the same token length; malformed rows raise
TaskError naming ``file:line``.
"""

from __future__ import annotations

import csv
import random
import string
from dataclasses import dataclass
from pathlib import Path

from circuitkit.core.io import first_non_utf8_line
from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import (
    as_path,
    continuation_ids,
    encode_prompt,
    jsonl_objects,
    pad_token_id,
    sample_indices,
    special_prefix,
    token_split,
)

LETTERS = string.ascii_uppercase
CSV_CHOICES = 4
SPLIT_SUFFIXES = ("_test", "_dev", "_val")


@dataclass
class Question:
    """One validated question: `answer` is the 0-based index of the right choice."""

    question: str
    choices: list[str]
    answer: int
    subject: str | None
    where: str  # file:line, for messages
    key: str  # file name:line, seeds the corruption (independent of how the path is spelled)


def subject_from_filename(path: Path) -> str | None:
    """'high_school_physics_test.csv' -> 'high school physics'; None without a split suffix."""
    stem = path.stem
    for suffix in SPLIT_SUFFIXES:
        if stem.endswith(suffix) and len(stem) > len(suffix):
            return stem[: -len(suffix)].replace("_", " ")
    return None


def _answer_index(value: object, n_choices: int, where: str) -> int:
    """A letter ('B', ' b') or a 0-based int -> index; TaskError naming `where` otherwise."""
    valid = LETTERS[:n_choices]
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value < n_choices:
            return value
        raise TaskError(f"{where}: answer index {value} is out of range for {n_choices} choices (0..{n_choices - 1}).")
    if isinstance(value, str) and value.strip().upper() in valid and len(value.strip()) == 1:
        return valid.index(value.strip().upper())
    hint = (" (the MMLU CSV layout has no header row; remove it)"
            if isinstance(value, str) and value.strip().lower() in ("answer", "label", "target") else "")
    raise TaskError(f"{where}: answer {value!r} is not one of the letters {', '.join(valid)}"
                    f" or a 0-based index{hint}.")


def read_csv(path: Path) -> list[Question]:
    """Questions of one MMLU-layout CSV file (6 columns, no header)."""
    subject = subject_from_filename(path)
    out: list[Question] = []
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh)
        start = 1
        try:
            for row in reader:
                lineno, where = start, f"{path}:{start}"
                start = reader.line_num + 1
                if not row or all(not cell.strip() for cell in row):
                    continue
                if len(row) != CSV_CHOICES + 2:
                    raise TaskError(f"{where}: expected {CSV_CHOICES + 2} columns (question, A, B, C, D, answer"
                                    f" letter), found {len(row)}; quote fields that contain commas.")
                question, choices = row[0].strip(), [c.strip() for c in row[1:-1]]
                if not question:
                    raise TaskError(f"{where}: the question (first column) is empty.")
                out.append(Question(question, choices, _answer_index(row[-1], CSV_CHOICES, where), subject, where,
                                    f"{path.name}:{lineno}"))
        except csv.Error as err:
            raise TaskError(f"{path}:{reader.line_num}: unreadable CSV ({err}).") from None
        except UnicodeDecodeError as err:
            raise TaskError(f"{path}:{first_non_utf8_line(path)}: not UTF-8 ({err.reason}); save the file as"
                            " UTF-8.") from None
    return out


def read_jsonl(path: Path) -> list[Question]:
    """Questions of one JSONL file: {"question", "choices", "answer", optional "subject"}."""
    file_subject = subject_from_filename(path)
    out: list[Question] = []
    for lineno, where, obj in jsonl_objects(path, "an object with keys question, choices, answer"):
        if any(k not in obj for k in ("question", "choices", "answer")):
            raise TaskError(f"{where}: expected an object with keys question, choices, answer; got keys"
                            f" {', '.join(obj) or '(none)'}.")
        question, choices = obj["question"], obj["choices"]
        if not isinstance(question, str) or not question.strip():
            raise TaskError(f"{where}: 'question' must be a non-empty string.")
        if (not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS)
                or not all(isinstance(c, str) for c in choices)):
            raise TaskError(f"{where}: 'choices' must be a list of 2 to {len(LETTERS)} strings, got {choices!r}.")
        subject = obj.get("subject", file_subject)
        if subject is not None and not isinstance(subject, str):
            raise TaskError(f"{where}: 'subject' must be a string, got {subject!r}.")
        out.append(Question(question.strip(), [c.strip() for c in choices],
                            _answer_index(obj["answer"], len(choices), where), subject or None, where,
                            f"{path.name}:{lineno}"))
    return out


def read_questions(path: Path) -> list[Question]:
    """All questions under `path` (a .csv/.jsonl file, or a directory of them, in name order)."""
    readers = {".csv": read_csv, ".jsonl": read_jsonl}
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in readers and p.is_file())
        if not files:
            raise TaskError(f"{path}: no .csv or .jsonl files in this directory; the mmlu task reads MMLU CSV"
                            " files (question, A, B, C, D, answer letter) or JSONL.")
    else:
        if path.suffix not in readers:
            raise TaskError(f"{path}: unknown file type {path.suffix!r}; use .csv (MMLU layout) or .jsonl.")
        files = [path]
    return [q for f in files for q in readers[f.suffix](f)]


def render(q: Question, choices: list[str]) -> str:
    """The prompt for `q` with its options in the order `choices`, ending with 'Answer:'."""
    about = f" about {q.subject}" if q.subject else ""
    options = "".join(f"{LETTERS[k]}. {c}\n" for k, c in enumerate(choices))
    return f"The following are multiple choice questions (with answers){about}.\n\n{q.question}\n{options}Answer:"


def corrupt(tokenizer, q: Question, seed: int, prefix: list[int]) -> tuple[list[int], list[int], int]:
    """(clean ids, corrupted ids, new answer index): the right option swapped with another one.

    The partner is the first, in a seeded order fixed per question, whose swap changes the text
    and keeps the token length; TaskError naming the row when none does.
    """
    clean = encode_prompt(tokenizer, render(q, q.choices), prefix)
    others = [k for k in range(len(q.choices)) if k != q.answer]
    random.Random(f"{seed}:{q.key}").shuffle(others)
    lengths = []
    for k in others:
        if q.choices[k] == q.choices[q.answer]:
            lengths.append("same text")
            continue
        swapped = list(q.choices)
        swapped[k], swapped[q.answer] = swapped[q.answer], swapped[k]
        ids = encode_prompt(tokenizer, render(q, swapped), prefix)
        if len(ids) == len(clean):
            return clean, ids, k
        lengths.append(f"{len(ids)} tokens")
    raise TaskError(f"{q.where}: no swap of the right option ({LETTERS[q.answer]}) with another option gives a"
                    f" different prompt of the same token length (clean: {len(clean)} tokens; swaps: "
                    f"{', '.join(f'{LETTERS[k]} -> {d}' for k, d in zip(others, lengths, strict=True))}).")


def letter_ids(tokenizer, n_letters: int) -> list[int]:
    """Token ids of " A", " B", ... after "Answer:"; TaskError when a letter is not one token."""
    ref = "Question?\nA. yes\nB. no\nAnswer:"
    out = []
    for letter in LETTERS[:n_letters]:
        ids = continuation_ids(tokenizer, ref, " " + letter)
        if ids is None or len(ids) != 1:
            split = token_split(tokenizer, tokenizer.encode(ref + " " + letter, add_special_tokens=False)[-3:])
            raise TaskError(f"the mmlu task needs each option letter to be one token after 'Answer:', but"
                            f" {' ' + letter!r} is not for this tokenizer ('Answer: {letter}' ends as {split});"
                            " use the jsonl task with answers that are single tokens.")
        out.append(ids[0])
    return out


def build(tokenizer, path: str | Path, n: int, seed: int, max_tokens: int | None = None) -> TaskData:
    """`n` questions sampled with `seed` from `path` (all if fewer), as clean/corrupted pairs.

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = the ':' of 'Answer:';
    correct (N, 1) = clean letter token; incorrect (N, 1) = the corrupted prompt's right letter.
    """
    path = as_path(path, "mmlu")
    questions = read_questions(path)
    picked = sample_indices(len(questions), n, seed, str(path))
    prefix = special_prefix(tokenizer)
    letters = letter_ids(tokenizer, max(len(questions[i].choices) for i in picked))
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in picked:
        q = questions[i]
        c_ids, x_ids, new = corrupt(tokenizer, q, seed, prefix)
        clean.append(c_ids)
        corrupted.append(x_ids)
        correct.append([letters[q.answer]])
        incorrect.append([letters[new]])
        row_names.append(q.where)
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names, max_tokens)
