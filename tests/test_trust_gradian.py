"""Bad inputs and faults for `gradian ...`: one line naming the problem, the right exit code, no
traceback, and nothing already written changed (issue 12, the Gradian half).

Each case builds its inputs in its own directory (a copy of one small real index of the tiny
GPT-2 fixture, tampered as the case says), runs `gradian.cli.main(argv)` in-process and checks:
the exit code; exactly one `error:` line on stderr, matching the case's pattern; no
"Traceback"; every file present before the command has the same bytes after it, and no new
file appears (except where the case expects output).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from circuitkit.core.io import file_lock
from circuitkit.models.config import ModelConfig
from circuitkit_app.gradian_cli import main
from gradian.index.manifest import shard_name
from gradian.index.reader import IndexReader
from gradian.settings.grads import GradsConfig

SUBJECTS = ["cat", "dog", "bird", "fish", "horse", "mouse"]
ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the garden {i}."}
        for i, (s, v) in enumerate((s, v) for v in ("runs", "sleeps") for s in SUBJECTS)]  # 12 rows
# A row far longer than the tiny models' 256 positions (grads.max_seq_length defaults to 512).
LONG_ROW = {"prompt": "The cat " + "and the dog " * 60, "completion": " runs in the garden " * 40}
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# A place no one can write to: root ignores permission bits, so use procfs' read-only part there.
READ_ONLY = Path("/proc/sys") if IS_ROOT else None


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A 12-row index (3 shards of 4 rows, dim 16) of the tiny GPT-2 fixture, with its data."""
    from gradian.build.indexer import build_index

    root = tmp_path_factory.mktemp("trust")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    grads = GradsConfig(data_path=str(data), projection_dim=16, rows_per_shard=4, batch_size=8)
    build_index(ModelConfig(precision="float32"), grads, root / "index")
    assert IndexReader(root / "index").complete
    return root


# ----------------------------------------------------------------------------- tampering helpers


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


# ----------------------------------------------------------------------------- cases


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


