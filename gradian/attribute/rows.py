"""The accused rows as people read them: their source lines, texts, and `gradian diagnose`'s findings
on the training set they come from.

Row ids map to source positions through the shards' `sources` tensors (`IndexReader.source_positions`),
or, for an index written before shards carried them, the manifest's kept lines. Texts are read from
the index's training data only while it is unchanged (`gradian.rank.results.training_source` compares its
sha256 with the manifest's); otherwise the rows have no text, and no clusters or findings.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from gradian.data.sources import DataError, Source
from gradian.index.reader import IndexReader
from gradian.rank.results import training_source

log = logging.getLogger(__name__)


def row_lines(index_dir: str | Path, manifest: dict[str, Any], row_ids: Iterable[int]) -> dict[int, int]:
    """row id -> source position (1-based JSONL line, or 0-based table row) for the rows it can place."""
    wanted = sorted(set(row_ids))
    found = IndexReader(Path(index_dir)).source_positions(wanted)
    kept = (manifest.get("data_report") or {}).get("kept_lines")
    if isinstance(kept, list):
        found.update({r: kept[r] for r in wanted if r not in found and r < len(kept)})
    return found


def record_text(obj: Any) -> str:
    """A record's full text: prompt then completion, or a chat row's turns as `role: content` lines."""
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in obj["messages"] if isinstance(m, dict))
    if isinstance(obj, dict):
        return f"{obj.get('prompt', '')}{obj.get('completion', '')}"
    return ""


def read_records(source: Source, positions: Iterable[int]) -> dict[int, Any]:
    """The records at `positions` (source position -> the record as `Source.records` gives it), read in
    one pass up to the last one asked; a source that stops being readable leaves the rest out (logged)."""
    wanted = set(positions)
    out: dict[int, Any] = {}
    if not wanted:
        return out
    last = max(wanted)
    try:
        for position, _where, obj in source.records():
            if position in wanted:
                out[position] = obj
            if position >= last:
                break
    except DataError as err:
        log.warning("the training data stops being readable at %s: later rows have no text.", err)
    return out


BACKGROUND_ROWS = 10_000  # training rows sampled for the clusters' document frequencies


def read_texts(source: Source, positions: Iterable[int], sample: int = 0,
               seed: int = 0) -> tuple[dict[int, str], list[str]]:
    """(full texts of the records at `positions` (`record_text`), a uniform sample of up to `sample`
    texts of every record) in one pass: up to the last position asked when `sample` is 0, else to
    the end (reservoir sampling, seeded). The sample is the corpus whose document frequencies weigh
    the clusters' terms (`gradian.attribute.clusters`); nothing is sampled when no position is asked.
    A source that stops being readable gives what was read (logged)."""
    wanted = set(positions)
    texts: dict[int, str] = {}
    if not wanted:
        return texts, []
    last, rng, background = max(wanted), random.Random(seed), []
    try:
        for seen, (position, _where, obj) in enumerate(source.records(), start=1):
            if position in wanted:
                texts[position] = record_text(obj)
            if len(background) < sample:
                background.append(texts.get(position) or record_text(obj))
            elif sample and (j := rng.randrange(seen)) < sample:
                background[j] = texts.get(position) or record_text(obj)
            if position >= last and not sample:
                break
    except DataError as err:
        log.warning("the training data stops being readable at %s: the rows after it have no text.", err)
    return texts, background


def training_findings(manifest: dict[str, Any], tokenizer) -> tuple[list[Any], str | None]:
    """`gradian diagnose`'s findings on the index's training data (tokenizer checks included, the
    index's max_seq_length as the limit), and a note when they could not be made (None if they were).

    Only a plain file read with the default columns and no row range is diagnosed: diagnose reads
    whole files by their default keys, so any other source would be checked as something else."""
    source = training_source(manifest)
    if source is None:
        return [], "the training data is not where the index says, or changed since: no row text, no findings."
    described = manifest.get("data_source") or {}
    cols = described.get("columns") or {}
    default_cols = all(cols.get(k, k) == k for k in ("prompt", "completion", "messages"))
    if described.get("row_range") or not default_cols or not Path(source.name).is_file():
        return [], (f"the training data {source.name} is read with a row range, renamed columns or from a"
                    " dataset directory: `gradian diagnose` findings are not joined to the clusters.")
    from gradian.diagnose import diagnose

    try:
        result = diagnose(str(source.name), tokenizer=tokenizer, max_seq_length=manifest.get("max_seq_length"))
    except (UserError, DataError, OSError) as err:
        return [], f"`gradian diagnose` could not check {source.name} ({err}): no findings joined."
    return result.findings, None
