"""The results of a ranking: each accused row's line in the training source and a preview of its text."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradian.data.rows import preview_text
from gradian.data.sources import DataError, Source, SourceSpec
from gradian.index.reader import IndexReader

log = logging.getLogger(__name__)


def _positions(index_dir: Path, manifest: dict[str, Any], row_ids: set[int]) -> dict[int, int]:
    """row id -> its position in the training data (JSONL line, or table row index).

    From the shards' `sources` tensors; for indexes written before shards carried them, from
    the manifest's data_report.kept_lines, or rebuilt from the JSONL file (the kept rows are the
    non-blank lines minus the dropped ones, in file order).
    """
    found = IndexReader(index_dir).source_positions(sorted(row_ids))
    missing = row_ids - set(found)
    if not missing:
        return found
    report = manifest.get("data_report") or {}
    kept = report.get("kept_lines")
    if kept is None:
        source = training_source(manifest)
        if source is None or source.format != "jsonl":
            return found
        dropped = set(report.get("dropped_truncated_lines", [])) | set(report.get("dropped_unsupervised_lines", []))
        with open(source.name, encoding="utf-8-sig") as fh:
            kept = [n for n, line in enumerate(fh, start=1) if line.strip() and n not in dropped]
    found.update({r: kept[r] for r in missing if r < len(kept)})
    return found


def training_source(manifest: dict[str, Any]) -> Source | None:
    """The training data if it is still where the index says and unchanged (else no previews)."""
    described = manifest.get("data_source")
    try:
        if described:
            cols = described.get("columns") or {}
            rng = described.get("row_range")
            # data_file says where the data is now (a test or a user may point it elsewhere).
            spec = SourceSpec(path=manifest.get("data_file") or described["path"], format=described.get("format", "auto"),
                              split=described.get("split"), prompt_column=cols.get("prompt", "prompt"),
                              completion_column=cols.get("completion", "completion"),
                              messages_column=cols.get("messages", "messages"),
                              row_range=tuple(rng) if rng else None)
        elif manifest.get("data_file"):
            spec = SourceSpec(path=manifest["data_file"])
        else:
            return None
        source = Source(spec)
        if manifest.get("data_sha256") and source.fingerprint() != manifest["data_sha256"]:
            log.warning("training data %s changed since the index was built: previews are left empty.", spec.path)
            return None
        return source
    except (DataError, OSError) as err:
        log.warning("training data %s cannot be read any more (%s): previews are left empty.",
                    manifest.get("data_file"), err)
        return None


def _read_previews(source: Source, positions: Iterable[int]) -> dict[int, str]:
    """Preview text of the records at the given positions; reads the source once, in order, up
    to the last position asked."""
    wanted = set(positions)
    out: dict[int, str] = {}
    if not wanted:
        return out
    last = max(wanted)
    try:
        for position, _where, obj in source.records():
            if position in wanted and isinstance(obj, dict):
                if isinstance(obj.get("messages"), list):
                    text = " / ".join(f"{m.get('role')}: {m.get('content')}" for m in obj["messages"]
                                      if isinstance(m, dict))
                else:
                    text = f"{obj.get('prompt', '')}{obj.get('completion', '')}"
                out[position] = preview_text(text)
            if position >= last:
                break
    except DataError as err:  # a record that does not parse any more: previews stop there
        log.warning("previews stop at %s", err)
    return out


def format_results(manifest: dict[str, Any], top: dict[str, torch.Tensor], query_ids: Sequence[Any],
                   index_dir: str | Path) -> list[dict[str, Any]]:
    """Result rows: per query then the aggregate, ranks 1..k, with source line and preview."""
    lists: list[tuple[Any, torch.Tensor, torch.Tensor]] = [
        (qid, top["query_rows"][i], top["query_scores"][i]) for i, qid in enumerate(query_ids)]
    lists.append(("aggregate", top["aggregate_rows"], top["aggregate_scores"]))
    positions = _positions(Path(index_dir), manifest, {int(r) for _, rows, _ in lists for r in rows})

    def line_of(row: int) -> int | None:
        return positions.get(row)

    source = training_source(manifest)
    previews = _read_previews(source, set(positions.values())) if source is not None else {}
    out = []
    for qid, rows, scores in lists:
        for position, (row, value) in enumerate(zip(rows.tolist(), scores.tolist(), strict=True), start=1):
            line = line_of(row)
            out.append({"query": qid, "rank": position, "row_id": row, "score": value, "source_line": line,
                        "text_preview": previews.get(line) if line is not None else None})
    return out


