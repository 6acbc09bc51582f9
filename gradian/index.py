"""The gradient index on disk: a directory with manifest.json and safetensors shards.

    index/
      manifest.json               how the index was made (header) + the shard list
      shard-00000.safetensors     grads (n, width) in the storage dtype, norms (n,) float32, rows (n,) int64
      shard-00001.safetensors     ...

Shard k holds rows [k * rows_per_shard, (k + 1) * rows_per_shard). With `num_shards` workers,
worker w writes the shards k with k % num_shards == w, so any number of workers produce the
same files as one. Each shard is written to a temporary name and renamed; the manifest is
rewritten atomically (under a file lock shared by the workers) after every shard. A killed
run resumes from the shards whose file and sha256 match the manifest, and the finished index
is byte-identical to an uninterrupted one: nothing in it depends on time, order or worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuitkit.io import atomic_save_safetensors, atomic_write_json, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class IndexMismatchError(ValueError):
    """An existing index was made differently from what is asked now."""


class StorageOverflowError(OverflowError):
    """Values do not fit the storage dtype (float16 tops out at 65504)."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


@contextlib.contextmanager
def _lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive fcntl lock on `path`; yields False if `blocking` is off and it is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: index has {old.get(k)!r}, asked {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


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
        with self._manifest_lock():
            # Manifest writes happen under this lock, so a temp manifest seen now is a killed
            # run's leftover.
            for stale in self.index_dir.glob(f".{MANIFEST}.*.tmp"):
                stale.unlink(missing_ok=True)
            manifest = self._read()
            if manifest is None:
                self._write({**self.header, "shards": {}, "complete": False})
            elif {k: manifest.get(k) for k in self.header} != self.header:
                diffs = _diff({k: manifest.get(k) for k in self.header}, self.header)
                raise IndexMismatchError(
                    f"{self.index_dir} holds an index made differently: {'; '.join(diffs)}. Use another"
                    " grads.index_dir, or delete this one to rebuild it.")

    # -- manifest ---------------------------------------------------------------------------
    @property
    def n_index_shards(self) -> int:
        return max(1, math.ceil(self.n_rows / self.rows_per_shard))

    def _manifest_lock(self):
        return _lock(self.index_dir / ".manifest.lock")

    def _read(self) -> dict[str, Any] | None:
        path = self.index_dir / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

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
        path = self.index_dir / shard_name(k)
        return entry is not None and path.is_file() and sha256_file(path) == entry["sha256"]

    def pending(self) -> list[int]:
        """This worker's shards still to write (a resumed run skips the complete ones).

        Temporary files a killed run left for these shards are removed: only this worker
        writes them.
        """
        todo = [k for k in self.my_shards() if not self.is_done(k)]
        for k in todo:
            for stale in self.index_dir.glob(f".{shard_name(k)}.*.tmp"):
                stale.unlink(missing_ok=True)
        return todo

    # -- writing ----------------------------------------------------------------------------
    def write_shard(self, k: int, grads: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor | None = None) -> Path:
        """Store shard k: grads (n, width) float32 in the storage dtype, with float32 norms, and
        `sources` (n,) int64, where each row is in the data (JSONL line or table row index).

        Norms are of the stored values, so cosine scores read back exactly what was stored.
        Raises StorageOverflowError naming the rows if float16 would turn values into inf.
        """
        start, end = self.row_range(k)
        if rows.tolist() != list(range(start, end)):
            raise ValueError(f"shard {k} must hold rows {start}..{end - 1}, got {rows.tolist()[:5]}...")
        dtype = STORAGE_DTYPES[self.header["storage_dtype"]]
        stored = grads.float().to(dtype)
        bad = ~torch.isfinite(stored).all(dim=1)
        if bad.any():
            finite_before = torch.isfinite(grads.float()).all(dim=1)
            which = rows[bad].tolist()[:10]
            why = ("exceed the float16 range (|x| > 65504)" if finite_before[bad].all()
                   else "are not finite (inf/nan) in float32 already")
            raise StorageOverflowError(
                f"rows {which} of shard {k} {why}; nothing of this shard was written. Set"
                " grads.storage_dtype=bfloat16 (same size, float32's range) or float32.")
        norms = stored.float().norm(dim=1)
        with _lock(self.index_dir / f".{shard_name(k)}.lock", blocking=False) as got:
            if not got:
                raise RuntimeError(f"another process is writing {shard_name(k)} of {self.index_dir}; two"
                                   " workers must not share a grads.shard_index.")
            tensors = {"grads": stored, "norms": norms, "rows": rows.long()}
            if sources is not None:
                tensors["sources"] = sources.long()
            path = atomic_save_safetensors(self.index_dir / shard_name(k), tensors)
            digest = sha256_file(path)
        with self._manifest_lock():
            manifest = self._read()
            manifest["shards"][shard_name(k)] = {"index": k, "rows": [start, end], "sha256": digest,
                                                 "bytes": path.stat().st_size}
            manifest["complete"] = len(manifest["shards"]) == self.n_index_shards
            self._write(manifest)
        return path


class IndexReader:
    """Streams an index shard by shard (memory independent of the index size)."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = Path(index_dir)
        path = self.index_dir / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{self.index_dir} is not a gradient index (no {MANIFEST}); build one with"
                                    " `gradian index` or the pipeline's grads stage.")
        self.manifest = json.loads(path.read_text())

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def shards(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(rows (n,), grads (n, width) float32, norms (n,)) per shard, in row order."""
        from safetensors import safe_open

        for name in sorted(self.manifest["shards"]):
            with safe_open(str(self.index_dir / name), framework="pt") as fh:
                yield fh.get_tensor("rows"), fh.get_tensor("grads").float(), fh.get_tensor("norms")

    def source_positions(self, row_ids: list[int]) -> dict[int, int]:
        """row id -> its position in the data (JSONL line or table row index), read from the
        `sources` tensor of the shards that hold those rows; rows of shards without it are left out."""
        from safetensors import safe_open

        per_shard = self.manifest.get("rows_per_shard") or 1
        by_shard: dict[int, list[int]] = {}
        for r in row_ids:
            by_shard.setdefault(r // per_shard, []).append(r)
        out: dict[int, int] = {}
        for k, wanted in by_shard.items():
            entry = self.manifest.get("shards", {}).get(shard_name(k))
            if entry is None:
                continue
            with safe_open(str(self.index_dir / shard_name(k)), framework="pt") as fh:
                if "sources" not in fh.keys():
                    continue
                sources = fh.get_tensor("sources")
            first = entry["rows"][0]
            out.update({r: int(sources[r - first]) for r in wanted})
        return out

    def summary(self) -> dict[str, Any]:
        """Header, shard count, rows stored and bytes on disk."""
        shards = self.manifest.get("shards", {})
        stored = sum(e["rows"][1] - e["rows"][0] for e in shards.values())
        header = {k: v for k, v in self.manifest.items() if k != "shards"}
        return {**header, "n_shard_files": len(shards), "shard_files": sorted(shards), "rows_stored": stored,
                "bytes": sum(e["bytes"] for e in shards.values()) + (self.index_dir / MANIFEST).stat().st_size}