CASES = [
    # -- paths the manifest names (item 2)
    Case("shard entry with ..", then(lambda d, i, t: (shutil.copy(i / shard_name(1), d / "elsewhere.safetensors"),
                                                      _edit(i, lambda m: _rename_entry(m, shard_name(1),
                                                                                       "../elsewhere.safetensors"))),
                                     rank()),
         1, r"shard entry '\.\./elsewhere\.safetensors' is a path", no_model=True),
    Case("absolute shard entry", then(lambda d, i, t: _edit(i, lambda m: _rename_entry(
        m, shard_name(1), str(i / shard_name(1)))), rank()), 1, r"shard entry '/.*shard-00001.safetensors' is a path",
        no_model=True),
    Case("shard symlinked outside", then(lambda d, i, t: (shutil.move(i / shard_name(1), d / "outside.safetensors"),
                                                          os.symlink(d / "outside.safetensors", i / shard_name(1))),
                                         rank()), 1, r"shard entry 'shard-00001.safetensors' is a link to .*outside",
         no_model=True),
    Case("resume follows a .. entry", then(lambda d, i, t: _edit(i, lambda m: _rename_entry(
        m, shard_name(1), "../x.safetensors")), index(index_dir="idx")), 1, r"shard entry '\.\./x\.safetensors' is a path",
        no_model=True),
    # -- damping refused where it enters (issue 31): NaN ranked silently, inf ended in linear algebra
    Case("damping nan", rank("--score", "whitened", "--damping", "nan"), 2, r"^error: --damping nan: .*finite",
         no_model=True),
    Case("damping inf", rank("--score", "whitened", "--damping", "inf"), 2, r"^error: --damping inf: .*finite",
         no_model=True),
    # -- shards against the manifest (item 3)
    Case("shard values changed", then(lambda d, i, t: _change_values(i), rank()), 1,
         r"^error: \S+/shard-00001\.safetensors: sha256 \w+… differs from the manifest's"),
    Case("zeroed sha256", then(lambda d, i, t: _edit(i, lambda m: m["shards"][shard_name(0)].update(sha256="0" * 64)),
                               rank()), 1, r"shard-00000\.safetensors: sha256 \w+… differs from the manifest's 000000"),
    Case("truncated shard", then(lambda d, i, t: _truncate(i), rank()), 1, r"shard-00001\.safetensors: sha256"),
    Case("truncated shard, --skip-checksums", then(lambda d, i, t: _truncate(i), rank("--skip-checksums")), 1,
         r"shard-00001\.safetensors: not a readable safetensors file .*truncated"),
    Case("shard file deleted", then(lambda d, i, t: (i / shard_name(2)).unlink(), rank()), 1,
         r"shard-00002\.safetensors: shard listed in the manifest is missing"),
    Case("row range moved", then(lambda d, i, t: _edit(i, lambda m: m["shards"][shard_name(0)].update(rows=[4, 8])),
                                 rank()), 1, r"shard-00000\.safetensors is listed with rows \[4, 8\], expected \[0, 4\]",
         no_model=True),
    Case("manifest not JSON", then(lambda d, i, t: (i / "manifest.json").write_text('{"shards": '), rank()), 1,
         r"manifest\.json is not valid JSON", no_model=True),
    Case("manifest without shards", then(lambda d, i, t: _edit(i, lambda m: m.pop("shards")), rank()), 1,
         r"manifest\.json lacks shards", no_model=True),
    Case("manifest is a list", then(lambda d, i, t: (i / "manifest.json").write_text("[]"), rank()), 1,
         r"holds a JSON list, not an index manifest", no_model=True),
    Case("manifest n_rows a string", then(lambda d, i, t: _edit(i, lambda m: m.update(n_rows="12")), rank()), 1,
         r"n_rows is '12', expected a JSON int", no_model=True),
    Case("manifest names no model", then(lambda d, i, t: _edit(i, lambda m: m.pop("model")), rank()), 1,
         r"no model", no_model=True),
    Case("index dir missing", rank(index="nope"), 2, r"is not a gradient index \(no manifest\.json\)",
         no_model=True),
    Case("index is a file", then(lambda d, i, t: (d / "afile").write_text("x"), rank(index="afile")), 2,
         r"afile is a file; give the index directory", no_model=True),
    # -- the projection actually used (item 4)
    Case("projection seed edited", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(seed=7)), rank()),
         2, r"projection_sha256: the rows were projected with .* seed 7\)"),
    Case("projection kind edited", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(kind="dense")),
                                        rank()), 2, r"projection_sha256: .*kind dense"),
    Case("old format without fingerprint", then(lambda d, i, t: _edit(
        i, lambda m: (m.pop("projection_sha256"), m.update(format_version=1))), rank()), 2,
        r"no projection_sha256 \(format_version 1"),
    # -- the queries and --out (items 8, 9, 10)
    Case("queries is a directory", then(lambda d, i, t: (d / "qdir").mkdir(), rank(queries="qdir")), 2,
         r"--queries='.*qdir' is a directory; give the JSONL file", no_model=True),
    Case("queries missing", rank(queries="missing.jsonl"), 2, r"--queries='.*missing\.jsonl' does not exist",
         no_model=True),
    Case("queries not UTF-8", then(lambda d, i, t: _write(d / "q.jsonl", json.dumps(ROWS[0]).encode() + b"\n"
                                                          + b'{"prompt": "caf\xe9", "completion": " x"}\n'), rank()),
         2, r"q\.jsonl:2: not UTF-8"),
    Case("queries not JSON", then(lambda d, i, t: _write(d / "q.jsonl", b'{"prompt": \n'), rank()), 2,
         r"q\.jsonl:1: not valid JSON"),
    Case("--out in a file's place", then(lambda d, i, t: (d / "plain").write_text("x"),
                                         rank("--out", "{d}/plain/ranked.jsonl")), 2,
         r"plain is a file, not a directory", no_model=True),
    Case("--out is a directory", rank("--out", "{d}"), 2, r"--out '.*' is a directory; give a file name",
         no_model=True),
    Case("--out read-only", rank("--out", f"{READ_ONLY or '/'}/ranked.jsonl"), 2, r"cannot write into",
         no_model=True),
    Case("--top-k 0", rank("--top-k", "0"), 2, r"--top-k 0: it must be >= 1", no_model=True),
    Case("Ctrl-C", rank(), 130, r"interrupted \(Ctrl-C\)", patch=_ctrl_c),
    # -- gradian index (items 6, 8, 9)
    Case("data_path a directory", then(lambda d, i, t: (d / "ddir").mkdir(), index(data="ddir")), 2,
         r"grads\.data_path='.*ddir' is a directory", no_model=True),
    Case("data_path missing", index(data="nope.jsonl"), 2, r"grads\.data_path='.*nope\.jsonl' does not exist",
         no_model=True),
    Case("data_path with brackets", index(data="data[1].jsonl"), 2, r"data\[1\]\.jsonl' does not exist",
         no_model=True),
    Case("data not UTF-8", then(lambda d, i, t: _write(d / "bad.jsonl", b"".join(
        json.dumps(r).encode() + b"\n" for r in ROWS[:2]) + b'{"prompt": "\xff\xfe", "completion": " x"}\n'),
        index(data="bad.jsonl")), 1, r"bad\.jsonl:3: not UTF-8"),
    Case("override syntax", index("grads.batch_size=["), 2, r"cannot parse the override 'grads\.batch_size=\['", no_model=True),
    Case("unknown key", index("grads.nope=1"), 2, r"nope", no_model=True),
    Case("shard_index >= num_shards", index("grads.num_shards=2", "grads.shard_index=2"), 2,
         r"grads\.shard_index'? ?=? ?2 must be < grads\.num_shards", no_model=True),
    Case("index_dir is a file", then(lambda d, i, t: (d / "afile").write_text("x"), index(index_dir="afile")), 2,
         r"afile is a file, not a directory", no_model=True),
    Case("index_dir read-only", index(index_dir=f"{READ_ONLY or '/'}/idx"), 2, r"cannot write into",
         no_model=True),
    Case("disk full", index(), 1, r"no space left on the device while writing '.*shard-00000\.safetensors'",
         creates=("newidx/manifest.json",), patch=_no_space),
    Case("another worker writes the shard", then(_lock_shard0, index(index_dir="resume")), 1,
         r"another process is writing shard-00000\.safetensors"),
    # -- inspect (items 3, 8)
    Case("inspect --verify, changed shard", then(lambda d, i, t: _change_values(i), inspect("--verify")), 1,
         r"1 problem\(s\)"),
    Case("inspect --verify, unlisted file", then(lambda d, i, t: (i / "stray.safetensors").write_bytes(b"x"),
                                                 inspect("--verify")), 1, r"1 problem\(s\)"),
    Case("inspect --verify, edited seed", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(seed=3)),
                                               inspect("--verify")), 1, r"1 problem\(s\)"),
    Case("inspect, not an index", inspect(), 2, r"is not a gradient index", no_model=True),
]
# `inspect, not an index` runs on an empty directory: the setup below removes the copy for it.


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink() and not p.name.endswith(".lock")}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line(case: Case, built: Path, tmp_path: Path, capsys, monkeypatch):
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


