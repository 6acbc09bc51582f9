"""Trustworthy runs (issue 12, CircuitKit and pipeline half): bad inputs and faults.

The table drives `python -m circuitkit.run` and `circuitkit ...` in process. Every case asserts
the exit status, exactly one error line that names the thing, no traceback, and that nothing
written before the command changed (and, for usage errors, that no run directory was made).
The tests after the table cover what a table row cannot: stale-result detection, sweeps,
reproducible bytes, the interrupted stage in manifest.json.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from circuitkit.core import pipeline
from circuitkit.core.config import ConfigError
from circuitkit.core.errors import UserError
from circuitkit_app.cli import main as cli_main
from circuitkit_app.config import compose
from circuitkit_app.run import main as run_main
from circuitkit_app.stage_list import PIPELINE, run_pipeline

SMALL = ["discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=2",
         "discovery.data_params.seq_len=16", "model.precision=float32", "discovery.ig_steps=2"]
LONG_PROMPT = " ".join(["word"] * 300)


MARY = "When Mary and John went to the store, John gave a drink to"
LISA = "When Mary and John went to the store, Lisa gave a drink to"


def _pair(clean: str = MARY, corrupted: str = LISA, correct: str = " Mary", incorrect: str = " John") -> str:
    """A JSONL row of the jsonl task whose answers are single tokens for the tiny GPT-2."""
    return json.dumps({"clean": clean, "corrupted": corrupted, "correct": correct, "incorrect": incorrect})


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def _model_copy(tmp: Path, tiny_dir: Path, damage: Callable[[Path], None] | None = None) -> Path:
    target = tmp / "model"
    shutil.copytree(tiny_dir, target)
    if damage:
        damage(target)
    return target


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _saved_circuit(tmp: Path) -> Path:
    from circuitkit.discovery.circuit import save_circuit

    return save_circuit(tmp / "real.pt", {
        "model_name": "m", "head_mask": torch.ones(2, 2, dtype=torch.bool), "head_scores": torch.zeros(2, 2),
        "ablation": "zero", "rank_by": "abs", "target_sparsity": 0.0, "achieved_sparsity": 0.0})


def _replace_stage(monkeypatch, name: str, run: Callable) -> None:
    stage = PIPELINE.stages[name]
    monkeypatch.setitem(PIPELINE.stages, name, dataclasses.replace(stage, run=run))


def _raiser(exc: BaseException) -> Callable:
    def run(ctx):
        raise exc
    return run


@dataclass
class Case:
    """One bad input: `args(tmp)` for the entry point, the exit status, text the error names."""

    id: str
    entry: str  # "run" (python -m circuitkit.run, run dir = tmp/run) or "cli" (circuitkit ...)
    args: Callable[[Path], list[str]]
    code: int
    needle: str | Callable[[Path], str]
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None
    extra: list[str] = field(default_factory=list)  # more text the error line must contain


def _r(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [a.format(tmp=tmp) for a in args]


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


@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr(capsys):
    """Loggers configured in an earlier test (transformers', Hydra's) still hold that test's
    captured stderr, closed by now; writing there prints '--- Logging error ---' with a trace.
    A real command is one process and never meets this."""
    import logging
    import sys

    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one


def _tiny() -> Path:
    from circuitkit.fixtures.models import ensure_fixture

    return ensure_fixture("tiny-gpt2")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def invoke(entry: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """Run an entry point in process; (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = (run_main if entry == "run" else cli_main)(argv)
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("error:", "interrupted:"))]


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
        argv = [*SMALL, *argv, f"hydra.run.dir={tmp_path / 'run'}"]  # the case's values win
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


# --------------------------------------------------------------------------- discover_circuit

def test_discover_circuit_raises_clean_errors_before_any_work(tmp_path):
    from circuitkit import discover_circuit

    with pytest.raises(ConfigError, match="seed"):
        discover_circuit({"seed": 2**40, "output_path": str(tmp_path / "c.pt")})
    with pytest.raises(ConfigError, match="discovery.level=edge"):
        discover_circuit({"pruning": {"scope": "edges"}, "output_path": str(tmp_path / "c.pt")})
    with pytest.raises(UserError, match="not writable"):
        discover_circuit({"output_path": "/sys/ck/c.pt"}, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "c_run").exists()


# --------------------------------------------------------------------------- stale results

