"""An index directory's own files: what its manifest names is read only from inside the directory.

Every file an index reads (its shards, the whitened projection's ``projection.safetensors``, the
width allocation's ``allocation.json``, ``curvature.safetensors``) is a plain file name in the
index directory: `confined_path` refuses a path, a `..` and a symlink that resolves outside it.
The data-dependent files the manifest records with a sha256 are read only through
`read_recorded`, which checks that sha256 on the bytes it returns. Both raise
IndexIntegrityError (exit code 1: the index's content is bad), naming the file and what is wrong.

Below `gradian.index.manifest` so that the modules it builds on (projection, allocation, whitening,
curvature) read their files through the same check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from circuitkit.core.errors import UserError

MANIFEST = "manifest.json"
REBUILD = "rebuild the index into an empty grads.index_dir with `gradian index` (or the grads stage)"


class IndexIntegrityError(UserError, ValueError):
    """The directory is not a readable index, or its files are not what its manifest says."""


def confined_path(index_dir: Path, name: object, manifest_path: Path | None = None,
                  what: str = "shard entry") -> Path:
    """`index_dir / name` if `name` is a plain file name that stays inside `index_dir`.

    Refuses (IndexIntegrityError naming the entry, `what` it is) an absolute path, a path with a
    directory part or `..`, and a symlink that resolves outside the index directory.
    """
    where = manifest_path or Path(index_dir) / MANIFEST
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise IndexIntegrityError(f"{where}: {what} {name!r} is not a file name; {REBUILD}.")
    if Path(name).is_absolute() or "/" in name or "\\" in name:
        raise IndexIntegrityError(f"{where}: {what} {name!r} is a path, not a file name in the index"
                                  f" directory; an index only reads its own files. {REBUILD[0].upper()}"
                                  f"{REBUILD[1:]}.")
    root = Path(index_dir).resolve()
    path = Path(index_dir) / name
    if path.resolve().parent != root:
        raise IndexIntegrityError(f"{where}: {what} {name!r} is a link to {path.resolve()}, outside the"
                                  f" index directory {root}; replace the link by the file itself.")
    return path


def read_recorded(index_dir: Path, record: object, filename: str, what: str) -> bytes:
    """The bytes of `filename` in `index_dir`, which the manifest records as `record` ({"file",
    "sha256", ...}): the record must name that file, the file must be inside the directory
    (`confined_path`), present, and have the recorded sha256 (checked on the bytes returned).

    what: what the file is, for the messages ("the whitened projection's matrices").
    IndexIntegrityError naming the file and the problem otherwise.
    """
    if not isinstance(record, Mapping):
        raise IndexIntegrityError(f"{Path(index_dir) / MANIFEST}: the record of {filename} ({what}) is"
                                  f" {str(record)[:60]!r}, not {{file, sha256, bytes}}; {REBUILD}.")
    if record.get("file") != filename:
        raise IndexIntegrityError(f"{Path(index_dir) / MANIFEST}: {what} names file {record.get('file')!r}; only"
                                  f" {filename} is read; {REBUILD}.")
    path = confined_path(index_dir, filename, what=f"the file of {what}")
    if not path.is_file():
        raise IndexIntegrityError(f"{path} ({what}) is missing; {REBUILD}.")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.get("sha256"):
        raise IndexIntegrityError(f"{path} ({what}) has sha256 {digest[:12]}…, the manifest records"
                                  f" {str(record.get('sha256'))[:12]}…: it was changed after it was written;"
                                  f" {REBUILD}.")
    return data
