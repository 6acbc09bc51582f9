"""Bad inputs and faults of the pipeline and the `circuitkit` commands, run in process
(`python -m circuitkit.run` and `circuitkit ...`). Every case asserts the exit status (2: what was typed
or configured is wrong; 1: a file's content is bad or a stage failed), exactly one error line that names
the thing, no traceback, and that nothing written before the command changed (and, for usage errors,
that no run directory was made). The second table adds hostile files (GGUF cut short, MIB exports into
a file, import --scale, unknown keys in a user's config file) and checks that nothing new appears.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from circuitkit.core.config import ConfigError
from circuitkit.core.errors import UserError
from circuitkit.discovery.attribution import AttributionScores, Graph, save_scores
from circuitkit_app.cli import main as cli_main
from tests.helpers.refusals import (
    LISA,
    LONG_PROMPT,
    MARY,
    SMALL,
    Case,
    _gguf_bytes,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _model_copy,
    _pair,
    _r,
    _raiser,
    _replace_stage,
    _saved_circuit,
    _snapshot,
    _tiny,
    _truncate,
    _write,
    error_lines,
    invoke,
)

CASES = [
    # --- override syntax, keys, values (exit 2, nothing created) --------------------------
    Case("override-syntax", "run", _r("x=["), 2, "'x=['", extra=["override syntax"]),
    Case("interpolation", "run", _r("output_path=${{oops}}"), 2, "output_path", extra=["interpolation", "oops"]),
    Case("unknown-key-memory-efficient", "run", _r("discovery.memory_efficient=true"), 2, "memory_efficient",
         extra=["not the peak"]),
    Case("huge-seed", "run", _r("seed=99999999999999999999"), 2, "'seed'", extra=["4294967295"]),
    Case("huge-projection-seed", "run", _r("grads.projection_seed=18446744073709551616"), 2,
         "grads.projection_seed"),
    Case("ig-steps-zero", "run", _r("discovery.ig_steps=0"), 2, "discovery.ig_steps"),
    Case("model-group-missing", "run", _r("model=nope"), 2, "model=nope", extra=["tiny_gpt2"]),
    Case("sweep-group-option-missing", "run", _r("-m", "model=tiny_gpt2,nope", "hydra.sweep.dir={tmp}/sweep"), 2,
         "model=nope"),
    Case("stages-order-brackets-kept", "run", _r("stages=[pruning,data]"), 2, "stages=[data,pruning]"),
    Case("shard-index-out-of-range", "run", _r("grads.num_shards=2", "grads.shard_index=2"), 2, "grads.shard_index"),
    Case("wrong-type", "run", _r("discovery.batch_size=abc"), 2, "discovery.batch_size"),
    # --- pre-run checks (exit 2, before the run dir exists) ---------------------------------
    Case("edges-with-node-level", "run", _r("stages=[data,attribution,pruning]", "pruning.scope=edges"), 2,
         "pruning.scope=edges", extra=["discovery.level=edge"]),
    Case("output-path-read-only", "run", _r("output_path=/sys/ck/circuit.pt"), 2, "output_path",
         extra=["not writable"]),
    Case("output-path-is-directory", "run", _r("output_path={tmp}/prior"), 2, "output_path",
         extra=["is a directory"]),
    Case("output-path-under-a-file", "run", _r("output_path={tmp}/prior/keep.txt/c.pt"), 2, "keep.txt",
         extra=["is a file"]),
    Case("seq-len-beyond-context", "run", _r("discovery.data_params.seq_len=1000"), 2, "seq_len",
         extra=["256"]),
    Case("model-dir-missing", "run", _r("model.name={tmp}/no-model"), 2, "no-model", extra=["does not exist"]),
    Case("model-relative-dir-missing", "run", _r("model.name=./models/mine"), 2, "./models/mine",
         extra=["does not exist"]),
    Case("model-is-a-file", "run", _r("model.name={tmp}/prior/keep.txt"), 2, "keep.txt", extra=["is a file"]),
    Case("model-dir-without-config", "run", _r("model.name={tmp}/prior"), 2, "config.json"),
    Case("builtin-fixture-unknown", "run", _r("model.name=builtin:nope"), 2, "builtin:nope"),
    Case("jsonl-data-missing", "run", _r("discovery.task=jsonl", "discovery.data_params.data_path={tmp}/no.jsonl"),
         2, "no.jsonl", extra=["does not exist"]),
    Case("jsonl-data-is-directory", "run", _r("discovery.task=jsonl", "discovery.data_params.data_path={tmp}/prior"),
         2, "prior", extra=["is a directory"]),
    Case("mmlu-data-missing", "run", _r("discovery.task=mmlu", "discovery.data_params.data_path={tmp}/no.csv"),
         2, "no.csv"),
    Case("grads-data-missing", "run", _r("stages=[grads]", "grads.data_path={tmp}/no.jsonl"), 2,
         "grads.data_path"),
    Case("grads-data-is-directory", "run", _r("stages=[grads]", "grads.data_path={tmp}/prior"), 2,
         "grads.data_path", extra=["is a directory"]),
    Case("grads-index-dir-read-only", "run", _r("stages=[grads]", "grads.index_dir=/sys/ck-index"), 2,
         "grads.index_dir"),
    Case("grads-index-dir-is-a-file", "run", _r("stages=[grads]", "grads.index_dir={tmp}/prior/keep.txt"), 2,
         "grads.index_dir", extra=["is a file"]),
    Case("run-dir-read-only", "run", _r("stages=[data]", "hydra.run.dir=/sys/ck-run"), 2, "hydra.run.dir"),
    Case("run-dir-is-a-file", "run", _r("stages=[data]", "hydra.run.dir={tmp}/prior/keep.txt"), 2,
         "hydra.run.dir", extra=["is a file"]),
    Case("sweep-dir-read-only", "run", _r("-m", "stages=[data]", "seed=0,1", "hydra.sweep.dir=/sys/ck-sweep"), 2,
         "hydra.sweep.dir"),
    # --- stage failures while running (exit 1, earlier files unchanged) ---------------------
    Case("jsonl-not-utf8", "run", _r("stages=[data]", "discovery.task=jsonl",
                                     "discovery.data_params.data_path={tmp}/latin1.jsonl"), 1,
         lambda tmp: f"{tmp}/latin1.jsonl:2", extra=["not UTF-8"],
         setup=lambda tmp, mp: _write(tmp / "latin1.jsonl", (_pair() + "\n").encode() + _pair().replace(
             "store", "caf\xe9").encode("latin-1") + b"\n")),
    Case("jsonl-bad-json", "run", _r("stages=[data]", "discovery.task=jsonl",
                                     "discovery.data_params.data_path={tmp}/bad.jsonl"), 1,
         lambda tmp: f"{tmp}/bad.jsonl:3", extra=["not valid JSON"],
         setup=lambda tmp, mp: _write(tmp / "bad.jsonl", f"{_pair()}\n\n{{oops\n")),
    Case("jsonl-prompt-beyond-context", "run", _r("stages=[data]", "discovery.task=jsonl",
                                                  "discovery.data_params.data_path={tmp}/long.jsonl"), 1,
         lambda tmp: f"{tmp}/long.jsonl:2", extra=["context of 256 tokens"],
         setup=lambda tmp, mp: _write(tmp / "long.jsonl", "\n".join(
             [_pair(), _pair(LONG_PROMPT + " " + MARY, LONG_PROMPT + " " + LISA)]) + "\n")),
    Case("mmlu-csv-not-utf8", "run", _r("stages=[data]", "discovery.task=mmlu",
                                        "discovery.data_params.data_path={tmp}/q.csv"), 1,
         lambda tmp: f"{tmp}/q.csv:2", extra=["not UTF-8"],
         setup=lambda tmp, mp: _write(tmp / "q.csv", "What is 1+1?,1,2,3,4,B\nCaf\xe9?,a,b,c,d,A\n".encode("latin-1"))),
    Case("truncated-model-safetensors", "run", _r("stages=[data]", "model.name={tmp}/model"), 1,
         lambda tmp: f"{tmp}/model/model.safetensors", extra=["truncated"],
         setup=lambda tmp, mp: _model_copy(tmp, _tiny(), lambda d: _truncate(d / "model.safetensors"))),
    Case("disk-full", "run", _r("stages=[data]"), 1, "no space left",
         setup=lambda tmp, mp: _replace_stage(mp, "data", _raiser(OSError(errno.ENOSPC, "No space left on device",
                                                                          str(tmp / "run" / "data.safetensors"))))),
    Case("read-only-while-writing", "run", _r("stages=[data]"), 1, "permission denied",
         setup=lambda tmp, mp: _replace_stage(mp, "data", _raiser(OSError(errno.EROFS, "Read-only file system",
                                                                          str(tmp / "run" / "data.safetensors"))))),
    Case("stage-bug-is-one-line", "run", _r("stages=[data]"), 1, "stage 'data' failed: IndexError",
         setup=lambda tmp, mp: _replace_stage(mp, "data", _raiser(IndexError("index out of range in self")))),
    Case("ctrl-c", "run", _r("stages=[data]"), 130, "interrupted",
         setup=lambda tmp, mp: _replace_stage(mp, "data", _raiser(KeyboardInterrupt()))),
    Case("pruning-without-scores", "run", _r("stages=[pruning]"), 1, "scores.safetensors"),
    Case("manifest-not-json", "run", _r("stages=[data]", "hydra.run.dir={tmp}/prior"), 1, "manifest.json",
         extra=["not valid JSON"], setup=lambda tmp, mp: (_write(tmp / "prior" / "manifest.json", "{truncated"),
                                                          _write(tmp / "prior" / "config.json", "{}"))),
    # --- circuitkit subcommands ---------------------------------------------------------------
    Case("show-garbage", "cli", _r("show", "{tmp}/garbage.pt"), 1, "garbage.pt", extra=["cannot be read"],
         setup=lambda tmp, mp: _write(tmp / "garbage.pt", b"\x00not a torch file\xff" * 10)),
    Case("show-truncated", "cli", _r("show", "{tmp}/real.pt"), 1, "real.pt", extra=["truncated"],
         setup=lambda tmp, mp: _truncate(_saved_circuit(tmp))),
    Case("show-not-a-circuit", "cli", _r("show", "{tmp}/other.pt"), 1, "other.pt", extra=["missing head_mask"],
         setup=lambda tmp, mp: torch.save({"weights": torch.ones(2)}, tmp / "other.pt")),
    Case("show-a-tensor", "cli", _r("show", "{tmp}/tensor.pt"), 1, "tensor.pt", extra=["Tensor"],
         setup=lambda tmp, mp: torch.save(torch.ones(2), tmp / "tensor.pt")),
    Case("show-pickle-payload", "cli", _r("show", "{tmp}/evil.pt"), 1, "evil.pt",
         setup=lambda tmp, mp: torch.save({"head_mask": Path("x")}, tmp / "evil.pt")),
    Case("show-directory", "cli", _r("show", "{tmp}/prior"), 2, "prior", extra=["is a directory"]),
    Case("show-missing", "cli", _r("show", "{tmp}/missing.pt"), 1, "missing.pt", extra=["does not exist"]),
    Case("config-bad-override", "cli", _r("config", "discovery.level=edges"), 2, "discovery.level"),
    Case("config-stages-brackets-kept", "cli", _r("config", "stages=[pruning,data]"), 2, "stages=[data,pruning]"),
    Case("config-syntax", "cli", _r("config", "discovery.level=["), 2, "discovery.level=["),
    Case("smart-unknown-hub-offline", "cli", _r("discover-smart", "--model", "someorg/unknown-7b", "--algorithm",
                                                "eap-ig", "--task", "mmlu", "--check-memory"), 2,
         "someorg/unknown-7b", extra=["model.shape"]),
    Case("smart-bad-override", "cli", _r("discover-smart", "--model", "gpt2", "--algorithm", "eap-ig", "--task",
                                         "mmlu", "--check-memory", "discovery.batch_size=0"), 2,
         "discovery.batch_size"),
]


def _one_line_refusal(case: Case, tmp_path, monkeypatch, capsys) -> tuple[int, str, dict, list]:
    """Run `case` in `tmp_path` (a file written before it), check that it ends in one error line naming
    what its table says and no traceback; its exit code, that line, and the files and folders before it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CIRCUITKIT_DEBUG", raising=False)
    _write(tmp_path / "prior" / "keep.txt", "written before the command")
    if case.setup:
        case.setup(tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    dirs_before = sorted(p for p in tmp_path.rglob("*") if p.is_dir())
    argv = case.args(tmp_path)
    if case.entry == "run" and not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in argv):
        argv = [*SMALL, *argv, f"hydra.run.dir={tmp_path / 'run'}"]  # the case's values win
    code, out, err = invoke(case.entry, argv, capsys)
    assert "Traceback" not in out + err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    needle = case.needle(tmp_path) if callable(case.needle) else case.needle
    for text in [needle, *case.extra]:
        assert text in lines[0], lines[0]
    return code, lines[0], before, dirs_before


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_ends_in_one_line(case: Case, tmp_path, monkeypatch, capsys):
    code, line, before, _ = _one_line_refusal(case, tmp_path, monkeypatch, capsys)
    assert code == case.code, (code, line)
    after = _snapshot(tmp_path)
    assert {k: after.get(k) for k in before} == before  # nothing written before changed
    if code == 2:
        assert not (tmp_path / "run").exists()  # usage errors are caught before the run dir


