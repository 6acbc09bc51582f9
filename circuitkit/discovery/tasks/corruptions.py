"""Corrupted prompts generated for a user's rows (`discovery.data_params.corruption`).

The jsonl task reads rows that carry their own `corrupted` prompt. With a strategy set, a row
needs only `clean` and `correct` (and `incorrect` where the strategy cannot derive it), and the
corrupted prompt is made here, deterministically from the seed and the row's line:

* ``entity_swap``: the row's ``entity`` (a substring of ``clean``) is replaced, everywhere in the
  prompt, by another row's entity whose prompt then has the same number of tokens and whose
  correct answer is another token. That row's correct answer is the incorrect one (unless the row
  gives ``incorrect``): "The capital of France is" / " Paris" -> "The capital of Italy is" / " Rome".
* ``name_swap``: the first person's name of the prompt (a first name from the IOI task's list,
  or the row's ``entity``) is replaced everywhere by another name of the same token length, drawn
  from the names of the dataset and the list. Needs ``incorrect`` on the row.
* ``token_replace``: the tokens of the row's ``entity`` are replaced by as many random word tokens
  of the vocabulary (a token-level corruption: the corrupted ids are not re-tokenized text).
  Needs ``incorrect`` on the row.

A row that cannot be corrupted (no entity in its prompt, no partner of the same length, ...)
is a failure named by `file:line`; the data stage then checks each generated pair with the model
(`discovery.data_params.min_valid_share`) and drops, lists and counts the pairs whose corruption
leaves the model's answer as it was.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from circuitkit.discovery.tasks.base import TaskError
from circuitkit.discovery.tasks.ioi import NAMES
from circuitkit.discovery.tasks.text import encode_prompt, single_token_answer, special_prefix

STRATEGIES = ("entity_swap", "name_swap", "token_replace")
NEEDS_ENTITY = ("entity_swap", "token_replace")
NEEDS_INCORRECT = ("name_swap", "token_replace")
_WORD = re.compile(r"^ ?[A-Za-z]{2,}$")


@dataclass
class GeneratedPair:
    """One row's pair as token ids: clean, corrupted, correct and incorrect answers, its `file:line`."""

    clean: list[int]
    corrupted: list[int]
    correct: list[int]
    incorrect: list[int]
    where: str
    corrupted_text: str | None  # None for token_replace (ids only)


def _replace_all(text: str, old: str, new: str) -> str:
    return re.sub(rf"(?<![A-Za-z0-9]){re.escape(old)}(?![A-Za-z0-9])", new, text)


def _first_name(text: str) -> str | None:
    found = [(m.start(), m.group(0)) for name in NAMES for m in re.finditer(rf"(?<![A-Za-z]){name}(?![a-z])", text)]
    return min(found)[1] if found else None


def _answer_ids(tokenizer, prompt: str, answers: Sequence[str], where: str, role: str) -> list[int]:
    return list(dict.fromkeys(single_token_answer(tokenizer, prompt, a, where, role) for a in answers))


def generate(rows: Sequence, strategy: str, tokenizer, seed: int) -> tuple[list[GeneratedPair], list[str]]:
    """Pairs for `rows` (jsonl.PairRow with `corrupted` None) by `strategy`; returns (pairs, failures),
    each failure one line naming `file:line` and why the row could not be corrupted."""
    if strategy not in STRATEGIES:
        raise TaskError(f"discovery.data_params.corruption={strategy!r} is not a strategy; allowed:"
                        f" {', '.join(STRATEGIES)}.")
    prefix = special_prefix(tokenizer)
    pairs, failures = [], []
    entities = [r.entity for r in rows]
    names = list(dict.fromkeys([n for r in rows if (n := r.entity or _first_name(r.clean))] + list(NAMES)))
    for row in rows:
        rng = random.Random(f"{strategy}-{seed}-{row.where}")
        clean = encode_prompt(tokenizer, row.clean, prefix)
        correct = _answer_ids(tokenizer, row.clean, row.correct, row.where, "correct")
        entity = row.entity if strategy != "name_swap" else (row.entity or _first_name(row.clean))
        if entity is None or entity not in row.clean:
            failures.append(f"{row.where}: {'no first name found in' if strategy == 'name_swap' else 'its entity'}"
                            f" {'' if entity is None else repr(entity) + ' is not in'} the clean prompt"
                            + ("; add an 'entity' key naming the span to corrupt" if entity is None else ""))
            continue
        if strategy == "token_replace":
            pos = _span_positions(tokenizer, row.clean, entity, prefix)
            if pos is None:
                failures.append(f"{row.where}: the entity {entity!r} does not fall on token boundaries of the prompt")
                continue
            words = [t for t in range(len(tokenizer)) if t not in clean and _WORD.match(tokenizer.decode([t]) or "")]
            corrupted = list(clean)
            for p in pos:
                corrupted[p] = rng.choice(words)
            incorrect = _answer_ids(tokenizer, row.clean, row.incorrect, row.where, "incorrect")
            pairs.append(GeneratedPair(clean, corrupted, correct, incorrect, row.where, None))
            continue
        pool = entities if strategy == "entity_swap" else names
        candidates = []
        for j, other in enumerate(pool):
            if other is None or other == entity or (strategy == "entity_swap" and rows[j].clean == row.clean):
                continue
            text = _replace_all(row.clean, entity, other)
            ids = encode_prompt(tokenizer, text, prefix)
            if len(ids) != len(clean):
                continue
            if strategy == "entity_swap" and not row.incorrect:
                try:
                    wrong = _answer_ids(tokenizer, rows[j].clean, rows[j].correct, rows[j].where, "correct")
                except TaskError:
                    continue
                if set(wrong) & set(correct):
                    continue
            else:
                wrong = None
            candidates.append((text, ids, wrong))
        if not candidates:
            kind = "entity" if strategy == "entity_swap" else "name"
            failures.append(f"{row.where}: no other {kind} gives a prompt of the same {len(clean)} tokens"
                            + (" with another correct answer" if strategy == "entity_swap" else ""))
            continue
        text, ids, wrong = rng.choice(candidates)
        incorrect = wrong if wrong is not None else _answer_ids(tokenizer, row.clean, row.incorrect, row.where,
                                                                "incorrect")
        if set(incorrect) & set(correct):
            failures.append(f"{row.where}: the incorrect answer equals a correct one")
            continue
        pairs.append(GeneratedPair(clean, ids, correct, incorrect, row.where, text))
    return pairs, failures


def _span_positions(tokenizer, text: str, span: str, prefix: list[int]) -> list[int] | None:
    """Token positions (in the prefixed prompt) of the first occurrence of `span`, or None when the
    span does not start and end on token boundaries."""
    start = text.index(span)
    if start > 0 and text[start - 1] == " ":  # a word token carries its leading space
        start -= 1
        span = " " + span
    full = encode_prompt(tokenizer, text, prefix)
    before = encode_prompt(tokenizer, text[:start], prefix)
    upto = encode_prompt(tokenizer, text[:start + len(span)], prefix)
    if full[:len(before)] != before or full[:len(upto)] != upto or len(upto) == len(before):
        return None
    return list(range(len(before), len(upto)))
