"""The gradient index on disk, and its manifest: a directory with manifest.json and safetensors shards.

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

What the manifest names is not trusted: every file an index reads (the manifest, its shards,
projection.safetensors, allocation.json, curvature.safetensors) must be a plain file name inside
the index directory (symlinks resolved; `circuitkit.core.recorded`), and a shard is checked against
its sha256 as it is read (`IndexReader.shards(verify=True)`, the default). `IndexReader.verify()` checks the whole
index and lists every problem (`gradian inspect --verify`).

This module reads and checks the manifest; the shards are written by `gradian.index.writer` and
read by `gradian.index.reader`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from circuitkit.core.device import DTYPES
from circuitkit.core.errors import UserError
from circuitkit.core.recorded import (
    MANIFEST,
    REBUILD,
    IndexIntegrityError,
    confined_path,
)
from gradian.index.formats import row_format_problems
from gradian.index.header import check_header

# 2: the header records `projection_sha256`, a hash of the generated projection matrices.
# 3: the header records `token_policy`, `loss` and `preconditioner`; shards may hold
#    `second_moment` (gradian.curvature.moments).
#    Still 4 with K-FAC: shards may hold `kfac_in.m`, `kfac_out.m`, `kfac_tokens`, and the manifest
#    `curvature` (curvature.safetensors, gradian.curvature.factors); readers that predate them refuse
#    such shards (unknown tensors) rather than misread them.
# 4: the header records `activations` ("model" or "fused", gradian.capture.gradients.activation_numerics).
# 5: the header is `gradian.index.header.IndexHeader`, checked field by field, and records
#    `parameter_share` (the share of the model's parameters the index covers).
# 8: the header records `row_format` and `row_rank`: `grads` of a factored index are each module's
#    rank-c factors [U | V] (gradian.index.formats.factored), its norms those of U Vᵀ; readers that predate it refuse
#    the version rather than multiply factors as dense rows.
# 9: row_format may be `signs`: `grads` are packed sign bits (uint8, gradian.index.formats.signs), norms √n; readers
#    that predate it refuse the version rather than read bytes as numbers.
FORMAT_VERSION = 9
# Optional shard tensors besides grads, norms and rows.
OPTIONAL_TENSORS = ("sources", "second_moment")


class IndexMismatchError(ValueError):
    """An existing index was made differently from what is asked now."""


class ConcurrentWriterError(UserError, RuntimeError):
    """Another process holds the lock of a shard this worker was about to write."""


# Header keys every reader needs, with their JSON types.
_REQUIRED = {"format_version": int, "n_rows": int, "rows_per_shard": int, "storage_dtype": str, "shards": dict,
             "complete": bool}


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def read_manifest(index_dir: Path) -> dict[str, Any]:
    """manifest.json of `index_dir`, checked for the keys and types every reader needs.

    Raises IndexIntegrityError (exit code 2) when there is no manifest, and IndexIntegrityError
    naming the problem when it is not JSON, lacks a key, or a shard entry is malformed or
    points outside the directory.
    """
    index_dir = Path(index_dir)
    path = index_dir / MANIFEST
    if index_dir.is_file():
        raise IndexIntegrityError(f"{index_dir} is a file; give the index directory (the one holding"
                                  f" {MANIFEST}).", exit_code=2)
    if not path.is_file():
        raise IndexIntegrityError(f"{index_dir} is not a gradient index (no {MANIFEST}); build one with"
                                  " `gradian index` or the pipeline's grads stage.", exit_code=2)
    confined_path(index_dir, MANIFEST, what="the manifest")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexIntegrityError(f"{path} is not valid JSON ({err}); the index is damaged: {REBUILD}.") from None
    if not isinstance(manifest, dict):
        raise IndexIntegrityError(f"{path} holds a JSON {type(manifest).__name__}, not an index manifest;"
                                  f" {REBUILD}.")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise IndexIntegrityError(f"{path} lacks {', '.join(missing)}: it is not a complete index manifest;"
                                  f" {REBUILD}.")
    for key, kind in _REQUIRED.items():
        value = manifest[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise IndexIntegrityError(f"{path}: {key} is {value!r}, expected a JSON {kind.__name__};"
                                      f" {REBUILD}.")
    if manifest["format_version"] > FORMAT_VERSION:
        raise IndexIntegrityError(f"{path}: format_version {manifest['format_version']} is newer than this"
                                  f" Gradian reads ({FORMAT_VERSION}); upgrade circuitkit.")
    if manifest["storage_dtype"] not in DTYPES:
        raise IndexIntegrityError(f"{path}: storage_dtype {manifest['storage_dtype']!r} is not one of"
                                  f" {', '.join(DTYPES)}; {REBUILD}.")
    if manifest["n_rows"] < 0 or manifest["rows_per_shard"] < 1:
        raise IndexIntegrityError(f"{path}: n_rows={manifest['n_rows']}, rows_per_shard="
                                  f"{manifest['rows_per_shard']} are not valid; {REBUILD}.")
    if "tokenizer_sha256" in manifest:  # an index the indexer wrote: its header, field by field
        problems = check_header(manifest, str(path))
        if problems:
            raise IndexIntegrityError(f"{problems[0]}; {REBUILD}.")
    problems = row_format_problems(manifest, str(path))
    if problems:  # each names its fix (an unknown format: upgrade; a damaged record: rebuild)
        raise IndexIntegrityError(f"{problems[0]}.")
    for name, entry in manifest["shards"].items():
        confined_path(index_dir, name, path)
        rows = entry.get("rows") if isinstance(entry, dict) else None
        ok = (isinstance(entry, dict) and isinstance(rows, list) and len(rows) == 2
              and all(isinstance(r, int) and not isinstance(r, bool) for r in rows) and 0 <= rows[0] <= rows[1]
              and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int))
        if not ok:
            raise IndexIntegrityError(f"{path}: shard entry {name!r} is {json.dumps(entry)[:120]}; expected"
                                      ' {"index": k, "rows": [start, end], "sha256": hex, "bytes": n};'
                                      f" {REBUILD}.")
    return manifest