def test_the_table_is_large_enough():
    assert len(CASES) >= 40


def test_ctrl_c_records_the_stage_as_interrupted(tmp_path, monkeypatch, capsys):
    _replace_stage(monkeypatch, "data", _raiser(KeyboardInterrupt()))
    code, _, err = invoke("run", ["stages=[data]", f"hydra.run.dir={tmp_path}", *SMALL], capsys)
    assert code == 130 and error_lines(err) == ["interrupted: interrupted (Ctrl-C); what was already written is kept."]
    entry = json.loads((tmp_path / "manifest.json").read_text())["stages"]["data"]
    assert entry["status"] == "interrupted" and entry["error"] == "interrupted (Ctrl-C)"


def test_debug_switch_shows_the_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CIRCUITKIT_DEBUG", "1")
    with pytest.raises(ConfigError, match="memory_efficient"):
        cli_main(["config", "discovery.memory_efficient=true"])


def test_help_of_every_subcommand(capsys):
    for argv in (["--help"], ["config", "--help"], ["show", "--help"], ["discover-smart", "--help"]):
        code, out, err = invoke("cli", argv, capsys)
        assert code == 0 and "usage:" in out.lower() and "Traceback" not in err, argv
    code, out, err = invoke("cli", ["run", "--help"], capsys)  # Hydra's help, with our groups
    assert code == 0 and "Configuration groups" in out and "discovery" in out and "Traceback" not in err


