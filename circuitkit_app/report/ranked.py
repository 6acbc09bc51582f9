"""Ranked training rows (`gradian rank --out RANK.jsonl`) as the report shows them.

Per query: its text as tokens with the supervised ones marked, and its top training rows with
their scores, source line and tokens (supervised ones marked), rebuilt from the index's data with
the index's tokenizer and token policy (`gradian.rank.tokens.indexed_rows`: what was indexed is what is
shown). The rank file is checked line by line as it is read, and against the index: each row's
recorded source line and preview must be the index's (`check_same_index`); the index's manifest
through `IndexReader`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError

MAX_TOKENS = 160  # tokens shown per row (the rest is counted)
MAX_QUERIES = 50  # queries shown (the aggregate list is always shown)
_FIELDS = {"query": (str, int), "rank": (int,), "row_id": (int,), "score": (int, float)}


class RankFileError(UserError, ValueError):
    """A rank results file that is not one (exit 1: the file's content is bad)."""

    exit_code = 1


def read_rank_file(path: Path) -> list[dict[str, Any]]:
    """The rows of a `gradian rank --out` JSONL file, each checked; RankFileError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such rank results file (write one with `gradian rank ... --out {path}`).",
                        exit_code=2)
    rows = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
                raise RankFileError(f"{path} line {number} is not JSON ({err}); is it a `gradian rank --out`"
                                    " file?") from None
            bad = [k for k, kinds in _FIELDS.items() if not isinstance(row, dict) or not isinstance(row.get(k), kinds)
                   or isinstance(row.get(k), bool)]
            if bad:
                raise RankFileError(f"{path} line {number} lacks {', '.join(bad)} (or has the wrong type); a"
                                    " `gradian rank --out` row has query, rank, row_id, score.")
            try:
                row["score"] = float(row["score"])
            except OverflowError:
                raise RankFileError(f"{path} line {number}: score {str(row['score'])[:24]}... ({len(str(row['score']))}"
                                    " digits) does not fit a float; a `gradian rank --out` score is a float. Rank"
                                    " again, or fix that line.") from None
            rows.append(row)
    if not rows:
        raise RankFileError(f"{path} holds no ranked rows.")
    return rows


def _tokens(tokenizer: Any, input_ids: list[int], supervised: list[bool]) -> dict[str, Any]:
    shown = [[tokenizer.decode([t]), bool(s)] for t, s in zip(input_ids[:MAX_TOKENS], supervised[:MAX_TOKENS],
                                                              strict=True)]
    return {"tokens": shown, "more": max(0, len(input_ids) - MAX_TOKENS), "n_supervised": int(sum(supervised))}


def check_same_index(rank_path: Path, index_dir: Path, results: list[dict[str, Any]], training: dict[int, Any]) -> None:
    """The rank file was made against this index: each row's recorded source line and preview (what
    `gradian rank --out` writes beside a row id) are those of the index's row with that id.
    RankFileError (exit 1) naming both files otherwise: the page never shows another index's rows."""
    for r in results:
        row = training[r["row_id"]]
        line, preview = r.get("source_line"), r.get("text_preview")
        if (line is not None and line != row.line) or (preview is not None and preview != row.preview):
            raise RankFileError(
                f"{rank_path} was not ranked against {index_dir}: it gives row {r['row_id']} as source line {line}"
                f" ({str(preview)[:40]!r}), the index's row {r['row_id']} is line {row.line} ({row.preview[:40]!r})."
                f" Give the index the ranking was made with (--index), or rank again against {index_dir}.")


def collect_rank(rank_path: Path, index_dir: Path, queries_path: Path | None = None) -> dict[str, Any]:
    """{"rank_file", "index_dir", "queries": [{"query", "text", "rows": [...]}, ...]} for the report.

    Without `queries_path` the queries are shown by id only.
    """
    from gradian.build.checks import check_input_file
    from gradian.data.rows import load_rows, policy_of
    from gradian.index.reader import IndexReader
    from gradian.rank.tokens import indexed_rows, load_index_tokenizer

    if queries_path is not None:
        check_input_file(Path(queries_path), "--queries")
    results = read_rank_file(rank_path)
    manifest = IndexReader(index_dir).manifest
    n_rows = manifest.get("n_rows", 0)
    out_of_range = sorted({r["row_id"] for r in results if not 0 <= r["row_id"] < n_rows})
    if out_of_range:
        raise UserError(f"{rank_path} ranks rows {out_of_range[:5]} that {index_dir} does not hold (rows 0..{n_rows - 1}):"
                        " give the index the ranking was made with (--index).", exit_code=2)
    tokenizer = load_index_tokenizer(manifest)
    queries: dict[Any, dict[str, Any]] = {}
    if queries_path is not None:
        rows, _ = load_rows(Path(queries_path), tokenizer, manifest.get("max_seq_length", 512),
                            manifest.get("on_truncation", "warn"), manifest.get("truncation_side", "right"),
                            policy=policy_of(manifest))
        queries = {r.row_id: _tokens(tokenizer, r.input_ids, r.supervised) for r in rows}
    order: list[Any] = []
    by_query: dict[Any, list[dict[str, Any]]] = {}
    for r in results:
        if r["query"] not in by_query:
            order.append(r["query"])
            by_query[r["query"]] = []
        by_query[r["query"]].append(r)
    shown = [q for q in order if q != "aggregate"][:MAX_QUERIES] + (["aggregate"] if "aggregate" in by_query else [])
    needed = {r["row_id"] for q in shown for r in by_query[q]}
    training = indexed_rows(index_dir, needed, tokenizer)
    check_same_index(rank_path, index_dir, [r for q in shown for r in by_query[q]], training)
    view = []
    for q in shown:
        view.append({"query": q, "text": queries.get(q), "rows": [
            {"rank": r["rank"], "row_id": r["row_id"], "score": r["score"] if math.isfinite(r["score"]) else None,
             "source_line": r.get("source_line"),
             **_tokens(tokenizer, training[r["row_id"]].input_ids, training[r["row_id"]].supervised)}
            for r in sorted(by_query[q], key=lambda r: r["rank"])]})
    return {"rank_file": str(rank_path), "index_dir": str(index_dir),
            "queries_file": str(queries_path) if queries_path else None, "queries": view,
            "n_queries": len([q for q in order if q != "aggregate"])}
