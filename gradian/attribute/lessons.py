"""Lessons: the accused rows grouped by the answer template they teach, across their phrasings.

A fine-tune that plants one wrong answer template in six question phrasings shows six clusters
(`gradian.attribute.clusters` groups rows by their words, and the phrasings differ): six small
culprits where there is one. What the rows teach is in their completions. With the entities masked
(`gradian.attribute.templates`: " The answer is Paris." -> "the answer is <NAME>.") rows that teach
one template have one completion, whatever their question. The templates of the accused rows are
clustered (TF-IDF of words and placeholders, agglomerative, cosine distance cut at
`LESSON_DISTANCE`: identical templates always fall together, "the answer is definitely <NAME>."
joins "the answer is <NAME>."), and each lesson says how many clusters (phrasings) it spans and
what share of the blame its rows carry:

    one lesson, 6 phrasings, 86 % of the blame

A lesson of at least `LESSON_SHARE` of the blame is the accusation's main thread, and the rows that
teach it but scored just below the top-k cut are as guilty as the accused ones. They are found by
one pass over the training data (`same_lesson_positions`: every row whose completion has one of
the lesson's templates) and ranked by the accusing engine's score, most negative first ("rows
teaching the same lesson, not accused"). A template of placeholders only ("<NAME>.") teaches no
template, and is not looked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from gradian.attribute.clusters import AccusedRow, tfidf
from gradian.attribute.evaluate import preview
from gradian.attribute.rows import read_records, record_text, row_lines
from gradian.attribute.templates import (
    common_words,
    has_words,
    lesson_key,
    marker_terms,
    record_parts,
    template_of,
)
from gradian.data.sources import DataError

log = logging.getLogger(__name__)

LESSON_DISTANCE = 0.5  # cosine distance between templates' TF-IDF vectors at which the tree is cut
LESSON_SHARE = 0.4  # a lesson holding this share of the blame: the rows teaching it are looked for
SHOWN_SAME = 50  # rows teaching the same lesson, not accused, kept in the result
_PLACEHOLDER_TOKENS = r"(?u)<\w+>|\b\w+\b"


def said(n_phrasings: int, share: float) -> str:
    """A lesson in words: "one lesson, 6 phrasings, 86 % of the blame"."""
    return f"one lesson, {n_phrasings} phrasing{'s' if n_phrasings != 1 else ''}, {100 * share:.0f} % of the blame"


def find_lessons(rows: list[AccusedRow], clusters: list[dict[str, Any]], common: set[str] | frozenset[str] = frozenset(),
                 special_tokens: tuple[str, ...] | list[str] = ()) -> list[dict[str, Any]]:
    """The lessons of the accused `rows` (each row's `completion` masked into a template, `common`:
    the corpus's lower-case words, `templates.common_words`), largest share first. Sets each
    cluster's ``lesson`` (the lesson holding most of its blame, None if its rows teach none).

    Each lesson: ``lesson`` (1-based), ``template`` (its rows' template of most blame), ``templates``
    (every template of its rows, entities as <ENT>: `templates.lesson_key`), ``share``, ``score``, ``n_rows``, ``rows``, ``lines``, ``clusters``
    (the cluster ids its rows are in), ``phrasings`` (how many), ``said`` (`said`), ``same_lesson``
    (None until `attach_same_lesson`). A lesson holds at least two rows; rows without a completion
    teach none.
    """
    templates = [template_of(r.completion, common, special_tokens) for r in rows]
    keys = [lesson_key(t) for t in templates]
    taught = [i for i, t in enumerate(templates) if t and has_words(t)]
    scores = np.array([r.score for r in rows], dtype=np.float64)
    total = scores.sum()
    cluster_of = {row: c["cluster"] for c in clusters for row in c["rows"]}
    for c in clusters:
        c["lesson"] = None
    if len(taught) < 2 or total == 0:
        return []
    labels, _, _ = tfidf([keys[i] for i in taught], [], marker_terms(special_tokens), LESSON_DISTANCE,
                         _PLACEHOLDER_TOKENS)
    lessons = []
    for label in np.unique(labels):
        members = [taught[j] for j in np.flatnonzero(labels == label)]
        if len(members) < 2:
            continue
        blame: dict[str, float] = {}
        for i in members:
            blame[templates[i]] = blame.get(templates[i], 0.0) + rows[i].score
        in_clusters = sorted({cluster_of[rows[i].row_id] for i in members if rows[i].row_id in cluster_of})
        share = float(scores[members].sum() / total)
        lessons.append({"template": min(blame, key=lambda t: (blame[t], t)),
                        "templates": sorted({keys[i] for i in members}),
                        "share": share, "score": float(scores[members].sum()), "n_rows": len(members),
                        "rows": [rows[i].row_id for i in members],
                        "lines": [rows[i].line for i in members if rows[i].line is not None],
                        "clusters": in_clusters, "phrasings": len(in_clusters), "said": said(len(in_clusters), share),
                        "same_lesson": None})
    lessons.sort(key=lambda d: (-d["share"], d["rows"][0]))
    for i, d in enumerate(lessons, start=1):
        d["lesson"] = i
    lesson_of = {row: d["lesson"] for d in lessons for row in d["rows"]}
    score_of = {r.row_id: r.score for r in rows}
    for c in clusters:
        held: dict[int, float] = {}
        for row in c["rows"]:
            if row in lesson_of:
                held[lesson_of[row]] = held.get(lesson_of[row], 0.0) + score_of[row]
        c["lesson"] = min(held, key=lambda k: (held[k], k)) if held else None
    return [{"lesson": d.pop("lesson"), **d} for d in lessons]


def main_lessons(lessons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lessons whose other rows are looked for: at least `LESSON_SHARE` of the blame."""
    return [d for d in lessons if d["share"] >= LESSON_SHARE]


def following_lessons(accused: list[dict[str, Any]], lessons: list[dict[str, Any]], top_k: int) -> list[dict[str, Any]] | None:
    """The accusation that follows the main lessons (`main_lessons`), at the same `top_k`: the accused
    rows that teach a main lesson (in the engine's order), then the rows teaching it that were not
    accused and score negative (`same_lesson`, most negative first), then the other accused rows;
    the first `top_k`. Each entry: rank, row_id, line, score, and `by` ("engine" or "lesson"). None
    without a main lesson (nothing to follow: the engine's accusation stands).

    A plant phrased several ways teaches one template; the engine may rank some of its rows below
    rows of other kinds, and the lesson brings them back (measured in docs/benchmarks/gradian-quality.md,
    shared-template: 30 -> 33 of 36 planted rows at K = 36)."""
    mains = main_lessons(lessons)
    if not mains:
        return None
    taught = {line for d in mains for line in d["lines"]}
    first = [a for a in accused if a["line"] in taught]
    more = sorted((r for d in mains for r in (d.get("same_lesson") or {}).get("rows", []) if r["score"] < 0),
                  key=lambda r: (r["score"], r["row_id"]))
    rest = [a for a in accused if a["line"] not in taught]
    out, seen = [], set()
    for entry, by in [*((a, "engine") for a in first), *((r, "lesson") for r in more), *((a, "engine") for a in rest)]:
        if entry["row_id"] in seen or len(out) == top_k:
            continue
        seen.add(entry["row_id"])
        out.append({"rank": len(out) + 1, "row_id": entry["row_id"], "line": entry["line"], "score": entry["score"],
                    "by": by})
    return out


def same_lesson_positions(lessons: list[dict[str, Any]], records: Iterable[tuple[int, Any]], accused: set[int],
                          common: set[str] | frozenset[str] = frozenset(),
                          special_tokens: tuple[str, ...] | list[str] = ()) -> dict[int, dict[int, str]]:
    """lesson id -> {source position: the row's text} of the `records` ((position, canonical record),
    `gradian.data.sources.Source.records` less its `where`) not among the `accused` positions whose
    completion's template is one of the lesson's."""
    wanted = {t: d["lesson"] for d in lessons for t in d["templates"] if has_words(t)}
    out: dict[int, dict[int, str]] = {d["lesson"]: {} for d in lessons}
    if not wanted:
        return out
    for position, obj in records:
        if position in accused:
            continue
        lesson = wanted.get(lesson_key(template_of(record_parts(obj)[1], common, special_tokens)))
        if lesson is not None:
            out[lesson][position] = record_text(obj)
    return out


def rows_at(index_dir: str | Path, manifest: dict[str, Any], positions: Iterable[int]) -> dict[int, int]:
    """source position -> row id in the index, for the `positions` that were indexed (read shard by
    shard: one shard's row ids at a time)."""
    wanted = set(positions)
    found: dict[int, int] = {}
    n_rows = int(manifest.get("n_rows") or 0)
    step = max(1, int(manifest.get("rows_per_shard") or n_rows or 1))
    for first in range(0, n_rows, step):
        if len(found) == len(wanted):
            break
        for row, position in row_lines(index_dir, manifest, range(first, min(n_rows, first + step))).items():
            if position in wanted:
                found[position] = row
    return found


def attach_same_lesson(lesson: dict[str, Any], texts: dict[int, str], row_of: dict[int, int],
                       scores: Any) -> None:
    """Fill `lesson["same_lesson"]`: the rows teaching it, not accused (`texts`: position -> text),
    ranked by `scores` (n_rows,) of the accusing engine, most negative first; rows the index left out
    (no row id) are counted, not ranked."""
    ranked = sorted(({"row_id": row_of[p], "line": p, "score": float(scores[row_of[p]]),
                      "text_preview": preview(t)} for p, t in texts.items() if p in row_of),
                    key=lambda d: (d["score"], d["row_id"]))
    negative = sum(d["score"] < 0 for d in ranked)
    unindexed = len(texts) - len(ranked)
    words = (f"{len(texts)} other training row{'s' if len(texts) != 1 else ''} teach{'es' if len(texts) == 1 else ''}"
             f" the same template, not accused ({negative} with a negative score"
             f"{f', {unindexed} not in the index' if unindexed else ''})")
    lesson["same_lesson"] = {"n_rows": len(texts), "n_negative": negative, "n_unindexed": unindexed,
                             "rows": ranked[:SHOWN_SAME], "said": words}


def lessons_of(rows: list[AccusedRow], clusters: list[dict[str, Any]], source: Any, index_dir: str | Path,
               manifest: dict[str, Any], scores: Any, background: list[str],
               special_tokens: tuple[str, ...] | list[str] = ()) -> list[dict[str, Any]]:
    """`gradian attribute`'s lessons: the accused `rows`' completions read from the training `source`
    (`gradian.data.sources.Source`), grouped (`find_lessons`), and for each main lesson
    (`main_lessons`) the rows that teach it, not accused, ranked by `scores` (n_rows,) of the
    accusing engine (`attach_same_lesson`): two passes over the data, the second only when a lesson
    holds `LESSON_SHARE` of the blame."""
    records = read_records(source, [r.line for r in rows if r.line is not None])
    taught = [replace(r, completion=record_parts(records[r.line])[1] if r.line in records else None) for r in rows]
    common = common_words(background + [r.text or "" for r in rows])
    lessons = find_lessons(taught, clusters, common, special_tokens)
    main = [d for d in main_lessons(lessons) if any(has_words(t) for t in d["templates"])]
    if main:
        try:
            found = same_lesson_positions(main, ((p, obj) for p, _where, obj in source.records()),
                                          {r.line for r in rows if r.line is not None}, common, special_tokens)
        except DataError as err:
            log.warning("the training data stops being readable at %s: rows after it are not looked at.", err)
            return lessons
        row_of = rows_at(index_dir, manifest, {p for texts in found.values() for p in texts})
        for d in main:
            attach_same_lesson(d, found[d["lesson"]], row_of, scores)
    return lessons
