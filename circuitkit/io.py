"""Atomic artifact writes and content hashes shared by CircuitKit and Gradian.

Every artifact is written to a temporary file in the same directory, flushed to disk and
renamed over its final name, so a crash never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _atomic(path: Path, write: Callable[[Path], None]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return _atomic(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: Path, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path` atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """safetensors.torch.save_file, atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return _atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def atomic_torch_save(path: Path, obj: Any) -> Path:
    """torch.save, atomically (load it back with torch.load(path, weights_only=True))."""
    import torch

    return _atomic(path, lambda tmp: torch.save(obj, tmp))


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

    A line that is not valid JSON raises `error` naming `file:line` and `expected` (what each
    line should be). A UTF-8 byte-order mark written by some editors is tolerated.
    """
    with open(path, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be"
                            f" {expected}.") from None
            yield lineno, where, value