def test_check_memory_offline_for_the_hub_name_of_a_known_model(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = invoke("cli", ["discover-smart", "--model", "google/gemma-3-4b-it", "--algorithm", "eap-ig",
                                  "--task", "mmlu", "--check-memory"], capsys)
    assert code == 0, err[-2000:]
    assert "google/gemma-3-4b-it: eap-ig node level" in err and "weights" in err and "8201.8" in err


def test_discover_circuit_raises_clean_errors_before_any_work(tmp_path):
    from circuitkit import discover_circuit

    with pytest.raises(ConfigError, match="seed"):
        discover_circuit({"seed": 2**40, "output_path": str(tmp_path / "c.pt")})
    with pytest.raises(ConfigError, match="discovery.level=edge"):
        discover_circuit({"pruning": {"scope": "edges"}, "output_path": str(tmp_path / "c.pt")})
    with pytest.raises(UserError, match="not writable"):
        discover_circuit({"output_path": "/sys/ck/c.pt"}, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "c_run").exists()


@pytest.mark.parametrize("module,args,code,needle", [
    ("circuitkit.run", ["x=["], 2, "'x=['"),
    ("circuitkit.cli", ["show", "/nonexistent/circuit.pt"], 1, "does not exist"),
    ("circuitkit.cli", ["config", "seed=-1"], 2, "'seed'"),
])
def test_real_entry_points_end_in_one_line(module, args, code, needle, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "CIRCUITKIT_DEBUG": ""})
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


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


