"""`gradian inspect` and the index reader on a damaged index: --verify names each problem, a truncated
index is not called complete, a sign index whose manifest was edited is blamed on the manifest, and the
projection's fingerprint is of the matrices themselves.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from circuitkit_app.gradian_cli import main
from gradian.index.manifest import shard_name
from gradian.index.reader import IndexReader
from tests.helpers.gradian_refusals import (
    Case,
    _change_values,
    _edit,
    _truncate,
    inspect,
    run_case,
    then,
)
from tests.helpers.refusals import _one_error

CASES = [
    # -- inspect
    Case("inspect --verify, changed shard", then(lambda d, i, t: _change_values(i), inspect("--verify")), 1,
         r"1 problem\(s\)"),
    Case("inspect --verify, unlisted file", then(lambda d, i, t: (i / "stray.safetensors").write_bytes(b"x"),
                                                 inspect("--verify")), 1, r"1 problem\(s\)"),
    Case("inspect --verify, edited seed", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(seed=3)),
                                               inspect("--verify")), 1, r"1 problem\(s\)"),
    Case("inspect, not an index", inspect(), 2, r"is not a gradient index", no_model=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line(case: Case, built: Path, tmp_path: Path, capsys, monkeypatch):
    run_case(case, built, tmp_path, capsys, monkeypatch)


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


def test_a_sign_index_with_an_edited_projection_dim_blames_the_manifest(tmp_path, capsys):
    from circuitkit_app.gradian_cli import main
    from gradian.build.indexer import build_index
    from tests.gradian.index.test_sign_rows import _cfg as sign_cfg

    cfg = sign_cfg(tmp_path, "grads.row_format=signs", "grads.projection=eigen")
    build_index(cfg.model, cfg.grads, tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    manifest["projection"]["projection_dim"] = 64  # 8 x 8 factors; the rotations are 10 x 10
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code = main(["rank", "--index", str(tmp_path / "idx"), "--queries", str(tmp_path / "train.jsonl")])
    line = _one_error(capsys.readouterr().err)
    assert code == 1 and "manifest.json" in line and "does not match the recorded projection" in line, (code, line)
    assert "projection_dim 64" in line
