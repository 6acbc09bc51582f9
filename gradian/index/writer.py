"""Writing an index: one shard at a time, each file written atomically with its sha256, the manifest
updated under a lock; resume skips the shards already listed, a second writer of one shard is refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.io import atomic_write_json, file_lock, save_safetensors_streamed, sha256_file
from circuitkit.core.recorded import (
    MANIFEST,
    confined_path,
)
from gradian.index.formats import format_of
from gradian.index.header import NOT_COMPARED
from gradian.index.manifest import (
    FORMAT_VERSION,
    ConcurrentWriterError,
    IndexMismatchError,
    read_manifest,
    shard_name,
)


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per differing key; long values (a projection's module list) cut to their start."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: index has {_short(old.get(k))}, asked {_short(new.get(k))}" for k in keys if old.get(k) != new.get(k)]


@dataclass
class IndexWriter:
    """Writes one worker's shards of an index; resumes what a killed run left.

    header: everything that decides the stored values (model and weights hash, tokenizer
    hash, modules and shapes, projection kind/dim/seed, storage dtype, loss reduction, data
    hash, row count, rows per shard). An existing index with another header is an error that
    names the differing keys.
    """

    index_dir: Path
    header: dict[str, Any]
    n_rows: int
    rows_per_shard: int
    num_shards: int = 1
    shard_index: int = 0

    def __post_init__(self) -> None:
        self.index_dir = Path(self.index_dir)
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index={self.shard_index} must be in [0, num_shards={self.num_shards}).")
        self.header = {**self.header, "n_rows": self.n_rows, "rows_per_shard": self.rows_per_shard,
                       "format_version": FORMAT_VERSION}
        self.index_dir.mkdir(parents=True, exist_ok=True)
        compared = {k: v for k, v in self.header.items() if k not in NOT_COMPARED}
        with self._manifest_lock():
            # Manifest writes happen under this lock, so a temp manifest seen now is a killed
            # run's leftover.
            for stale in self.index_dir.glob(f".{MANIFEST}.*.tmp"):
                stale.unlink(missing_ok=True)
            manifest = self._read()
            if manifest is None:
                self._write({**self.header, "shards": {}, "complete": False})
            elif {k: manifest.get(k) for k in compared} != compared:
                diffs = _diff({k: manifest.get(k) for k in compared}, compared)
                raise IndexMismatchError(
                    f"{self.index_dir} holds an index made differently: {'; '.join(diffs)}. Use another"
                    " grads.index_dir, or delete this one to rebuild it.")

    # -- manifest ---------------------------------------------------------------------------
    @property
    def n_index_shards(self) -> int:
        return max(1, math.ceil(self.n_rows / self.rows_per_shard))

    def _manifest_lock(self):
        return file_lock(self.index_dir / ".manifest.lock")

    def _read(self) -> dict[str, Any] | None:
        # The same checks as a reader: a resumed run must not follow a shard entry out of the index.
        return read_manifest(self.index_dir) if (self.index_dir / MANIFEST).is_file() else None

    def _write(self, manifest: dict[str, Any]) -> None:
        manifest["shards"] = dict(sorted(manifest["shards"].items()))
        atomic_write_json(self.index_dir / MANIFEST, manifest)

    def row_range(self, k: int) -> tuple[int, int]:
        """Rows [start, end) of shard k."""
        start = k * self.rows_per_shard
        return start, min(self.n_rows, start + self.rows_per_shard)

    def my_shards(self) -> list[int]:
        return [k for k in range(self.n_index_shards) if k % self.num_shards == self.shard_index]

    def is_done(self, k: int) -> bool:
        """Shard k is complete: listed in the manifest and its file has the recorded sha256."""
        entry = (self._read() or {}).get("shards", {}).get(shard_name(k))
        path = confined_path(self.index_dir, shard_name(k))
        return entry is not None and path.is_file() and sha256_file(path) == entry["sha256"]

    def pending(self) -> list[int]:
        """This worker's shards still to write (a resumed run skips the complete ones).

        Temporary files a killed run left for these shards are removed, under the shard's lock:
        a temp file whose shard is locked belongs to a live writer (two workers given the same
        grads.shard_index), which is refused instead of pulling its file away.
        """
        todo = [k for k in self.my_shards() if not self.is_done(k)]
        for k in todo:
            with file_lock(self.index_dir / f".{shard_name(k)}.lock", blocking=False) as got:
                if not got:
                    raise self._busy(k)
                for stale in self.index_dir.glob(f".{shard_name(k)}.*.tmp"):
                    stale.unlink(missing_ok=True)
        return todo

    def _busy(self, k: int) -> ConcurrentWriterError:
        return ConcurrentWriterError(
            f"another process is writing {shard_name(k)} of {self.index_dir}; two workers must not share a"
            f" grads.shard_index (this one has {self.shard_index} of num_shards={self.num_shards}). Wait for"
            " it to finish, or give each worker its own shard_index.")

    # -- writing ----------------------------------------------------------------------------
    def write_shard(self, k: int, grads: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor | None = None,
                    second_moment_blocks: int | None = None,
                    extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Store shard k: grads (n, width) float32 in the storage dtype, with float32 norms, and
        `sources` (n,) int64, where each row is in the data (JSONL line or table row index).
        `second_moment_blocks` M: also store the stored rows' per-block Σ g gᵀ, (M, k, k) float32
        (`gradian.curvature.moments.shard_second_moment`). `extra_tensors`: the K-FAC factor sums
        (`gradian.curvature.factors.FactorSums.tensors`), stored as given.

        The rows are packed by the header's row format (`gradian.index.formats`); norms are of the stored
        values, so cosine scores read back exactly what was stored. Raises StorageOverflowError naming the
        rows if float16 would turn values into inf (or sign rows have values with no sign).
        """
        start, end = self.row_range(k)
        if rows.tolist() != list(range(start, end)):
            raise ValueError(f"shard {k} must hold rows {start}..{end - 1}, got {rows.tolist()[:5]}...")
        fmt = format_of(self.header)
        if second_moment_blocks is not None and not fmt.moments:
            raise ValueError(f"{fmt.name} rows (grads.row_format={fmt.name}) hold no dense blocks to sum second"
                             " moments of.")
        stored, norms, finite = fmt.pack(grads)  # norms of what the row stands for
        problem = fmt.stored_problem(stored)
        if problem:
            raise ValueError(f"shard {k}: {problem}")
        bad = ~finite[:, 0]
        if bad.any():
            raise fmt.non_finite_error(rows[bad].tolist(), k, bool(finite[bad, 1].all()))
        second_moment = None
        if second_moment_blocks is not None:
            from gradian.curvature.moments import shard_second_moment

            second_moment = shard_second_moment(stored.float(), second_moment_blocks)
        return self.write_stored(k, stored, norms, sources, second_moment, extra_tensors)

    def write_stored(self, k: int, stored, norms: torch.Tensor, sources: torch.Tensor | None = None,
                     second_moment: torch.Tensor | None = None,
                     extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Store shard k from rows already in their stored form (host tensors): `stored` (n, width) in the
        storage dtype (or packed sign bytes), or a `circuitkit.core.io.RowGather` of them; `norms` (n,)
        float32 of the stored values; the rest as `write_shard` takes them. The file is streamed and
        hashed while written (no second read), renamed into place, then listed in the manifest."""
        start, end = self.row_range(k)
        if stored.shape[0] != end - start:
            raise ValueError(f"shard {k} must hold rows {start}..{end - 1}: {end - start} rows, got {stored.shape[0]}.")
        with file_lock(self.index_dir / f".{shard_name(k)}.lock", blocking=False) as got:
            if not got:
                raise self._busy(k)
            tensors = {"grads": stored, "norms": norms, "rows": torch.arange(start, end, dtype=torch.long)}
            if sources is not None:
                tensors["sources"] = sources.long()
            if second_moment is not None:
                tensors["second_moment"] = second_moment
            if extra_tensors:
                tensors.update(extra_tensors)
            path, digest = save_safetensors_streamed(self.index_dir / shard_name(k), tensors)
        with self._manifest_lock():
            manifest = self._read()
            manifest["shards"][shard_name(k)] = {"index": k, "rows": [start, end], "sha256": digest,
                                                 "bytes": path.stat().st_size}
            manifest["complete"] = len(manifest["shards"]) == self.n_index_shards
            self._write(manifest)
        return path


