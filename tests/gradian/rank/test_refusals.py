"""`gradian rank`'s refusals: a tampered index (shards, manifest, projection), bad queries, a bad --out or
--top-k or --damping, Ctrl-C; each ends in one error line with the project's exit code, no traceback and
nothing already written changed. Then what a good rank writes and shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from circuitkit_app.gradian_cli import main
from gradian.index.manifest import shard_name
from tests.helpers.gradian_refusals import (
    READ_ONLY,
    ROWS,
    Case,
    _change_values,
    _ctrl_c,
    _edit,
    _rename_entry,
    _truncate,
    _write,
    rank,
    run_case,
    then,
)

CASES = [
    # -- paths the manifest names
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
    # -- damping refused where it enters: NaN would rank silently, inf would end in linear algebra
    Case("damping nan", rank("--score", "whitened", "--damping", "nan"), 2, r"^error: --damping nan: .*finite",
         no_model=True),
    Case("damping inf", rank("--score", "whitened", "--damping", "inf"), 2, r"^error: --damping inf: .*finite",
         no_model=True),
    # -- shards against the manifest
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
    # -- the projection actually used
    Case("projection seed edited", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(seed=7)), rank()),
         2, r"projection_sha256: the rows were projected with .* seed 7\)"),
    Case("projection kind edited", then(lambda d, i, t: _edit(i, lambda m: m["projection"].update(kind="dense")),
                                        rank()), 2, r"projection_sha256: .*kind dense"),
    Case("old format without fingerprint", then(lambda d, i, t: _edit(
        i, lambda m: (m.pop("projection_sha256"), m.update(format_version=1))), rank()), 2,
        r"no projection_sha256 \(format_version 1"),
    # -- the queries and --out
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
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line(case: Case, built: Path, tmp_path: Path, capsys, monkeypatch):
    run_case(case, built, tmp_path, capsys, monkeypatch)


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
