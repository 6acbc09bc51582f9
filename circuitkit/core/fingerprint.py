"""Fingerprints of what a stage reads: data files, model files, upstream artifacts.

A stage declares its inputs as a function of the config and the run directory returning
`{label: Path | str}`: a Path is fingerprinted by content (a directory by every file in it),
a str is already a fingerprint (a hub model's resolved revision). The pipeline records the
fingerprints per stage in manifest.json and reruns a stage whose inputs changed.

Content hashes are expensive for model weights, so each file's record keeps its size and
mtime: when both are unchanged the recorded sha256 is reused (the fast path); when either
moved the file is hashed again, so a file touched but not changed still counts as unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from circuitkit.core.io import sha256_file

# Files of a model directory that do not decide its results (editor/VCS leftovers, our locks).
_IGNORED_PARTS = (".git", ".cache", "__pycache__", ".ipynb_checkpoints")


def model_files(directory: Path) -> list[Path]:
    """Every regular file under a model directory (weights, config, tokenizer files), sorted."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in _IGNORED_PARTS)
        out.extend(Path(root) / f for f in files if not f.startswith(".") and not f.endswith(".lock"))
    return sorted(out)


def hub_revision(name: str, revision: str | None) -> str:
    """`name@commit` for a hub model, read from the local Hugging Face cache (no network).

    A 40-hex revision is already a commit; a branch or tag is resolved through the cache's
    `refs/` file. When the cache has no record, the name and requested revision are returned:
    the fingerprint then changes only with the configuration.
    """
    rev = revision or "main"
    if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev):
        return f"{name}@{rev}"
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return f"{name}@{rev} (unresolved)"
    ref = Path(HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "refs" / rev
    if ref.is_file():
        return f"{name}@{ref.read_text().strip()}"
    return f"{name}@{rev} (unresolved)"


class Fingerprinter:
    """Content hashes with a size+mtime fast path, seeded from records of earlier runs."""

    def __init__(self, known: Iterable[Mapping[str, Any]] = ()) -> None:
        self._known: dict[tuple[str, int, int], str] = {}
        for record in known:
            if {"path", "bytes", "mtime_ns", "sha256"} <= set(record):
                self._known[(record["path"], record["bytes"], record["mtime_ns"])] = record["sha256"]

    def file(self, path: Path) -> dict[str, Any]:
        """{"path", "bytes", "mtime_ns", "sha256"} of one file (hashed only when size or mtime moved)."""
        path = Path(path).resolve()
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._known:
            self._known[key] = sha256_file(path)
        return {"path": key[0], "bytes": key[1], "mtime_ns": key[2], "sha256": self._known[key]}

    def inputs(self, declared: Mapping[str, Path | str]) -> dict[str, dict[str, Any]]:
        """Records for a stage's declared inputs; a directory becomes one record per file
        (`label/relative path`), a missing path a record saying so (the stage will report it)."""
        out: dict[str, dict[str, Any]] = {}
        for label, value in declared.items():
            if isinstance(value, str):
                out[label] = {"fingerprint": value}
                continue
            path = Path(value)
            if path.is_dir():
                files = model_files(path)
                out[label] = {"path": str(path.resolve()), "files": len(files)}
                for f in files:
                    out[f"{label}/{f.relative_to(path).as_posix()}"] = self.file(f)
            elif path.is_file():
                out[label] = self.file(path)
            else:
                out[label] = {"path": str(path), "missing": True}
        return out


def changed_inputs(recorded: Mapping[str, Mapping[str, Any]], current: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Labels whose content differs between two input records (added and removed ones too)."""

    def content(r: Mapping[str, Any]) -> Any:
        return r.get("sha256", r.get("fingerprint", r.get("files", "missing" if r.get("missing") else None)))
    return sorted(label for label in set(recorded) | set(current)
                  if label not in recorded or label not in current
                  or content(recorded[label]) != content(current[label]))
