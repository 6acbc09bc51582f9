"""Errors, third round (issue 37): the surfaces hostile inputs found, each one line naming the
file and the cause, with the exit status of the one rule (docs/troubleshooting.md): 2 when what
was typed or configured is wrong, 1 when a file's content is bad or a stage failed. Nothing on
disk changes: no file written before the command changes, and none appears.

The entry points run in process (`circuitkit.run`'s and `circuitkit`'s `main(argv)`, `gradian`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from circuitkit.discovery.attribution import AttributionScores, Graph, save_scores
from circuitkit.fixtures.gguf import ensure_gguf_fixture
from circuitkit.models.gguf import GGUFError, read_gguf_header
from tests.test_trust_pipeline import (
    SMALL,
    Case,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _r,
    _snapshot,
    _write,
    error_lines,
    invoke,
)


def _gguf_bytes() -> bytes:
    return ensure_gguf_fixture("tiny-llama", "Q4_1").read_bytes()  # 158,400 bytes; tensor data from 29,120


def _cut_gguf(n_bytes: int) -> Callable[[Path, pytest.MonkeyPatch], None]:
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        _write(tmp / "cut.gguf", _gguf_bytes()[:n_bytes])
    return setup


def _edge_scores(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    g = Graph(2, 4, 4, False)
    torch.manual_seed(0)
    save_scores(tmp / "scores.safetensors", AttributionScores(
        torch.randn(2, 4), torch.randn(2), torch.tensor(0.3), g, torch.randn(len(g.upstream), len(g.downstream))
        * g.edge_mask(), 1.0, 0.0, 4, {"algorithm": "eap"}), {"model": "gpt2"})


def _graph_json(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    _write(tmp / "g.json", '{"cfg": {"n_layers": 2, "n_heads": 4, "d_model": 64}, "nodes": {},'
                           ' "edges": {"input->logits": {"score": 1.0, "in_graph": true}}}')


def _typo_config(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    head = "defaults:\n  - config\n  - _self_\n"
    _write(tmp / "conf" / "typo.yaml", head + "discovery:\n  batch_sise: 2\n")
    _write(tmp / "conf" / "top.yaml", head + "memory_efficient: true\n")
    _write(tmp / "conf" / "model" / "mine.yaml", "name: builtin:tiny-gpt2\nprecison: float32\n")
    _write(tmp / "conf" / "uses_mine.yaml", "defaults:\n  - config\n  - override model: mine\n  - _self_\n")


def _mib(*args: str) -> Callable[[Path], list[str]]:
    return _r("export", "{tmp}/scores.safetensors", *args, "--format", "mib", "--model", "gpt2")


CASES = [
    # --- 1, 2: GGUF files cut short (bad content: exit 1, before transformers reads a tensor) ---
    Case("gguf-cut-in-tensor-data", "run", _r("model.name={tmp}/cut.gguf", "stages=[data]"), 1, "cut.gguf",
         extra=["is cut short", "100000 bytes", "ends at byte 158400", "'output.weight'", "download or write it again"],
         setup=_cut_gguf(100_000)),
    Case("gguf-cut-one-byte-short", "run", _r("model.name={tmp}/cut.gguf", "stages=[data]"), 1, "cut.gguf",
         extra=["is cut short", "158399 bytes"], setup=_cut_gguf(158_399)),
    Case("gguf-cut-in-header", "run", _r("model.name={tmp}/cut.gguf", "stages=[data]"), 1, "cut.gguf",
         extra=["truncated or not a valid GGUF file (unexpected end of file at byte"], setup=_cut_gguf(5000)),
    Case("gguf-cut-in-tensor-infos", "run", _r("model.name={tmp}/cut.gguf", "stages=[data]"), 1, "cut.gguf",
         extra=["truncated or not a valid GGUF file (unexpected end of file at byte"], setup=_cut_gguf(28_900)),
    Case("gguf-empty", "run", _r("model.name={tmp}/cut.gguf", "stages=[data]"), 1, "cut.gguf",
         extra=["unexpected end of file at byte 0"], setup=_cut_gguf(0)),
    # --- 3: export --format mib into a path under a file, or onto one (the command is wrong: 2) ---
    Case("mib-export-under-a-file", "cli", _mib("{tmp}/prior/keep.txt/sub"), 2, "keep.txt",
         extra=["the output folder", "is a file, not a directory"], setup=_edge_scores),
    Case("mib-export-onto-a-file", "cli", _mib("{tmp}/prior/keep.txt"), 2, "keep.txt",
         extra=["is a file, not a directory"], setup=_edge_scores),
    Case("mib-export-folder-is-a-file", "cli", _mib("{tmp}/prior"), 2, "ioi_gpt2",
         extra=["is a file, not a directory"],
         setup=lambda tmp, mp: (_edge_scores(tmp, mp), _write(tmp / "prior" / "ioi_gpt2", "a file"))),
    Case("mib-export-source-missing", "cli", _mib("{tmp}/out"), 2, "scores.safetensors", extra=["does not exist"]),
    Case("mib-export-not-a-task", "cli", _r("export", "{tmp}/scores.safetensors", "{tmp}/out", "--format", "mib",
                                            "--model", "gpt2", "--task", "nope"), 2, "--task 'nope'",
         setup=_edge_scores),
    # --- 4: import --scale (an argument: 2) ---------------------------------------------------
    Case("import-scale-nan", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt", "--scale", "nan"), 2, "--scale nan",
         extra=["finite number > 0"], setup=_graph_json),
    Case("import-scale-negative", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.safetensors", "--scale", "-1"), 2,
         "--scale -1", extra=["finite number > 0"], setup=_graph_json),
    Case("import-scale-inf", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt", "--scale", "inf"), 2, "--scale inf",
         setup=_graph_json),
    Case("import-source-missing", "cli", _r("import", "{tmp}/none.json", "{tmp}/out.pt"), 2, "none.json",
         extra=["does not exist"]),
    # --- 5: a user's config file with an unknown key (the config is wrong: 2) -------------------
    Case("user-config-unknown-key", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "typo"), 2,
         lambda tmp: f"{tmp}/conf/typo.yaml: Unknown config key 'discovery.batch_sise'",
         extra=["Did you mean 'discovery.batch_size'?", "Valid keys of 'discovery'"], setup=_typo_config),
    Case("user-config-unknown-top-key", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "top"), 2,
         lambda tmp: f"{tmp}/conf/top.yaml: Unknown config key 'memory_efficient'", extra=["Valid keys of the top"],
         setup=_typo_config),
    Case("user-group-file-unknown-key", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "uses_mine"), 2,
         lambda tmp: f"{tmp}/conf/model/mine.yaml: Unknown config key 'model.precison'",
         extra=["Did you mean 'model.precision'?"], setup=_typo_config),
    Case("user-config-unknown-key-sweep", "run", _r("-m", "--config-dir", "{tmp}/conf", "--config-name", "typo",
                                                    "hydra.sweep.dir={tmp}/sweep"), 2,
         lambda tmp: f"{tmp}/conf/typo.yaml: Unknown config key 'discovery.batch_sise'", setup=_typo_config),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_ends_in_one_line_and_changes_nothing(case: Case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CIRCUITKIT_DEBUG", raising=False)
    _write(tmp_path / "prior" / "keep.txt", "written before the command")
    if case.setup:
        case.setup(tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    dirs_before = sorted(p for p in tmp_path.rglob("*") if p.is_dir())
    argv = case.args(tmp_path)
    if case.entry == "run" and not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in argv):
        argv = [*SMALL, *argv, f"hydra.run.dir={tmp_path / 'run'}"]
    code, out, err = invoke(case.entry, argv, capsys)
    assert "Traceback" not in out + err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    needle = case.needle(tmp_path) if callable(case.needle) else case.needle
    for text in [needle, *case.extra]:
        assert text in lines[0], lines[0]
    assert "()" not in lines[0] and "ConfigKeyError" not in lines[0], lines[0]
    assert code == case.code, (code, lines[0])
    assert _snapshot(tmp_path) == before  # nothing changed, nothing new
    assert sorted(p for p in tmp_path.rglob("*") if p.is_dir()) == dirs_before  # no run dir, no output folder


def test_every_cut_of_a_gguf_file_is_one_line_of_bad_data(tmp_path):
    """Cut anywhere (header, tensor infos, tensor data): GGUFError with exit status 1 naming the
    file and the cause, never empty brackets; the whole file reads."""
    data = _gguf_bytes()
    read_gguf_header(_write(tmp_path / "whole.gguf", data))
    cuts = sorted({*range(0, len(data), 401), 4, 8, 24, 29_119, 29_120, len(data) - 1})
    for n in cuts:
        path = _write(tmp_path / "cut.gguf", data[:n])
        with pytest.raises(GGUFError) as caught:
            read_gguf_header(path)
        message = str(caught.value)
        assert caught.value.exit_code == 1 and str(path) in message, (n, message)
        assert "()" not in message and ("unexpected end of file" in message or "is cut short" in message), (n, message)


def test_a_garbled_length_in_the_header_is_refused_without_reading_it(tmp_path):
    """A string length of 2^62 (a flipped byte): refused as the end of the file, not allocated."""
    data = bytearray(_gguf_bytes())
    data[24:32] = (1 << 62).to_bytes(8, "little")  # the first metadata key's length
    with pytest.raises(GGUFError, match="unexpected end of file at byte 32, reading 4611686018427387904 more") as caught:
        read_gguf_header(_write(tmp_path / "garbled.gguf", bytes(data)))
    assert caught.value.exit_code == 1


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
