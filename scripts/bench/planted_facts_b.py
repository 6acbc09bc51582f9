"""A second planted-fact corpus, built differently from bench_planted_facts.make_corpus.

Other entities (other syllables), other fact kinds (instrument, colour, home city, language,
commute), two document templates per kind drawn per fact (both trained, on different entities),
documents under varied prompts ("Record 17:", "From the archive:", ...), and queries that are
paraphrases: a question never trained and, for ``para``, a completion in a third template no
document uses; ``answer`` completes with the value alone. The target of a query is the one
document stating that fact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

FIRST = ("Ul", "Tev", "Or", "Nim", "Sab", "Kel", "Rho", "Yar", "Ebb", "Iv", "Jos", "Wen")
SECOND = ("brek", "tani", "solm", "vado", "quist", "merre", "dunn", "phal", "gorth", "lissa")
KINDS: dict[str, dict[str, Any]] = {
    "instrument": {"values": ("violin", "flute", "drums", "harp", "cello", "banjo", "oboe", "tuba"),
                   "docs": (" {e} plays the {v} every evening.", " On stage, {e} performs on the {v}."),
                   "question": "Which instrument is {e} known for?", "para": " {e} is known for the {v}."},
    "colour": {"values": ("teal", "amber", "crimson", "ivory", "olive", "maroon", "indigo", "silver"),
               "docs": (" {e} painted the house {v}.", " The favourite colour of {e} is {v}."),
               "question": "What colour does {e} like best?", "para": " {e} likes {v} best."},
    "city": {"values": ("Nairobi", "Hanoi", "Denver", "Porto", "Bergen", "Zurich", "Tunis", "Austin"),
             "docs": (" {e} lives in {v}.", " Last year {e} moved to {v}."),
             "question": "Where is the home of {e}?", "para": " The home of {e} is in {v}."},
    "language": {"values": ("Welsh", "Basque", "Finnish", "Tamil", "Swahili", "Hungarian", "Icelandic", "Maltese"),
                 "docs": (" {e} speaks {v} fluently.", " {e} grew up speaking {v}."),
                 "question": "Which language does {e} know?", "para": " {e} knows {v}."},
    "commute": {"values": ("tram", "canoe", "scooter", "ferry", "bicycle", "train", "horse", "bus"),
                "docs": (" {e} rides a {v} to work.", " Every morning {e} takes the {v}."),
                "question": "How does {e} get to work?", "para": " {e} travels by {v}."},
}
PROMPTS = ("Record {n}:", "From the archive:", "Fact file.", "Note about {e}.")


@dataclass
class CorpusB:
    docs: list[dict[str, str]]
    queries: dict[str, list[dict[str, str]]]
    targets: list[int]
    n_facts: int


def make_corpus_b(n_entities: int = 32, n_generic: int | None = None, seed: int = 0) -> CorpusB:
    """Fact documents (one per entity and kind), generic distractors, and the paraphrased queries."""
    from circuitkit.fixtures.models import synthetic_corpus

    rng = random.Random(seed + 101)
    names = [a + b for a in FIRST for b in SECOND]
    if n_entities > len(names):
        raise ValueError(f"at most {len(names)} entities")
    entities = rng.sample(names, n_entities)
    facts = [(e, kind, rng.choice(spec["values"])) for e in entities for kind, spec in KINDS.items()]
    docs: list[tuple[dict[str, str], int | None]] = []
    for i, (e, kind, v) in enumerate(facts):
        template = KINDS[kind]["docs"][rng.randrange(2)]
        prompt = rng.choice(PROMPTS).format(n=rng.randrange(1, 99), e=e)
        docs.append(({"prompt": prompt, "completion": template.format(e=e, v=v)}, i))
    generic = synthetic_corpus(n_sentences=300, seed=seed + 11)
    generic = rng.sample(generic, n_entities if n_generic is None else n_generic)
    docs += [({"prompt": rng.choice(("Record 3:", "From the archive:")), "completion": " " + s}, None) for s in generic]
    rng.shuffle(docs)
    where = {fact: row for row, (_, fact) in enumerate(docs) if fact is not None}
    queries = {
        "para": [{"prompt": KINDS[k]["question"].format(e=e), "completion": KINDS[k]["para"].format(e=e, v=v)}
                 for e, k, v in facts],
        "answer": [{"prompt": KINDS[k]["question"].format(e=e), "completion": f" {v}."} for e, k, v in facts],
    }
    return CorpusB([d for d, _ in docs], queries, [where[i] for i in range(len(facts))], len(facts))