def _data_cfg(tmp: Path, data: Path, *more: str):
    return compose(["stages=[data]", "discovery.task=jsonl", f"discovery.data_params.data_path={data}",
                    "discovery.data_params.num_examples=2", "discovery.data_params.eval_examples=1",
                    "model.precision=float32", *more])[1]


def _ran(manifest: dict, name: str) -> bool:
    return not manifest["stages"][name].get("skipped_on_rerun")


def test_changed_data_file_reruns_the_stage_and_touched_one_does_not(tmp_path):
    from circuitkit.discovery.tasks import TaskData

    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    run_dir = tmp_path / "run"
    run_pipeline(_data_cfg(tmp_path, data), run_dir)
    first = TaskData.load(run_dir / "data.safetensors")

    os.utime(data, ns=(1, 1))  # same bytes, new mtime: skipped, and the new mtime is recorded
    manifest = run_pipeline(_data_cfg(tmp_path, data), run_dir)
    assert not _ran(manifest, "data")
    record = manifest["stages"]["data"]["inputs"]["discovery.data_params.data_path"]
    assert record["mtime_ns"] == 1 and len(record["sha256"]) == 64

    _write(data, "\n".join([_pair(MARY.replace("store", "park"), LISA.replace("store", "park"))] * 3) + "\n")
    manifest = run_pipeline(_data_cfg(tmp_path, data), run_dir)
    assert _ran(manifest, "data")
    assert not torch.equal(TaskData.load(run_dir / "data.safetensors").clean_ids, first.clean_ids)


def test_same_size_and_mtime_uses_the_recorded_hash(tmp_path, monkeypatch):
    """The fast path: a file whose size and mtime match its record is not read again."""
    from circuitkit.core import fingerprint

    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    record = fingerprint.Fingerprinter().file(data)
    hashed = []
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p: hashed.append(p) or "x" * 64)
    assert fingerprint.Fingerprinter([record]).file(data)["sha256"] == record["sha256"] and hashed == []
    os.utime(data, ns=(5, 5))
    assert fingerprint.Fingerprinter([record]).file(data)["sha256"] == "x" * 64 and len(hashed) == 1