def test_verify_names_each_problem(built, tmp_path):
    """`inspect --verify` says exactly what is wrong: one problem per tampering."""
    idx = tmp_path / "idx"
    shutil.copytree(built / "index", idx)
    assert IndexReader(idx).verify() == []
    _change_values(idx, shard_name(0))
    _truncate(idx, shard_name(2))
    (idx / "stray.bin").write_bytes(b"x")
    _edit(idx, lambda m: m["projection"].update(seed=5))
    problems = IndexReader(idx).verify()
    text = "\n".join(problems)
    assert re.search(r"shard-00000\.safetensors: sha256 .* differs", text) and "not a readable" not in text
    assert re.search(r"shard-00002\.safetensors has \d+ bytes, the manifest says \d+", text)
    assert "files the manifest does not list: stray.bin" in text
    assert "the manifest says complete, but" in text
    assert "projection_sha256" in text and "seed 5" in text
    assert len(problems) == 6, problems  # + the truncated shard's sha256


def test_inspect_does_not_call_a_truncated_index_complete(built, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    idx = tmp_path / "idx"
    shutil.copytree(built / "index", idx)
    assert main(["inspect", str(idx)]) == 0
    assert "12 of 12 rows in 3 shards (complete)" in capsys.readouterr().out
    _truncate(idx)
    assert main(["inspect", str(idx)]) == 0
    out = capsys.readouterr().out
    assert "(complete)" not in out and "NOT complete although the manifest says so" in out
    assert not IndexReader(idx).complete


def test_row_longer_than_the_context_is_cut_at_the_context(built, tmp_path, capsys):
    """A 500+ token row with grads.max_seq_length=512 on a 256-position model: cut at 256, named."""
    data = _write(tmp_path / "long.jsonl", [ROWS[0], LONG_ROW, ROWS[1]])
    assert main(["index", "model.precision=float32", "grads.projection_dim=16", f"grads.data_path={data}",
                 f"grads.index_dir={tmp_path / 'idx'}"]) == 0
    manifest = _manifest(tmp_path / "idx")
    assert manifest["max_seq_length"] == 256 and manifest["data_report"]["truncated_lines"] == [2]
    queries = _write(tmp_path / "q.jsonl", [LONG_ROW])
    out = tmp_path / "ranked.jsonl"
    assert main(["rank", "--index", str(tmp_path / "idx"), "--queries", str(queries), "--out", str(out)]) == 0
    ranked = [json.loads(line) for line in out.read_text().splitlines()]
    assert ranked[0]["row_id"] == 1  # the default score (ekfac on the default kfac index) finds the cut row
    assert main(["rank", "--index", str(tmp_path / "idx"), "--queries", str(queries), "--out", str(out),
                 "--score", "cosine"]) == 0
    ranked = [json.loads(line) for line in out.read_text().splitlines()]
    assert ranked[0]["row_id"] == 1 and ranked[0]["score"] == pytest.approx(1.0, abs=1e-3)  # cut as indexed


def test_check_grads_config_bounds_by_the_context_without_weights(tmp_path, monkeypatch):
    import circuitkit.models.loading
    from gradian.build.indexer import check_grads_config

    monkeypatch.setattr(circuitkit.models.loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    assert check_grads_config(ModelConfig(), GradsConfig()) == 256
    assert check_grads_config(ModelConfig(), GradsConfig(max_seq_length=100)) == 100


def test_projection_fingerprint_is_of_the_matrices():
    from gradian.projection.projector import Projector, projection_fingerprint

    shapes = {"a": (8, 6), "b": (4, 6)}
    base = projection_fingerprint(Projector(shapes, "kronecker", 4, 0))
    assert base == projection_fingerprint(Projector(shapes, "kronecker", 4, 0))
    others = [Projector(shapes, "kronecker", 4, 1), Projector(shapes, "dense", 4, 0),
              Projector(shapes, "kronecker", 6, 0), Projector(shapes, "kronecker", None, 0)]
    assert len({base, *map(projection_fingerprint, others)}) == 5
    # Same settings, other generated numbers (as a torch with another generator would give): differs.
    p = Projector(shapes, "kronecker", 4, 0)
    p_out, p_in = p.kronecker_matrices("a")
    p._cache[("a", "out", "cpu")] = -p_out
    assert projection_fingerprint(p) != base


def test_two_identical_builds_are_byte_identical(built, tmp_path):
    from gradian.build.indexer import build_index

    grads = GradsConfig(data_path=str(built / "train.jsonl"), projection_dim=16, rows_per_shard=4, batch_size=8)
    build_index(ModelConfig(precision="float32"), grads, tmp_path / "again")
    names = sorted(p.name for p in (built / "index").iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir() if not p.name.startswith("."))
    for name in names:
        assert (built / "index" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_out_writes_everything_and_prints_a_summary(built, tmp_path, capsys):
    queries = _write(tmp_path / "q.jsonl", [ROWS[i] for i in range(5)])
    out = tmp_path / "ranked.jsonl"
    assert main(["rank", "--index", str(built / "index"), "--queries", str(queries), "--top-k", "12",
                 "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 6 * 12
    shown, err = capsys.readouterr()
    assert "wrote 72 rows (5 queries and the aggregate, top 12 each)" in err
    body = [line for line in shown.splitlines() if re.match(r"^│ (\d+|aggregate) ", line)]
    assert len(body) == (3 + 1) * 5, shown  # 3 queries and the aggregate, 5 ranks each


def test_markup_in_previews_is_shown_as_written(tmp_path, capsys):
    rows = [{"prompt": "[INST] say [bold]hi[/bold] ", "completion": "ok [/INST]"}, ROWS[0]]
    data = _write(tmp_path / "t.jsonl", rows)
    assert main(["index", "model.precision=float32", "grads.projection_dim=16", f"grads.data_path={data}",
                 f"grads.index_dir={tmp_path / 'idx'}"]) == 0
    capsys.readouterr()
    q = _write(tmp_path / "q.jsonl", rows[:1])
    assert main(["rank", "--index", str(tmp_path / "idx"), "--queries", str(q), "--top-k", "1"]) == 0
    assert "[INST] say [bold]hi[/bold]" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["index", "--help"], ["rank", "--help"], ["inspect", "--help"],
                                  ["doctor", "--help"]])
def test_every_help_works(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    assert code == 0 and "usage: gradian" in out and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_during_index_exits_130_with_one_line(tmp_path):
    data = _write(tmp_path / "rows.jsonl", [ROWS[i % len(ROWS)] | {"completion": f" row {i}."} for i in range(400)])
    idx = tmp_path / "idx"
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "circuitkit_app.gradian_cli", "index", "grads.rows_per_shard=2",
                             "grads.batch_size=1", "grads.projection_dim=16", f"grads.data_path={data}",
                             f"grads.index_dir={idx}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            # a shell's background job starts with SIGINT ignored, and Python keeps an ignored
                            # SIGINT ignored: give the child the default disposition, as a terminal would
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline:  # interrupt once some shards are written, mid-run
        try:
            if len(json.loads((idx / "manifest.json").read_text())["shards"]) >= 2:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.count("interrupted:") == 1
    reader = IndexReader(idx)  # what was written is sound: a valid manifest, every listed shard verifies
    assert not reader.complete and sum(len(rows) for rows, _, _ in reader.shards(verify=True)) > 0
    assert not list(idx.glob("*.tmp")) and not list(idx.glob(".shard-*.tmp"))
