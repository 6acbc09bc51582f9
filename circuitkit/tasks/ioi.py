"""Indirect object identification (IOI): "When Mary and John went to the store, John gave a drink to" -> " Mary".

Each example names two people, the indirect object IO and the subject S; S is mentioned a
second time (S2) and the model should complete with IO. Both name orders are generated
("IO and S" and "S and IO"), over a handful of templates, places and objects.

Corruption ("ABC", the convention of the EAP / EAP-IG IOI data: S2 is replaced by a random
third name): the second mention of the subject becomes a third name C, distinct from IO and S,
so every name in the corrupted sentence occurs once and nothing tells IO from S::

    clean:      When Mary and John went to the store, John gave a drink to
    corrupted:  When Mary and John went to the store, Lisa gave a drink to

correct = the IO name's token, incorrect = the S name's token. Clean and corrupted differ in
exactly one token (S2 -> C). Names are used only if they are a single token of the tokenizer
with their leading space, as they appear mid-sentence; with fewer than three such names the
task cannot be built and raises TaskError.
"""

from __future__ import annotations

import random

from circuitkit.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.tasks.text import (
    continuation_ids,
    encode_prompt,
    pad_token_id,
    single_token_answer,
    special_prefix,
    token_split,
)

# {A} and {B} are the two names of the first clause (IO and S in either order), {S} the second
# mention of the subject. Every name follows a space, so it is tokenized as " Name".
TEMPLATES: tuple[str, ...] = (
    "When {A} and {B} went to the {place}, {S} gave a {thing} to",
    "After {A} and {B} arrived at the {place}, {S} handed a {thing} to",
    "While {A} and {B} were working at the {place}, {S} passed a {thing} to",
    "Then, {A} and {B} spent the day at the {place}. {S} sent a {thing} to",
    "Later that day, {A} and {B} met at the {place}. {S} offered a {thing} to",
    "Yesterday {A} and {B} walked to the {place}, and {S} brought a {thing} to",
    "As {A} and {B} left the {place}, {S} threw a {thing} to",
    "Once {A} and {B} got to the {place}, {S} showed a {thing} to",
)
PLACES: tuple[str, ...] = ("store", "park", "school", "office", "station", "garden", "market", "library",
                           "beach", "river", "house", "hospital")
THINGS: tuple[str, ...] = ("drink", "book", "ball", "letter", "gift", "key", "ring", "bag", "flower", "pen",
                           "cake", "hat")
# Common first names; only those that are one token of the tokenizer are used.
NAMES: tuple[str, ...] = (
    "Mary", "John", "Lisa", "James", "Anna", "Tom", "Sarah", "Paul", "Kate", "Mark", "Emma", "David",
    "Laura", "Michael", "Alice", "Peter", "Helen", "Robert", "Susan", "Daniel", "Linda", "Richard",
    "Karen", "Thomas", "Nancy", "George", "Julia", "Steven", "Amy", "Kevin", "Rachel", "Brian", "Emily",
    "Jason", "Grace", "Eric", "Jessica", "Adam", "Rose", "Sam", "Jane", "Chris", "Anne", "Max", "Lucy",
    "Jack", "Ben", "Nina", "Frank", "Maria", "Alex", "Sophie", "Luke", "Claire", "Henry", "Diana", "Ryan",
    "Olivia", "Jacob", "Hannah", "Matt", "Ellen", "Scott", "Kelly", "Joe", "Amanda", "Carl", "Megan",
    "Dan", "Ruth", "Bill", "Clara", "Tim", "Jenny", "Leo", "Eva", "Ian", "Zoe", "Victor", "Ella",
)
NAME_CONTEXT = "When"  # names are checked as the continuation of this word: mid-sentence " Name"


def single_token_names(tokenizer) -> list[tuple[str, int]]:
    """(name, token id) for every name in NAMES that is one token as " Name" mid-sentence.

    Names whose tokens coincide (e.g. a lower-casing tokenizer) are kept once.
    """
    found: dict[int, str] = {}
    for name in NAMES:
        ids = continuation_ids(tokenizer, NAME_CONTEXT, " " + name)
        if ids is not None and len(ids) == 1 and ids[0] not in found:
            found[ids[0]] = name
    return [(name, tid) for tid, name in found.items()]


def build(tokenizer, n: int, seed: int) -> TaskData:
    """`n` IOI pairs generated from `seed` (template, place, object, names and order per example).

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = last prompt token (" to");
    correct (N, 1) = IO token; incorrect (N, 1) = S token.
    """
    names = single_token_names(tokenizer)
    if len(names) < 3:
        examples = ", ".join(f"{' ' + nm!r} -> {token_split(tokenizer, tokenizer.encode(' ' + nm, add_special_tokens=False))}"
                             for nm in NAMES[:3])
        raise TaskError(f"ioi needs at least 3 first names that are a single token of this tokenizer (as"
                        f" ' Name' mid-sentence); found {len(names)}"
                        f"{' (' + ', '.join(nm for nm, _ in names) + ')' if names else ''} out of {len(NAMES)}"
                        f" candidates, e.g. {examples}. Use a model whose tokenizer has whole-word names,"
                        " or the jsonl task with your own prompts.")
    rng = random.Random(seed)
    prefix = special_prefix(tokenizer)
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in range(n):
        t = rng.randrange(len(TEMPLATES))
        template = TEMPLATES[t]
        place, thing = rng.choice(PLACES), rng.choice(THINGS)
        (io, _), (s, _), (c, _) = rng.sample(names, 3)
        first, second = (io, s) if rng.random() < 0.5 else (s, io)
        clean_text = template.format(A=first, B=second, S=s, place=place, thing=thing)
        corrupted_text = template.format(A=first, B=second, S=c, place=place, thing=thing)
        where = f"ioi example {i} (template {t}: {clean_text!r})"
        clean.append(encode_prompt(tokenizer, clean_text, prefix))
        corrupted.append(encode_prompt(tokenizer, corrupted_text, prefix))
        correct.append([single_token_answer(tokenizer, clean_text, " " + io, where, "IO (correct)")])
        incorrect.append([single_token_answer(tokenizer, clean_text, " " + s, where, "S (incorrect)")])
        row_names.append(where)
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names)
