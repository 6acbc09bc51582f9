"""Where Gradian's rows come from: JSONL, Parquet, Arrow / `datasets.save_to_disk`, or a hub dataset.

Every source yields records ``(position, where, obj)`` in a fixed order, one at a time, so a
file of millions of rows is never held in memory:

* ``position``: the JSONL line number (1-based), or the row index in the table (0-based);
* ``where``: how an error names the record (``train.jsonl:12``, ``train.parquet row 11``);
* ``obj``: ``{"prompt": str, "completion": str}`` or ``{"messages": [...]}``, read from the
  columns named by ``prompt_column`` / ``completion_column`` / ``messages_column``.

Formats (``grads.data_format``; ``auto`` picks by what the path is):

* ``jsonl``: one JSON object per line (``.jsonl``, ``.json``), the format of earlier versions;
* ``parquet``: a ``.parquet`` file, read a record batch at a time with pyarrow;
* ``arrow``: a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``,
  whose ``split`` is taken), or a single ``.arrow`` file, memory-mapped;
* ``hf``: a Hugging Face dataset name, loaded with ``datasets.load_dataset(name, split=split)``
  (``auto`` treats a path that does not exist and looks like ``owner/name`` as one).

Parquet, Arrow and hub datasets need the optional dependency ``datasets`` (which brings
pyarrow): ``pip install 'circuitkit-gradian[data]'``. ``row_range`` ``[start, end)`` keeps records
``start..end-1`` counted in source order (non-blank lines for JSONL).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circuitkit.core.config import choices
from circuitkit.core.io import jsonl_objects, sha256_file
from gradian.settings.grads import GradsConfig

FORMATS = choices(GradsConfig, "data_format")
_TABLE_CHUNK_ROWS = 1024
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
EXPECTED = ('an object {"prompt": str, "completion": str} or {"messages": [{"role": "system"|"user"|'
            '"assistant", "content": str}, ...]}')


class DataError(ValueError):
    """Data that cannot be read or used as configured; names the record (`file:line`) and the fix."""


@dataclass(frozen=True)
class SourceSpec:
    """How to read the rows: the path or name, its format, split, columns and row range."""

    path: str
    format: str = "auto"
    split: str | None = "train"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    row_range: tuple[int, int] | None = None

    @classmethod
    def from_grads(cls, grads: Any, path: str | Path) -> SourceSpec:
        """The spec that the `grads.*` keys describe, for the file or name `path`."""
        rng = getattr(grads, "data_row_range", None)
        return cls(path=str(path), format=getattr(grads, "data_format", "auto"),
                   split=getattr(grads, "data_split", "train"),
                   prompt_column=getattr(grads, "prompt_column", "prompt"),
                   completion_column=getattr(grads, "completion_column", "completion"),
                   messages_column=getattr(grads, "messages_column", "messages"),
                   row_range=None if rng is None else (int(rng[0]), int(rng[1])))

    def describe(self) -> dict[str, Any]:
        """JSON-ready: what the index manifest records about the source."""
        return {"path": self.path, "format": resolve_format(self), "split": self.split,
                "columns": {"prompt": self.prompt_column, "completion": self.completion_column,
                            "messages": self.messages_column},
                "row_range": list(self.row_range) if self.row_range else None}


def _need_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {what} needs the optional package 'datasets' (with pyarrow): install it with"
                          " pip install 'circuitkit-gradian[data]', or convert the data to JSONL.") from None
    return datasets


def resolve_format(spec: SourceSpec) -> str:
    """The concrete format of `spec` (``auto`` resolved); raises DataError for a missing path."""
    if spec.format not in FORMATS:
        raise DataError(f"grads.data_format={spec.format!r}; use one of {', '.join(FORMATS)}.")
    if spec.format != "auto":
        return spec.format
    path = Path(spec.path)
    if path.is_dir():
        return "arrow"
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix == ".parquet":
            return "parquet"
        if suffix == ".arrow":
            return "arrow"
        return "jsonl"
    if suffix in (".jsonl", ".json", ".parquet", ".arrow") or spec.path.startswith((".", "/", "~")):
        raise DataError(f"grads.data_path={spec.path!r} does not exist (resolved to {path.resolve()}).")
    if _HUB_NAME.match(spec.path):
        return "hf"
    raise DataError(f"grads.data_path={spec.path!r} is neither an existing file or directory nor a dataset"
                      " name of the form owner/name.")


def _canonical(record: dict[str, Any], spec: SourceSpec, where: str) -> Any:
    """The record as {"prompt", "completion"} or {"messages"} under the canonical names."""
    if not isinstance(record, dict):
        return record  # data.check_row names the problem
    msgs = record.get(spec.messages_column)
    if msgs is not None:
        return {"messages": msgs}
    if spec.prompt_column in record or spec.completion_column in record:
        out = {}
        if spec.prompt_column in record:
            out["prompt"] = record[spec.prompt_column]
        if spec.completion_column in record:
            out["completion"] = record[spec.completion_column]
        return out
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise DataError(f"{where}: no column {spec.prompt_column!r}/{spec.completion_column!r} or"
                      f" {spec.messages_column!r} (columns: {keys}); set grads.prompt_column,"
                      " grads.completion_column or grads.messages_column to your column names.")


class Source:
    """A readable data source (see the module docstring)."""

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        self.format = resolve_format(spec)
        path = Path(spec.path)
        if self.format in ("jsonl", "parquet") and not path.is_file():
            raise DataError(f"grads.data_path={spec.path!r} is {'a directory' if path.is_dir() else 'missing'};"
                              f" a {self.format} source is a file.")
        if spec.row_range is not None:
            start, end = spec.row_range
            if not 0 <= start < end:
                raise DataError(f"grads.data_row_range=[{start}, {end}] must satisfy 0 <= start < end.")

    @property
    def name(self) -> str:
        return self.spec.path

    # -- reading ------------------------------------------------------------------------------
    def records(self) -> Iterator[tuple[int, str, Any]]:
        """(position, where, canonical obj) for every record in the row range, in source order."""
        start, end = self.spec.row_range or (0, None)
        raw = self._jsonl() if self.format == "jsonl" else self._table()
        seen = 0
        for n, (position, where, record) in enumerate(raw):
            seen = n + 1
            if n < start:
                continue
            if end is not None and n >= end:
                break
            yield position, where, _canonical(record, self.spec, where)
        if self.spec.row_range is not None and seen <= start:
            raise DataError(f"grads.data_row_range=[{start}, {end}] starts past the end of {self.name}, which has"
                            f" {seen} record(s): set grads.data_row_range within [0, {seen}] (or null for all).")

    def _jsonl(self) -> Iterator[tuple[int, str, Any]]:
        # jsonl_objects names a line that is not valid JSON or not UTF-8 as file:line.
        yield from jsonl_objects(Path(self.spec.path), EXPECTED, DataError)

    def _columns(self, names: list[str]) -> list[str]:
        wanted = [c for c in (self.spec.prompt_column, self.spec.completion_column, self.spec.messages_column)
                  if c in names]
        if not wanted:
            raise DataError(f"{self.name}: no column {self.spec.prompt_column!r}/{self.spec.completion_column!r}"
                              f" or {self.spec.messages_column!r} (columns: {', '.join(names)}); set"
                              " grads.prompt_column, grads.completion_column or grads.messages_column.")
        return wanted

    def _table(self) -> Iterator[tuple[int, str, Any]]:
        if self.format == "parquet":
            _need_datasets("Parquet files")
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(self.spec.path)
            columns = self._columns(pf.schema_arrow.names)
            chunks = (b.to_pylist() for b in pf.iter_batches(batch_size=_TABLE_CHUNK_ROWS, columns=columns))
        else:
            ds = self.dataset()
            columns = self._columns(list(ds.column_names))
            ds = ds.select_columns(columns)
            chunks = ([dict(zip(batch, vals, strict=True)) for vals in zip(*batch.values(), strict=True)]
                      for batch in ds.iter(batch_size=_TABLE_CHUNK_ROWS))
        index = 0
        for chunk in chunks:
            for record in chunk:
                yield index, f"{self.name} row {index}", record
                index += 1

    def dataset(self):
        """The `datasets.Dataset` behind an arrow or hub source (memory-mapped, not loaded)."""
        datasets = _need_datasets("Arrow data and hub datasets")
        path = Path(self.spec.path)
        if self.format == "hf":
            from circuitkit.core.hub import check_hub_name

            if not path.exists():  # a hub name (a local folder is read by load_dataset itself)
                check_hub_name(self.spec.path, None, "grads.data_path", kind="dataset")  # offline: at once
            try:
                return datasets.load_dataset(self.spec.path, split=self.spec.split)
            except Exception as err:  # the hub client raises many types; name the source
                raise DataError(f"could not load dataset {self.spec.path!r} (split {self.spec.split!r}):"
                                  f" {type(err).__name__}: {err}. Offline, save it with"
                                  " Dataset.save_to_disk and give that directory.") from None
        if path.is_file():
            return datasets.Dataset.from_file(str(path))
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if self.spec.split not in loaded:
                raise DataError(f"{path} holds splits {', '.join(loaded)}; set grads.data_split to one of them"
                                  f" (it is {self.spec.split!r}).")
            return loaded[self.spec.split]
        return loaded

    # -- identity -----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 that changes when the data changes: of the file's bytes, of every file of a
        directory, or of a hub dataset's cache fingerprint."""
        path = Path(self.spec.path)
        if path.is_file():
            digest = sha256_file(path)
        elif path.is_dir():
            h = hashlib.sha256()
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                h.update(f"{f.relative_to(path)}:{sha256_file(f)}\n".encode())
            digest = h.hexdigest()
        else:
            ds = self.dataset()
            digest = hashlib.sha256(f"{self.spec.path}:{self.spec.split}:{ds._fingerprint}".encode()).hexdigest()
        if self.spec.row_range is None and self.spec == SourceSpec(self.spec.path, self.spec.format):
            return digest
        # Columns and ranges decide which rows are read: they are part of the data's identity.
        extra = json.dumps(self.spec.describe(), sort_keys=True)
        return hashlib.sha256(f"{digest}:{extra}".encode()).hexdigest()
