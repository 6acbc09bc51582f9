"""One indexed row's tokens and its supervised mask, rebuilt from the data the index names.

`gradian inspect INDEX --row N` shows exactly which tokens of training row N the index's loss
predicted: the row is re-read from the index's data source and tokenized with the manifest's
settings (max_seq_length, truncation, token policy), the same code path as indexing, so what is
shown is what was indexed. The tokenizer is the model's (checked against the manifest's
tokenizer hash) and the data must be unchanged (its sha256).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from circuitkit.core.errors import UserError
from gradian.data.rows import Row, iter_rows, new_report, policy_of
from gradian.index.reader import IndexReader


def load_index_tokenizer(manifest: dict[str, Any]) -> Any:
    """The tokenizer of the model an index names, refused (UserError) if its hash differs."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_tokenizer
    from gradian.build.checks import tokenizer_hash

    name = manifest.get("model")
    if not isinstance(name, str):
        raise UserError(f"the index manifest names no model (model: {name!r}); its rows cannot be re-tokenized.",
                        exit_code=2)
    tokenizer = load_tokenizer(ModelConfig(name=name, revision=manifest.get("revision"),
                                           gguf_file=manifest.get("gguf_file")))
    if tokenizer_hash(tokenizer) != manifest.get("tokenizer_sha256"):
        raise UserError(f"the tokenizer of {name} is not the one the index was built with (tokenizer_sha256"
                        " differs); the indexed tokens cannot be shown.", exit_code=2)
    return tokenizer


def indexed_row(index_dir: str | Path, row_id: int, tokenizer: Any | None = None) -> Row:
    """Training row `row_id` of the index, tokenized as it was indexed.

    Returns a `gradian.data.rows.Row` (``input_ids`` and ``supervised``, both length T). Raises
    UserError (exit code 2) for a row id out of range or data that is gone or changed.
    """
    return indexed_rows(index_dir, [row_id], tokenizer)[row_id]


def indexed_rows(index_dir: str | Path, row_ids: Iterable[int], tokenizer: Any | None = None) -> dict[int, Row]:
    """Training rows `row_ids` of the index, tokenized as they were indexed, in one pass over the data.

    Returns {row id: `gradian.data.rows.Row`}. Raises UserError (exit code 2) for a row id out of
    range or data that is gone or changed.
    """
    from gradian.rank.results import training_source

    manifest = IndexReader(index_dir).manifest
    n_rows, wanted = manifest["n_rows"], set(row_ids)
    for row_id in sorted(wanted):
        if not 0 <= row_id < n_rows:
            raise UserError(f"--row {row_id}: the index has rows 0..{n_rows - 1}.", exit_code=2)
    source = training_source(manifest)
    if source is None:
        raise UserError(f"the training data {manifest.get('data_file')} is missing or changed since indexing"
                        " (see the warning above), so row tokens cannot be rebuilt.", exit_code=2)
    tokenizer = tokenizer if tokenizer is not None else load_index_tokenizer(manifest)
    report = new_report(source, manifest.get("max_seq_length", 512), manifest.get("on_truncation", "warn"),
                        manifest.get("truncation_side", "right"), policy=policy_of(manifest))
    found: dict[int, Row] = {}
    for row in iter_rows(source, tokenizer, report):
        if row.row_id in wanted:
            found[row.row_id] = row
            if len(found) == len(wanted):
                return found
    raise UserError(f"the data now yields {report.kept} rows, fewer than row {max(wanted - set(found))};"
                    " rebuild the index.", exit_code=2)


def row_table(row: Row, tokenizer: Any, title: str) -> Table:
    """A rich table of a row: position, token id, token text (repr), supervised or not."""
    table = Table(title=Text(title))
    for column, justify in (("pos", "right"), ("id", "right"), ("token", "left"), ("supervised", "center")):
        table.add_column(column, justify=justify)
    for t, (token_id, sup) in enumerate(zip(row.input_ids, row.supervised, strict=True)):
        table.add_row(str(t), str(token_id), Text(repr(tokenizer.decode([token_id]))), "yes" if sup else "")
    return table
