"""Atomic artifact writes and content hashes shared by CircuitKit and Gradian.

Every artifact is written to a temporary file in the same directory, flushed to disk and
renamed over its final name, so a crash never leaves a half-written file behind. The bytes
depend only on the content (never on the temporary name or on hash-map order), so two identical
runs write identical files and a manifest's sha256 identifies the result. Files get the
permissions of an ordinary `open()` under the user's umask, not the 0600 of a temporary file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import filelock

from circuitkit.core.errors import UserError

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask: from /proc where Linux shows it, else by setting and restoring it
    (under a lock; another thread creating a file in that instant would see 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _atomic(path: Path, write: Callable[[Path], None]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file path to write to.")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _with_filename(err, path) from err
    os.close(fd)
    try:
        try:
            write(Path(tmp))
        except OSError as err:  # e.g. ENOSPC from a write: name the artifact, not the temporary file
            raise _with_filename(err, path) from err
        # mkstemp makes 0600 files; a shared index or run dir needs what open() would give.
        os.chmod(tmp, 0o666 & ~current_umask())
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _with_filename(err: OSError, path: Path) -> OSError:
    """The same OSError naming `path` (a failed write() names no file; the message should)."""
    if err.filename and not Path(str(err.filename)).name.startswith(f".{path.name}."):
        return err
    return type(err)(err.errno, err.strerror or str(err), str(path))


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite the existing file `path` with `data` without a temporary file: the last resort
    when the disk is full, since rewriting blocks a file already holds needs no free space. Not
    atomic; used only for the manifest's final status after a failed atomic write."""
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.truncate(len(data))
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return _atomic(path, lambda tmp: tmp.write_bytes(data))


def json_bytes(obj: Any) -> bytes:
    """`obj` as indented JSON text, as the manifests are written."""
    return (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode()


def atomic_write_json(path: Path, obj: Any, reserve_bytes: int = 0) -> Path:
    """Write `obj` as indented JSON to `path` atomically. `reserve_bytes` of trailing whitespace
    (still valid JSON) keep room for a later `rewrite_in_place` of a longer text on a full disk."""
    return atomic_write_bytes(path, json_bytes(obj) + b" " * reserve_bytes)


def safetensors_parts(tensors: dict, metadata: dict[str, str] | None = None) -> tuple[bytes, memoryview]:
    """A safetensors file as (header bytes, tensor data), with a canonical header (keys sorted).

    safetensors keeps `metadata` in a hash map whose order changes from process to process;
    the header is rewritten with sorted keys so equal content gives equal bytes. The tensor
    data and its offsets are left as safetensors laid them out.
    """
    from safetensors.torch import save

    raw = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)
    (n_header,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n_header])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data must start 8-byte aligned
    return struct.pack("<Q", len(text)) + text, memoryview(raw)[8 + n_header:]


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Write tensors (and string metadata) as a safetensors file, atomically and reproducibly."""
    header, data = safetensors_parts(tensors, metadata)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # two writes: no copy of a large shard's data
            fh.write(header)
            fh.write(data)
    return _atomic(path, write)


class RowGather:
    """The rows `buffer[order]` of a (n, ...) tensor, as a safetensors entry written in chunks of rows
    (`save_safetensors_streamed`): a shard filled in batch order is stored in row order without a
    second copy of it in memory."""

    def __init__(self, buffer, order, chunk_rows: int = 256) -> None:
        self.buffer, self.order, self.chunk_rows = buffer, order, chunk_rows
        self.dtype = buffer.dtype
        self.shape = (len(order), *buffer.shape[1:])

    def chunks(self) -> Iterator:
        for first in range(0, len(self.order), self.chunk_rows):
            yield self.buffer[self.order[first:first + self.chunk_rows]]


def _layout_order(entries: dict, metadata: dict[str, str] | None) -> list[str]:
    """The order safetensors lays out tensors of these names and dtypes (its own rule, read off a save
    of one-element stand-ins, so that a streamed file has exactly `atomic_save_safetensors`' bytes)."""
    import torch
    from safetensors.torch import save

    raw = save({k: torch.zeros(1, dtype=v.dtype) for k, v in entries.items()}, metadata=metadata)
    (n_header,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n_header])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


_SAFETENSORS_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64", "int64": "I64",
                      "int32": "I32", "uint8": "U8", "int8": "I8", "bool": "BOOL"}


