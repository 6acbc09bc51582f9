"""Factual recall, capital cities: "The capital of France is" -> " Paris".

Each prompt asks for a country's capital in one of TEMPLATES; the answer is the first token of
" Capital". Corruption (the only one): the country is replaced by another country of the same
token length whose capital starts with another token, so the corrupted prompt's answer is the
clean prompt's incorrect answer (the subject-replacement contrast of factual-recall circuit work,
e.g. Meng et al. 2022's causal tracing and Geva et al. 2023):

    clean:      The capital of France is      correct " Paris" (first token)
    corrupted:  The capital of Spain is       incorrect " Madrid" (first token)

The facts are the capitals of widely known countries (COUNTRIES, as of 2026). A model that does
not know a fact still yields a pair; whether the model solves the task is measured by the
pipeline (m(full) > 0 on most pairs), not assumed here. With fewer than MIN_COUNTRIES usable
countries (a capital's first token shared, or a country's length unmatched) the task raises TaskError.
"""

from __future__ import annotations

import random
from collections import defaultdict

from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import continuation_ids, encode_prompt, pad_token_id, special_prefix

TEMPLATES: tuple[str, ...] = (
    "The capital of {country} is",
    "The capital city of {country} is",
    "{country}'s capital city is called",
    "Q: What is the capital of {country}? A: The capital is",
)
COUNTRIES: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"), ("Thailand", "Bangkok"),
    ("Hungary", "Budapest"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Canada", "Ottawa"),
    ("Australia", "Canberra"), ("India", "New Delhi"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Mexico", "Mexico City"), ("Belgium", "Brussels"),
    ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Ukraine", "Kyiv"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("Colombia", "Bogota"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"),
    ("Scotland", "Edinburgh"), ("England", "London"), ("Brazil", "Brasilia"),
)
MIN_COUNTRIES = 4


def _facts(tokenizer, template: str) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(country, capital, country's token ids in the prompt, capital's first token) for `template`."""
    facts = []
    for country, capital in COUNTRIES:
        text = template.format(country=country)
        answer = continuation_ids(tokenizer, text, " " + capital)
        if not answer:
            continue
        facts.append((country, capital, tuple(tokenizer.encode(text, add_special_tokens=False, verbose=False)),
                      answer[0]))
    return facts


def build(tokenizer, n: int, seed: int) -> TaskData:
    """`n` capital-city pairs generated from `seed` (template, country, the other country).

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = the prompt's last token;
    correct (N, 1) = the clean capital's first token; incorrect (N, 1) = the corrupted capital's.
    """
    rng = random.Random(f"capitals-{seed}")
    prefix = special_prefix(tokenizer)
    # Per template: countries grouped by the prompt's token length, so a pair has one length.
    groups = []
    for t, template in enumerate(TEMPLATES):
        by_len = defaultdict(list)
        for fact in _facts(tokenizer, template):
            by_len[len(fact[2])].append(fact)
        groups += [(t, facts) for facts in by_len.values() if len({f[3] for f in facts}) >= 2]
    usable = sum(len(f) for _, f in groups)
    if usable < MIN_COUNTRIES:
        raise TaskError(f"capitals needs at least {MIN_COUNTRIES} countries whose prompts have a partner of the same"
                        f" token length with another capital's first token; found {usable} (of {len(COUNTRIES)}"
                        f" x {len(TEMPLATES)} templates). Use the jsonl task with your own prompts.")
    weights = [len(f) for _, f in groups]
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in range(n):
        t, facts = rng.choices(groups, weights)[0]
        a = rng.choice(facts)
        b = rng.choice([f for f in facts if f[3] != a[3]])
        clean_text = TEMPLATES[t].format(country=a[0])
        clean.append(prefix + list(a[2]))
        corrupted.append(prefix + list(b[2]))
        assert clean[-1] == encode_prompt(tokenizer, clean_text, prefix)
        correct.append([a[3]])
        incorrect.append([b[3]])
        row_names.append(f"capitals example {i} ({clean_text!r} -> {a[1]!r}; corrupted: {b[0]} -> {b[1]!r})")
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names)
