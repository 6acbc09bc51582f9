"""What the refusal tables of `gradian index`, `gradian rank` and `gradian inspect` share: a `Case` (argv
built in its own directory on a copy of one small real index of the tiny GPT-2, then what must come out),
the argv builders (`rank`, `index`, `inspect`, `then`), the tampering helpers, the `built` fixture and
`run_case`: one error line matching the case's pattern, the exit code, no traceback, nothing already
written changed and no new file (except where the case expects output).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from circuitkit.core.io import file_lock
from circuitkit_app.gradian_cli import main
from gradian.index.manifest import shard_name

SUBJECTS = ["cat", "dog", "bird", "fish", "horse", "mouse"]


ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the garden {i}."}
        for i, (s, v) in enumerate((s, v) for v in ("runs", "sleeps") for s in SUBJECTS)]  # 12 rows


# A row far longer than the tiny models' 256 positions (grads.max_seq_length defaults to 512).
LONG_ROW = {"prompt": "The cat " + "and the dog " * 60, "completion": " runs in the garden " * 40}


IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# A place no one can write to: root ignores permission bits, so use procfs' read-only part there.
READ_ONLY = Path("/proc/sys") if IS_ROOT else None




def _manifest(idx: Path) -> dict:
    return json.loads((idx / "manifest.json").read_text())


def _save(idx: Path, manifest: dict) -> None:
    (idx / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _edit(idx: Path, fn: Callable[[dict], None]) -> None:
    manifest = _manifest(idx)
    fn(manifest)
    _save(idx, manifest)


def _rename_entry(manifest: dict, old: str, new: str) -> None:
    manifest["shards"][new] = manifest["shards"].pop(old)


def _change_values(idx: Path, name: str = shard_name(1)) -> None:
    """Rewrite a shard with other values: a valid safetensors file whose sha256 is now stale."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(idx / name))
    tensors["grads"] = tensors["grads"].flip(0).contiguous()
    save_file(tensors, str(idx / name))


def _truncate(idx: Path, name: str = shard_name(1)) -> None:
    path = idx / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _write(path: Path, rows: list[dict] | bytes) -> Path:
    if isinstance(rows, bytes):
        path.write_bytes(rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@dataclass
class Case:
    """argv built by `setup(case_dir, index_copy, train_file)`; what must come out."""

    name: str
    setup: Callable[[Path, Path, Path], list[str]]
    code: int
    pattern: str  # regex the one error line (or stdout when code == 0) must match
    creates: tuple[str, ...] = ()  # files (relative to the case dir) the command may create
    patch: Callable[[pytest.MonkeyPatch], None] | None = field(default=None)
    no_model: bool = False  # the command must fail before any model is loaded


def rank(*extra: str, index: str = "idx", queries: str = "q.jsonl"):
    def setup(d: Path, idx: Path, train: Path) -> list[str]:
        if not (d / "q.jsonl").exists():
            _write(d / "q.jsonl", [ROWS[2], ROWS[7]])
        return ["rank", "--index", str(d / index), "--queries", str(d / queries), "--top-k", "3",
                *[a.replace("{d}", str(d)) for a in extra]]
    return setup


def then(prepare: Callable[[Path, Path, Path], None], command):
    def setup(d: Path, idx: Path, train: Path) -> list[str]:
        prepare(d, idx, train)
        return command(d, idx, train)
    return setup


def index(*overrides: str, data: str | None = None, index_dir: str = "newidx"):
    """`gradian index` over the case's copy of the training rows (or `data`) into `index_dir`."""
    def setup(d: Path, idx: Path, train: Path) -> list[str]:
        data_path = str(d / data) if data else str(train)
        return ["index", "model.precision=float32", "grads.projection_dim=16", "grads.rows_per_shard=4",
                f"grads.data_path='{data_path}'", f"grads.index_dir={d / index_dir}",
                *[o.replace("{d}", str(d)) for o in overrides]]
    return setup


def inspect(*extra: str):
    def setup(d: Path, idx: Path, train: Path) -> list[str]:
        return ["inspect", str(idx), *extra]
    return setup


def _no_space(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradian.index.writer

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(gradian.index.writer, "save_safetensors_streamed", full)


def _ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradian.rank.ranking

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(gradian.rank.ranking, "query_gradients", interrupted)


def _lock_shard0(d: Path, idx: Path, train: Path) -> None:
    """Another worker is writing shard 0 of `resume/` (it holds the shard's lock, its temp file exists)."""
    resume = d / "resume"
    shutil.copytree(idx, resume)
    (resume / shard_name(0)).unlink()
    _edit(resume, lambda m: (m["shards"].pop(shard_name(0)), m.update(complete=False)))
    (resume / f".{shard_name(0)}.12345.tmp").write_bytes(b"the other worker's half-written shard")
    held = file_lock(resume / f".{shard_name(0)}.lock")
    held.__enter__()
    _HELD.append(held)


_HELD: list = []


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink() and not p.name.endswith(".lock")}


def run_case(case: Case, built: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Run one case in `tmp_path` on a copy of the `built` index and check what `Case` promises."""
    if case.name.endswith("read-only") and READ_ONLY is None:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        case = Case(case.name, (rank("--out", str(ro / "ranked.jsonl")) if case.name.startswith("--out")
                                else index(index_dir=str(ro / "idx"))), case.code, case.pattern, no_model=True)
    d = tmp_path
    idx = d / "idx"
    shutil.copytree(built / "index", idx)
    train = built / "train.jsonl"  # the manifest points at it; a resumed build must see the same data path
    if case.name == "inspect, not an index":
        shutil.rmtree(idx)
        idx.mkdir()
    argv = case.setup(d, idx, Path(train))
    if case.patch:
        case.patch(monkeypatch)
    if case.no_model:
        import circuitkit.models.loading
        import gradian.build.indexer
        import gradian.rank.ranking

        def no_load(*args, **kwargs):
            raise AssertionError("the model was loaded before the input was checked")
        # Every module that holds the name: the entry points import gradian.rank.ranking / indexer on first
        # use, and a first import under this patch would otherwise keep no_load for later tests.
        for module in (circuitkit.models.loading, gradian.rank.ranking, gradian.build.indexer):
            monkeypatch.setattr(module, "load_model", no_load)
    before = _tree(d)
    capsys.readouterr()
    try:
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse
            code = exit_info.code
    finally:
        while _HELD:
            _HELD.pop().__exit__(None, None, None)
    out, err = capsys.readouterr()
    assert code == case.code, (code, out, err)
    assert "Traceback" not in out + err
    if case.code:
        assert "AssertionError" not in err, err  # no_model: nothing was loaded
        errors = [line for line in err.splitlines() if line.startswith(("error:", "interrupted:"))]
        assert len(errors) == 1, err
        if case.name.startswith("inspect --verify"):
            problems = [line for line in err.splitlines() if line.startswith("problem:")]
            assert len(problems) == 1, err
        assert re.search(case.pattern, errors[0]), (case.pattern, errors[0])
    after = _tree(d)
    assert {k: v for k, v in after.items() if k in before} == before
    new = set(after) - set(before) - set(case.creates)
    assert not new, new