def save_safetensors_streamed(path: Path, entries: dict, metadata: dict[str, str] | None = None) -> tuple[Path, str]:
    """`atomic_save_safetensors` of host tensors (or `RowGather`s), written in pieces and hashed while
    written: returns (path, sha256 of the file). The same bytes as `atomic_save_safetensors`; no copy
    of the whole file in memory and no second read of it for the hash."""
    import torch

    header: dict[str, Any] = {}
    offset = 0
    order = _layout_order(entries, metadata)
    for name in order:
        entry = entries[name]
        n_bytes = math.prod(entry.shape) * entry.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[str(entry.dtype).removeprefix("torch.")],
                        "shape": list(entry.shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data must start 8-byte aligned
    digest = hashlib.sha256()

    def pieces(entry) -> Iterator:
        if isinstance(entry, RowGather):
            yield from entry.chunks()
        else:
            yield entry

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            for blob in (struct.pack("<Q", len(text)), text):
                digest.update(blob)
                fh.write(blob)
            for name in order:
                for piece in pieces(entries[name]):
                    data = memoryview(piece.detach().contiguous().view(-1).view(torch.uint8).numpy())
                    digest.update(data)
                    fh.write(data)
    return _atomic(path, write), digest.hexdigest()


def torch_save_bytes(obj: Any) -> bytes:
    """torch.save's bytes. Saving to a path names the zip's records after the file, so a
    temporary name would leak into the bytes; an in-memory buffer always names them 'archive'."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def atomic_torch_save(path: Path, obj: Any) -> Path:
    """torch.save, atomically and reproducibly (load it with torch.load(path, weights_only=True))."""
    return atomic_write_bytes(path, torch_save_bytes(obj))


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of an object's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def jsonl_objects(path: Path, expected: str,
                  error: type[Exception] = ValueError) -> Iterator[tuple[int, str, Any]]:
    """(line number, `file:line`, parsed value) for every non-blank line of a JSONL file.

    A line that is not valid JSON or not UTF-8 raises `error` naming `file:line` and
    `expected` (what each line should be). A UTF-8 byte-order mark written by some editors is
    tolerated. A directory or a missing file raises `error` saying which.
    """
    path = Path(path)
    if path.is_dir():
        raise error(f"{path} is a directory, but a JSONL file was expected: give the file's path.")
    if not path.exists():
        raise error(f"{path} does not exist: give the path of a JSONL file.")
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise error(f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the"
                            f" line); save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be"
                            f" {expected}.") from None
            yield lineno, where, value


def check_writable(path: Path, what: str, directory: bool = False) -> None:
    """Fail now, before any work, if `path` cannot be written later.

    `what` names the setting in the message (e.g. "output_path"). `directory`: path is a
    directory to be created or filled, else a file. The nearest existing ancestor must be a
    directory in which a file can be created (probed with a temporary file, because
    permission bits say nothing for root or on read-only mounts).
    """
    path = Path(path).expanduser()
    if path.exists():
        if directory and not path.is_dir():
            raise UserError(f"{what}={str(path)!r}: {path} is a file, not a directory; choose a directory path.", 2)
        if not directory and path.is_dir():
            raise UserError(f"{what}={str(path)!r} is a directory, but a file is written there: give a file path"
                            f" such as {str(path / 'circuit.pt')!r}.", 2)
    ancestor = path if directory and path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{what}={str(path)!r}: {ancestor} is a file, not a directory; choose another place.", 2)
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as err:
        raise UserError(f"{what}={str(path)!r}: cannot write into {ancestor}, which is not writable ({err.strerror});"
                        " choose a directory you can write to.", 2) from None


def check_not_an_input(path: Path, what: str, inputs: Iterable[tuple[str, Path]], example: str = "") -> None:
    """Refuse (UserError, exit 2), before anything is written, an output `path` that is one of the
    command's `inputs` ((what it is, path) pairs: the same file by its resolved path or a hard link)
    or lies inside one that is a directory (an index: a file added there is not its own)."""
    target = Path(path).expanduser().resolve()
    for label, given in inputs:
        source = Path(given).expanduser().resolve()
        same = target == source or (target.is_file() and source.is_file() and os.path.samefile(target, source))
        if same or (source.is_dir() and source in target.parents):
            where = "is" if same else "lies inside"
            hint = f", e.g. {example}" if example else ""
            raise UserError(f"{what} {str(path)!r} {where} {label} {str(given)!r}, which this command reads;"
                            f" writing there would destroy it. Give another path{hint}.", 2)


def first_non_utf8_line(path: Path) -> int | None:
    """1-based number of the first line of `path` that is not valid UTF-8, None if all are."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return lineno
    return None


@contextlib.contextmanager
def file_lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the file `path` (created if missing) for the `with` block.

    Yields True once held; with `blocking=False` yields False at once when another holder has
    it. Between processes and between threads alike, on every platform (`filelock`; `fcntl`
    alone does not exist on Windows). Used by the fixture cache and the Gradian index writer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path), timeout=-1 if blocking else 0)
    try:
        lock.acquire()
    except filelock.Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
