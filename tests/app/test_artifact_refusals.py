"""Artifacts checked against the model they are used with (scores, task data, a circuit of another model),
a user's config file checked like overrides, import/export of bad graphs, unsafe or offline models, shards
verified when merged: one error line each, nothing written before changed. Then what a table row cannot
show: Ctrl-C swallowed by a finalizer, a full disk, `| head` closing stdout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.artifacts import (
    GPT2_SMALL,
    MERGE,
    TINY,
    _change_a_value,
    _circuit,
    _confs,
    _data_file,
    _graph_json,
    _offline,
    _pickled_model,
    _raw_scores,
    _scores,
    _scores_file,
    _shards,
)
from tests.helpers.refusals import (  # noqa: F401  (autouse: hub state and loggers reset per test)
    LISA,
    LONG_PROMPT,
    MARY,
    SMALL,
    Case,
    _cache,
    _hub_state,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _loggers_on_this_tests_stderr,
    _model_copy,
    _one_error,
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
    # --- artifacts that do not fit the run's model (were exit 0 with wrong numbers) -----------
    Case("scores-of-another-model", "run", _r("stages=[data,pruning]"), 1, "12 layers x 12 heads",
         extra=["2 layers x 4 heads", "scores.safetensors", "[157, 445]", "[11, 27]"],
         setup=lambda tmp, mp: _scores_file(tmp, _scores(GPT2_SMALL))),
    Case("scores-shape-made-by-hand", "run", _r("stages=[data,pruning]"), 1, "head scores have shape [3, 4]",
         extra=["scores.safetensors", "[2, 4]"],
         setup=lambda tmp, mp: _scores_file(tmp, _scores(TINY, head=torch.zeros(3, 4)))),
    Case("scores-nan", "run", _r("stages=[data,pruning]"), 1, "non-finite", extra=["edge scores", "nan"],
         setup=lambda tmp, mp: _scores_file(tmp, _scores(TINY, edges=_scores(TINY).edges.index_put_(
             (torch.tensor(0), torch.tensor(0)), torch.tensor(float("nan")))))),
    Case("scores-inf", "run", _r("stages=[data,pruning]"), 1, "non-finite", extra=["head scores", "inf"],
         setup=lambda tmp, mp: _scores_file(tmp, _scores(TINY, head=torch.full((2, 4), float("inf"))))),
    Case("scores-truncated", "run", _r("stages=[data,pruning]"), 1, "scores.safetensors",
         extra=["cannot be read as scores"], setup=lambda tmp, mp: _truncate(_scores_file(tmp, _scores(TINY)))),
    Case("scores-garbage", "run", _r("stages=[data,pruning]"), 1, "scores.safetensors",
         extra=["cannot be read as scores"], setup=lambda tmp, mp: _write(tmp / "run" / "scores.safetensors",
                                                                         b"\x07garbage" * 40)),
    Case("scores-metadata-missing", "run", _r("stages=[data,pruning]"), 1, "scores.safetensors",
         extra=["missing metadata graph"], setup=lambda tmp, mp: _raw_scores(
             tmp, {"head_scores": torch.zeros(2, 4), "mlp_scores": torch.zeros(2), "embed_score": torch.zeros(1)}, {})),
    Case("data-of-another-tokenizer", "run", _r("stages=[attribution]"), 1, "token id 70000",
         extra=["data.safetensors", "outside the vocabulary"], setup=lambda tmp, mp: _data_file(tmp, 70000)),
    Case("data-truncated", "run", _r("stages=[attribution]"), 1, "data.safetensors",
         extra=["cannot be read as task data"], setup=lambda tmp, mp: _truncate(_data_file(tmp))),
    Case("grads-circuit-of-another-model", "run", _r("stages=[grads]", "grads.circuit={tmp}/big.pt"), 1,
         "12 layers x 12 heads", extra=["big.pt", "2 layers x 4 heads"], setup=lambda tmp, mp: _circuit(tmp, GPT2_SMALL)),
    Case("show-negative-top-edges", "cli", _r("show", "{tmp}/c.pt", "--top-edges", "-5"), 2, "--top-edges -5",
         extra=[">= 1"]),
    # --- a user's config file: checked like overrides, before the run dir ----------------------
    Case("user-config-yaml-syntax", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "bad"), 2,
         lambda tmp: f"{tmp}/conf/bad.yaml", extra=["YAML syntax error", "line 5"], setup=lambda tmp, mp: _confs(tmp)),
    Case("config-name-missing", "run", _r("--config-name", "nope"), 2, "--config-name nope",
         extra=["no nope.yaml"]),
    Case("user-config-out-of-range", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "range"), 2,
         "discovery.batch_size", extra=["out of range"], setup=lambda tmp, mp: _confs(tmp)),
    Case("user-config-scope-level-conflict", "run", _r("--config-dir", "{tmp}/conf", "--config-name", "conflict"), 2,
         "pruning.scope=edges", extra=["discovery.level=edge"], setup=lambda tmp, mp: _confs(tmp)),
    # --- import / export --------------------------------------------------------------------
    Case("import-a-json-list", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt"), 1, "JSON list",
         setup=lambda tmp, mp: _write(tmp / "g.json", "[1, 2, 3]")),
    Case("import-edges-not-an-object", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt"), 1, "'edges' is a JSON list",
         setup=lambda tmp, mp: _write(tmp / "g.json", json.dumps({"cfg": {"n_layers": 2, "n_heads": 4}, "nodes": {},
                                                                   "edges": []}))),
    Case("import-string-score", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt"), 1, "has score 'high'",
         extra=["input->logits"], setup=lambda tmp, mp: _graph_json(tmp, score="high")),
    Case("import-nan-score", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.safetensors"), 1, "has score nan",
         extra=["finite"], setup=lambda tmp, mp: _graph_json(tmp, score=float("nan"))),
    Case("import-infinite-node-score", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.safetensors"), 1,
         "node 'a0.h1' has score inf", setup=lambda tmp, mp: _graph_json(tmp, node_score=float("inf"))),
    Case("import-negative-n-layers", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt"), 1, "n_layers is -2",
         setup=lambda tmp, mp: _graph_json(tmp, n_layers=-2)),
    Case("import-not-utf8", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt"), 1, "g.json is not UTF-8",
         setup=lambda tmp, mp: _write(tmp / "g.json", '{"cfg": "caf\xe9"}'.encode("latin-1"))),
    Case("import-bad-scale", "cli", _r("import", "{tmp}/g.json", "{tmp}/out.pt", "--scale", "0"), 2, "--scale 0",
         setup=lambda tmp, mp: _graph_json(tmp)),
    Case("import-parent-is-a-file", "cli", _r("import", "{tmp}/g.json", "{tmp}/prior/keep.txt/out.pt"), 2,
         "keep.txt", extra=["is a file"], setup=lambda tmp, mp: _graph_json(tmp)),
    Case("export-parent-is-a-file", "cli", _r("export", "{tmp}/c.pt", "{tmp}/prior/keep.txt/c.json"), 2, "keep.txt",
         extra=["is a file"], setup=lambda tmp, mp: _circuit(tmp, TINY, "c.pt")),
    # --- models and data ------------------------------------------------------------------------
    Case("model-weights-a-pickle", "run", _r("stages=[data]", "model.name={tmp}/pickled"), 1,
         lambda tmp: f"{tmp}/pickled/pytorch_model.bin", extra=["refused as unsafe"],
         setup=lambda tmp, mp: _pickled_model(tmp)),
    Case("grads-row-range-past-the-end", "run", _r("stages=[grads]", "grads.data_path={tmp}/train.jsonl",
                                                   "grads.data_row_range=[5,9]", "grads.index_dir={tmp}/idx"), 1,
         "grads.data_row_range=[5, 9]", extra=["2 record(s)"],
         setup=lambda tmp, mp: _write(tmp / "train.jsonl", '{"prompt": "The cat ", "completion": "runs."}\n'
                                                          '{"prompt": "The dog ", "completion": "sleeps."}\n')),
    Case("hub-model-offline", "run", _r("stages=[data]", "model.name=someorg/unknown-7b"), 1, "someorg/unknown-7b",
         extra=["offline", "not in the local Hugging Face cache"], setup=lambda tmp, mp: _offline(mp)),
    # --- shards verified when merged ---------------------------------------------------------
    Case("merge-shard-value-changed", "cli", MERGE, 1, "shard1/attribution_shard.safetensors",
         extra=["does not have the sha256 its run recorded", "rerun shard 1"],
         setup=lambda tmp, mp: _shards(tmp, _change_a_value)),
    Case("merge-shard-without-checksum", "cli", MERGE, 1, "records no checksum for shard 1",
         setup=lambda tmp, mp: _shards(tmp, record=False)),
    Case("merge-shard-missing-metadata", "cli", MERGE, 1, "missing metadata 'graph'",
         extra=["shard1/attribution_shard.safetensors"], setup=lambda tmp, mp: _shards(tmp, meta_drop="graph")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_ends_in_one_line(case: Case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CIRCUITKIT_DEBUG", raising=False)
    _write(tmp_path / "prior" / "keep.txt", "written before the command")
    if case.setup:
        case.setup(tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
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
    assert code == case.code, (code, lines[0])
    after = _snapshot(tmp_path)
    assert {k: after.get(k) for k in before} == before  # nothing written before changed
    if code == 2 and case.entry == "run":
        assert not (tmp_path / "run").exists()


def test_ctrl_c_swallowed_by_a_finalizer_still_ends_the_run_interrupted(tmp_path, monkeypatch, capsys):
    """Ctrl-C that lands inside a weakref finalizer raises KeyboardInterrupt there, which Python
    prints as "Exception ignored" and drops; the stage returns normally. The run must still end
    with 130 and the stage recorded `interrupted`, never `ok`."""
    import os
    import signal
    import sys
    import time
    import weakref

    from circuitkit.core.pipeline import StageResult

    swallowed = []

    def cleanup():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10  # the handler runs here, inside the finalizer (at once, unless the
        while time.monotonic() < deadline:  # machine is loaded: a fixed count of loops was sometimes too short)
            pass
        swallowed.append("the finalizer went on")  # never reached: the interrupt ends the callback

    def stage(ctx):
        class Resource:
            pass
        res = Resource()
        weakref.finalize(res, cleanup)
        del res  # the finalizer runs now; its KeyboardInterrupt is "ignored" by Python
        return StageResult([], {"done": True})

    ignored = []  # what Python prints as "Exception ignored in: <finalize object ...>"
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u.exc_type))
    # The watch installs itself over Python's own handler only; an earlier test in the same process
    # may have left another one (a fresh CI venv did), so start from Python's own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _replace_stage(monkeypatch, "data", stage)
    code, _, err = invoke("run", ["stages=[data]", f"hydra.run.dir={tmp_path}", *SMALL], capsys)
    signal.signal(signal.SIGINT, previous)
    assert ignored == [KeyboardInterrupt] and not swallowed  # the interrupt really was swallowed
    assert code == 130, err[-2000:]
    entry = json.loads((tmp_path / "manifest.json").read_text())["stages"]["data"]
    assert entry["status"] == "interrupted"


def test_disk_full_names_the_file_and_leaves_no_stage_running(tmp_path, monkeypatch, capsys):
    """A write that fails with ENOSPC names no file (the OS reports none); the message must name the
    artifact, and the manifest, whose own atomic rewrite fails on the full disk too, must not be
    left saying `running`."""
    import errno

    import circuitkit.core.io as io_module
    from circuitkit.core.io import atomic_write_bytes

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises: no filename

    def stage(ctx):
        monkeypatch.setattr(io_module.Path, "write_bytes", full)  # from now on the disk is full
        atomic_write_bytes(ctx.run_dir / "data.safetensors", b"x" * 64)

    _replace_stage(monkeypatch, "data", stage)
    code, _, err = invoke("run", ["stages=[data]", f"hydra.run.dir={tmp_path}", *SMALL], capsys)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err[-2000:]
    assert "no space left on the device while writing" in lines[0]
    assert f"{tmp_path / 'data.safetensors'}'" in lines[0], lines[0]  # the artifact, not a .tmp name
    entry = json.loads((tmp_path / "manifest.json").read_text())["stages"]["data"]
    assert entry["status"] == "failed" and "no space left" in entry["error"]
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_show_top_edges_counts_from_the_strongest(tmp_path, capsys):
    """--top-edges 3 draws the three strongest edges (and -5 is refused by the table above)."""
    from circuitkit.discovery.circuit_graph import build_picture

    circuit = {"head_mask": torch.ones(2, 4, dtype=torch.bool), "mlp_mask": torch.ones(2, dtype=torch.bool),
               "head_scores": torch.ones(2, 4), "edge_scores": _scores(TINY).edges,
               "edge_mask": TINY.edge_mask(), "scope": "edges",
               "graph": {"n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "parallel_residual": False}}
    assert len(build_picture(circuit, 3).edges) == 3


def _closed_stdout_run(argv: list[str]) -> tuple[int, str]:
    """A command whose stdout reader has gone (what `| head` does once it has its lines)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=300), err


def test_config_piped_into_head_exits_quietly():
    code, err = _closed_stdout_run(["circuitkit.cli", "config"])
    assert code == 0 and err == "", err  # was: exit 1, nothing said


def test_a_broken_pipe_in_any_command_ends_quietly(capsys):
    from circuitkit.core.errors import run_entry

    def prints_to_a_gone_reader():
        raise BrokenPipeError(32, "Broken pipe")  # print() into `| head` after it exited

    def rich_on_a_gone_reader():  # what rich's Console does then: dup2 /dev/null, SystemExit(1)
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            raise SystemExit(1) from None

    assert run_entry(prints_to_a_gone_reader) == 0
    assert run_entry(rich_on_a_gone_reader) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # any other exit passes through unchanged
        run_entry(lambda: (_ for _ in ()).throw(SystemExit(3)))
