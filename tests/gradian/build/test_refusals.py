"""`gradian index`'s refusals: bad data, bad overrides, an index_dir it cannot write, a full disk, another
worker's shard, a resume with another projection; each ends in one error line with the project's exit
code and nothing already written changed. Then rows longer than the context, reproducible bytes, Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from circuitkit.models.config import ModelConfig
from circuitkit_app.gradian_cli import main
from gradian.index.manifest import shard_name
from gradian.index.reader import IndexReader
from gradian.settings.grads import GradsConfig
from tests.helpers.gradian_refusals import (
    LONG_ROW,
    READ_ONLY,
    ROWS,
    Case,
    _edit,
    _lock_shard0,
    _manifest,
    _no_space,
    _rename_entry,
    _write,
    index,
    run_case,
    then,
)
from tests.helpers.refusals import _snapshot, error_lines

CASES = [
    Case("resume follows a .. entry", then(lambda d, i, t: _edit(i, lambda m: _rename_entry(
        m, shard_name(1), "../x.safetensors")), index(index_dir="idx")), 1, r"shard entry '\.\./x\.safetensors' is a path",
        no_model=True),
    # -- gradian index: data, overrides, index_dir, disk, another worker
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
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line(case: Case, built: Path, tmp_path: Path, capsys, monkeypatch):
    run_case(case, built, tmp_path, capsys, monkeypatch)


def test_gradian_resume_with_another_projection_is_a_config_error(tmp_path, monkeypatch, capsys):
    from circuitkit_app.gradian_cli import main as gradian_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CIRCUITKIT_DEBUG", raising=False)
    index = tmp_path / "idx"
    base = ["model.precision=float32", "grads.projection_dim=8", "grads.rows_per_shard=8", "grads.batch_size=8",
            "grads.preconditioner=none", f"grads.index_dir={index}"]
    assert gradian_main(["index", *base]) == 0
    before = _snapshot(tmp_path)
    for other, named in ((["grads.projection_dim=4"], "projection_dim: index has 8, asked 4"),
                         (["grads.projection_seed=7"], "projection_seed: index has 0, asked 7"),
                         (["grads.projection=dense"], "projection: index has")):
        capsys.readouterr()
        code = gradian_main(["index", *base, *other])
        lines = error_lines(capsys.readouterr().err)
        assert code == 2 and len(lines) == 1, (code, lines)
        assert str(index) in lines[0] and "holds an index made differently" in lines[0] and named in lines[0], lines[0]
        assert _snapshot(tmp_path) == before


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
    from gradian.build.checks import check_grads_config

    monkeypatch.setattr(circuitkit.models.loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    assert check_grads_config(ModelConfig(), GradsConfig()) == 256
    assert check_grads_config(ModelConfig(), GradsConfig(max_seq_length=100)) == 100


def test_two_identical_builds_are_byte_identical(built, tmp_path):
    from gradian.build.indexer import build_index

    grads = GradsConfig(data_path=str(built / "train.jsonl"), projection_dim=16, rows_per_shard=4, batch_size=8)
    build_index(ModelConfig(precision="float32"), grads, tmp_path / "again")
    names = sorted(p.name for p in (built / "index").iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir() if not p.name.startswith("."))
    for name in names:
        assert (built / "index" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


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
