"""Indirect object identification (IOI): "When Mary and John went to the store, John gave a drink to" -> " Mary".

Each example names two people, the indirect object IO and the subject S; S is mentioned a
second time (S2) and the model should complete with IO. Both name orders are generated
("IO and S" and "S and IO"), over a handful of templates, places and objects.

Corruption (`discovery.data_params.ioi_corruption`; CORRUPTIONS):

* ``s2`` (the default): the second mention of the subject becomes a third name C, distinct
  from IO and S, so every name in the corrupted sentence occurs once and nothing tells IO from
  S. Clean and corrupted differ in exactly one token (S2 -> C)::

    clean:      When Mary and John went to the store, John gave a drink to
    corrupted:  When Mary and John went to the store, Lisa gave a drink to

* ``abc``: all three name positions (IO, S1, S2) get three other names A', B', C', distinct
  from each other and from IO and S: the "ABC" distribution of the IOI paper (Wang et al. 2022)
  and MIB's IOI counterfactual. Clean and corrupted differ in exactly three tokens::

    corrupted:  When Kate and Paul went to the store, Lisa gave a drink to

  Heads that read which names are in the sentence (not only which one repeats) matter under
  this corruption and not under ``s2``. C is the same name in both corruptions, and the clean
  prompts do not depend on the corruption (its extra names come from a second random stream).

correct = the IO name's token, incorrect = the S name's token. Names are used only if they are
a single token of the tokenizer with their leading space, as they appear mid-sentence, so a
corrupted prompt has its clean prompt's length; with fewer than three such names (five for
``abc``) the task cannot be built and raises TaskError.

Held-out templates (HELDOUT_TEMPLATES): sentences of other shapes that attribution never sees
(`build(..., templates="heldout")`); the pruning stage measures the circuit's faithfulness on
them beside the in-distribution figure (`discovery.data_params.heldout_template_examples`).
They draw names, places and objects from the same lists.
"""

from __future__ import annotations

import random

from circuitkit.core.config import choices
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import (
    continuation_ids,
    encode_prompt,
    pad_token_id,
    single_token_answer,
    special_prefix,
    token_split,
)

# The corruptions, and the names each needs (distinct single-token names per example).
CORRUPTIONS: dict[str, int] = {"s2": 3, "abc": 5}
DEFAULT_CORRUPTION = DataParams.ioi_corruption  # the config's default (s2)
assert tuple(CORRUPTIONS) == choices(DataParams, "ioi_corruption")

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
# Sentences of other shapes (the place first, the object before S2, other verbs and clause
# orders), never used for attribution: where a circuit is measured on prompts unlike those it
# was found on. Disjoint from TEMPLATES (a test checks).
HELDOUT_TEMPLATES: tuple[str, ...] = (
    "The {place} was quiet when {A} and {B} arrived. Soon {S} lent a {thing} to",
    "It was raining, so {A} and {B} stayed inside the {place}. There, {S} mailed a {thing} to",
    "At the {place}, {A} and {B} found a {thing}. Without a word, {S} gave it to",
    "On Friday {A} and {B} had lunch near the {place}, and afterwards {S} sold a {thing} to",
    "Because {A} and {B} were late for the meeting at the {place}, {S} quickly returned the {thing} to",
    "During the trip to the {place}, {A} and {B} argued for hours. In the end {S} tossed the {thing} to",
)
TEMPLATE_SETS: dict[str, tuple[str, ...]] = {"attribution": TEMPLATES, "heldout": HELDOUT_TEMPLATES}
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


def _check_names(tokenizer, names: list[tuple[str, int]], corruption: str) -> None:
    if corruption not in CORRUPTIONS:
        raise TaskError(f"discovery.data_params.ioi_corruption={corruption!r} is not an IOI corruption;"
                        f" allowed: {', '.join(CORRUPTIONS)}.")
    needed = CORRUPTIONS[corruption]
    if len(names) >= needed:
        return
    examples = ", ".join(f"{' ' + nm!r} -> {token_split(tokenizer, tokenizer.encode(' ' + nm, add_special_tokens=False))}"
                         for nm in NAMES[:3])
    raise TaskError(f"ioi needs at least {needed} first names that are a single token of this tokenizer (as"
                    f" ' Name' mid-sentence) for ioi_corruption={corruption}; found {len(names)}"
                    f"{' (' + ', '.join(nm for nm, _ in names) + ')' if names else ''} out of {len(NAMES)}"
                    f" candidates, e.g. {examples}. Use a model whose tokenizer has whole-word names"
                    f"{', or ioi_corruption=s2 (3 names)' if corruption != 's2' and len(names) >= 3 else ''},"
                    " or the jsonl task with your own prompts.")


def build(tokenizer, n: int, seed: int, corruption: str = DEFAULT_CORRUPTION,
          templates: str = "attribution") -> TaskData:
    """`n` IOI pairs generated from `seed` (template, place, object, names and order per example).

    corruption: a key of CORRUPTIONS (module docstring). templates: "attribution" (TEMPLATES)
    or "heldout" (HELDOUT_TEMPLATES). The clean prompts depend on the seed and the template set
    only, not on the corruption.

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = last prompt token (" to");
    correct (N, 1) = IO token; incorrect (N, 1) = S token.
    """
    names = single_token_names(tokenizer)
    _check_names(tokenizer, names, corruption)
    if templates not in TEMPLATE_SETS:
        raise ValueError(f"templates={templates!r}; allowed: {', '.join(TEMPLATE_SETS)}")
    template_set = TEMPLATE_SETS[templates]
    # Held-out prompts come from their own stream, so they do not repeat the attribution prompts' names.
    rng = random.Random(seed) if templates == "attribution" else random.Random(f"ioi-{templates}-{seed}")
    # abc's extra names: a stream of their own, so the clean prompts do not depend on the corruption.
    abc_rng = random.Random(f"ioi-abc-{templates}-{seed}")
    prefix = special_prefix(tokenizer)
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in range(n):
        t = rng.randrange(len(template_set))
        template = template_set[t]
        place, thing = rng.choice(PLACES), rng.choice(THINGS)
        (io, _), (s, _), (c, _) = rng.sample(names, 3)
        first, second = (io, s) if rng.random() < 0.5 else (s, io)
        clean_text = template.format(A=first, B=second, S=s, place=place, thing=thing)
        if corruption == "abc":
            a2, b2 = abc_rng.sample([nm for nm, _ in names if nm not in (io, s, c)], 2)
            corrupted_text = template.format(A=a2, B=b2, S=c, place=place, thing=thing)
        else:
            corrupted_text = template.format(A=first, B=second, S=c, place=place, thing=thing)
        where = f"ioi example {i} ({templates} template {t}: {clean_text!r})"
        clean.append(encode_prompt(tokenizer, clean_text, prefix))
        corrupted.append(encode_prompt(tokenizer, corrupted_text, prefix))
        correct.append([single_token_answer(tokenizer, clean_text, " " + io, where, "IO (correct)")])
        incorrect.append([single_token_answer(tokenizer, clean_text, " " + s, where, "S (incorrect)")])
        row_names.append(where)
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names)
