"""Subject-verb agreement (SVA): "The keys near the cabinet" -> " are", "The key near the cabinets" -> " is".

Each prompt is a subject noun phrase with a prepositional attractor ("The {subject} {prep} the
{attractor}"); the model should continue with the verb form that agrees with the subject, not
with the nearer attractor. The subject's number and the attractor's number are drawn
independently, so half the prompts have an attractor of the other number (the hard case of
Linzen et al. 2016; the SVA tasks of Finlayson et al. 2021 and Mueller et al. 2024 use this
shape).

Corruption (the only one): the subject noun is replaced by its other number ("key" <-> "keys"),
attractor and everything else kept; clean and corrupted differ in exactly one token, so the
correct answer of one is the incorrect answer of the other:

    clean:      The key near the cabinets      correct " is",  incorrect " are"
    corrupted:  The keys near the cabinets

The verb pair is drawn per prompt from VERBS (is/are, was/were, has/have). Nouns are used only if
both forms are one token of the tokenizer as " noun" mid-sentence (so a corrupted prompt has its
clean prompt's length); with fewer than MIN_NOUNS such nouns the task raises TaskError.
"""

from __future__ import annotations

import random

from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import (
    continuation_ids,
    encode_prompt,
    pad_token_id,
    single_token_answer,
    special_prefix,
)

TEMPLATE = "The {subject} {prep} the {attractor}"
PREPS: tuple[str, ...] = ("near", "behind", "beside", "under", "above", "by", "next to", "with", "for", "of")
# (singular, plural): regular and irregular plurals of common nouns.
NOUNS: tuple[tuple[str, str], ...] = (
    ("key", "keys"), ("dog", "dogs"), ("book", "books"), ("car", "cars"), ("house", "houses"),
    ("teacher", "teachers"), ("student", "students"), ("doctor", "doctors"), ("table", "tables"),
    ("door", "doors"), ("window", "windows"), ("friend", "friends"), ("girl", "girls"), ("boy", "boys"),
    ("tree", "trees"), ("bird", "birds"), ("cat", "cats"), ("box", "boxes"), ("child", "children"),
    ("man", "men"), ("woman", "women"), ("city", "cities"), ("road", "roads"), ("picture", "pictures"),
    ("song", "songs"), ("player", "players"), ("farmer", "farmers"), ("officer", "officers"),
    ("letter", "letters"), ("river", "rivers"), ("flower", "flowers"), ("chair", "chairs"),
)
VERBS: tuple[tuple[str, str], ...] = (("is", "are"), ("was", "were"), ("has", "have"))
MIN_NOUNS = 4
CONTEXT = "The"  # nouns are checked as the continuation of this word: mid-sentence " noun"


def usable_nouns(tokenizer) -> list[tuple[str, str]]:
    """(singular, plural) pairs of NOUNS whose two forms are each one token as " noun" mid-sentence."""
    found = []
    for singular, plural in NOUNS:
        ids = [continuation_ids(tokenizer, CONTEXT, " " + w) for w in (singular, plural)]
        if all(x is not None and len(x) == 1 for x in ids) and ids[0] != ids[1]:
            found.append((singular, plural))
    return found


def build(tokenizer, n: int, seed: int) -> TaskData:
    """`n` SVA pairs generated from `seed` (subject, its number, attractor and its number, preposition, verb).

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = the attractor noun (last token);
    correct (N, 1) = the verb form agreeing with the clean subject; incorrect (N, 1) = the other form.
    """
    nouns = usable_nouns(tokenizer)
    if len(nouns) < MIN_NOUNS:
        raise TaskError(f"sva needs at least {MIN_NOUNS} nouns whose singular and plural are each a single token"
                        f" of this tokenizer (as ' noun' mid-sentence); found {len(nouns)} of {len(NOUNS)}. Use a"
                        " model whose tokenizer has whole-word nouns, or the jsonl task with your own prompts.")
    rng = random.Random(f"sva-{seed}")
    prefix = special_prefix(tokenizer)
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in range(n):
        (subj_s, subj_p), (attr_s, attr_p) = rng.sample(nouns, 2)
        plural, attr_plural = rng.random() < 0.5, rng.random() < 0.5
        prep, (verb_s, verb_p) = rng.choice(PREPS), rng.choice(VERBS)
        subject, other = (subj_p, subj_s) if plural else (subj_s, subj_p)
        attractor = attr_p if attr_plural else attr_s
        clean_text = TEMPLATE.format(subject=subject, prep=prep, attractor=attractor)
        corrupted_text = TEMPLATE.format(subject=other, prep=prep, attractor=attractor)
        good, bad = (verb_p, verb_s) if plural else (verb_s, verb_p)
        where = f"sva example {i} ({clean_text!r})"
        clean.append(encode_prompt(tokenizer, clean_text, prefix))
        corrupted.append(encode_prompt(tokenizer, corrupted_text, prefix))
        correct.append([single_token_answer(tokenizer, clean_text, " " + good, where, "agreeing verb (correct)")])
        incorrect.append([single_token_answer(tokenizer, clean_text, " " + bad, where, "other verb (incorrect)")])
        row_names.append(where)
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names)