def test_retrained_model_in_the_same_directory_reruns(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model_copy(tmp_path, _tiny())
    data = _write(tmp_path / "pairs.jsonl", "\n".join([_pair()] * 3) + "\n")
    run_dir = tmp_path / "run"
    cfg = _data_cfg(tmp_path, data, f"model.name={model}")
    run_pipeline(cfg, run_dir)
    assert not _ran(run_pipeline(cfg, run_dir), "data")
    weights = load_file(model / "model.safetensors")
    weights = {k: v + 1e-3 for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    manifest = run_pipeline(cfg, run_dir)
    assert _ran(manifest, "data")
    assert "model/model.safetensors" in manifest["stages"]["data"]["inputs"]


def test_upstream_artifact_changed_by_another_run_reruns_the_consumer(tmp_path, monkeypatch):
    calls = []
    stage = PIPELINE.stages["attribution"]

    def fake_attribution(ctx):
        calls.append(1)
        out = ctx.run_dir / "scores.txt"
        out.write_text((ctx.run_dir / "data.safetensors").read_bytes().hex()[:64])
        return pipeline.StageResult([out], {})
    monkeypatch.setitem(PIPELINE.stages, "attribution", dataclasses.replace(stage, run=fake_attribution))
    base = ["discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=2",
            "discovery.data_params.seq_len=16", "model.precision=float32"]
    run_pipeline(compose(["stages=[data]", *base])[1], tmp_path)
    attr = compose(["stages=[attribution]", *base])[1]
    run_pipeline(attr, tmp_path)
    run_pipeline(attr, tmp_path)
    assert len(calls) == 1
    run_pipeline(compose(["stages=[data]", "seed=3", *base])[1], tmp_path)  # new data.safetensors
    manifest = run_pipeline(attr, tmp_path)
    assert len(calls) == 2 and _ran(manifest, "attribution")


def test_changed_grads_data_rebuilds_the_run_index(tmp_path):
    rows = [json.dumps({"prompt": f"Q{i}: ", "completion": f"A{i}"}) for i in range(6)]
    data = _write(tmp_path / "train.jsonl", "\n".join(rows) + "\n")
    cfg = compose(["stages=[grads]", f"grads.data_path={data}", "grads.projection_dim=16",
                   "model.precision=float32"])[1]
    first = run_pipeline(cfg, tmp_path / "run")
    assert first["stages"]["grads"]["summary"]["rows_stored"] == 6
    _write(data, "\n".join(rows[:3]) + "\n")
    second = run_pipeline(cfg, tmp_path / "run")
    assert second["stages"]["grads"]["summary"]["rows_stored"] == 3


# --------------------------------------------------------------------------- sweeps

def test_a_bad_job_is_a_failed_row_and_the_sweep_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    sweep = tmp_path / "sweep"
    code, _, err = invoke("run", ["-m", "stages=[data]", "grads.num_shards=2", "grads.shard_index=2,0,1",
                                  f"hydra.sweep.dir={sweep}", *SMALL], capsys)
    assert code == 1 and "Traceback" not in err
    assert error_lines(err)[-1].startswith("error: 1 of 3 sweep jobs failed")
    with open(sweep / "sweep_summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["failed", "ok", "ok"]
    assert "grads.shard_index" in rows[0]["error"] and rows[1]["data.num_examples"] == "4"
    table = err[err.index("sweep summary"):err.index("error: 1 of 3")].splitlines()
    assert any("stages=[data]" in line for line in table)  # brackets survive rich markup
    header = next(line for line in table if "overrides" in line)
    assert "…" not in header and "peak MiB" in header and "result" in header  # readable at 120 columns
    assert all(len(line) <= 120 for line in table), table


def test_a_job_failing_in_a_stage_does_not_stop_the_others(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    code, _, err = invoke("run", ["-m", "stages=[data]", "discovery.data_params.seq_len=1000,16",
                                  f"hydra.sweep.dir={sweep}", *SMALL[:2], "model.precision=float32"], capsys)
    assert code == 1
    with open(sweep / "sweep_summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["failed", "ok"] and "256" in rows[0]["error"]


def test_write_summary_escapes_markup_and_shows_one_result(tmp_path):
    from rich.console import Console

    from circuitkit.core.sweep import write_summary

    console = Console(record=True, width=120)
    rows = [{"job": "0", "overrides": "stages=[data,pruning] seed=1", "status": "ok", "wall_s": 1.5,
             "peak_mib": 3.0, "pruning.faithfulness": 0.8123, **{f"x.col{i}": i for i in range(14)}}]
    write_summary(tmp_path, rows, console)
    text = console.export_text()
    assert "stages=[data,pruning]" in text and "pruning.faithfulness 0.8123" in text and "col3" not in text
    assert "x.col13" in (tmp_path / "sweep_summary.csv").read_text()


# --------------------------------------------------------------------------- reproducible bytes

def test_two_identical_runs_write_identical_bytes(tmp_path):
    cfg = compose(["stages=[data,attribution,pruning]", *SMALL])[1]
    for name in ("a", "b"):
        run_pipeline(cfg, tmp_path / name)
    for artifact in ("circuit.pt", "data.safetensors", "scores.safetensors"):
        assert (tmp_path / "a" / artifact).read_bytes() == (tmp_path / "b" / artifact).read_bytes(), artifact
    assert torch.load(tmp_path / "a" / "circuit.pt", weights_only=True)["head_mask"].dtype == torch.bool


def test_safetensors_bytes_do_not_depend_on_metadata_order(tmp_path):
    from safetensors import safe_open

    from circuitkit.core.io import atomic_save_safetensors

    t = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    meta = {f"k{i}": str(i) for i in range(20)}
    one = atomic_save_safetensors(tmp_path / "one.safetensors", t, meta)
    two = atomic_save_safetensors(tmp_path / "two.safetensors", dict(reversed(t.items())),
                                  dict(reversed(meta.items())))
    assert one.read_bytes() == two.read_bytes()
    with safe_open(str(one), framework="pt") as fh:
        assert fh.metadata() == meta and torch.equal(fh.get_tensor("b"), t["b"])


def test_torch_save_bytes_do_not_depend_on_the_file_name(tmp_path):
    from circuitkit.core.io import atomic_torch_save

    obj = {"x": torch.arange(4)}
    a, b = atomic_torch_save(tmp_path / "a.pt", obj), atomic_torch_save(tmp_path / "other_name.pt", obj)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    from circuitkit.core.io import atomic_write_json

    old = os.umask(umask)
    try:
        path = atomic_write_json(tmp_path / "m.json", {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


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