HOSTILE_CASES = [
    # --- GGUF files cut short (bad content: exit 1, before transformers reads a tensor) ---
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
    # --- export --format mib into a path under a file, or onto one (the command is wrong: 2) ---
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
    # --- import --scale (an argument: 2) ---------------------------------------------------
    Case("import-scale-nan", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt", "--scale", "nan"), 2, "--scale nan",
         extra=["finite number > 0"], setup=_graph_json),
    Case("import-scale-negative", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.safetensors", "--scale", "-1"), 2,
         "--scale -1", extra=["finite number > 0"], setup=_graph_json),
    Case("import-scale-inf", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt", "--scale", "inf"), 2, "--scale inf",
         setup=_graph_json),
    Case("import-source-missing", "cli", _r("import", "{tmp}/none.json", "{tmp}/out.pt"), 2, "none.json",
         extra=["does not exist"]),
    # --- a user's config file with an unknown key (the config is wrong: 2) -------------------
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


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[c.id for c in HOSTILE_CASES])
def test_hostile_input_ends_in_one_line_and_changes_nothing(case: Case, tmp_path, monkeypatch, capsys):
    code, line, before, dirs_before = _one_line_refusal(case, tmp_path, monkeypatch, capsys)
    assert "()" not in line and "ConfigKeyError" not in line, line
    assert code == case.code, (code, line)
    assert _snapshot(tmp_path) == before  # nothing changed, nothing new
    assert sorted(p for p in tmp_path.rglob("*") if p.is_dir()) == dirs_before  # no run dir, no output folder
