"""What the refusal tables of the entry points share: a `Case` (argv, exit status, the text the one error
line names), `invoke` (an entry point in process), `error_lines`, the inputs the cases damage, and the
fixtures that keep loggers and the hub's offline state from leaking between in-process runs.
A fixture imported into a test module is active there (the autouse ones for every test in it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from circuitkit.fixtures.gguf import ensure_gguf_fixture
from circuitkit_app.cli import main as cli_main
from circuitkit_app.run import main as run_main
from circuitkit_app.stage_list import PIPELINE

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


def _gguf_bytes() -> bytes:
    return ensure_gguf_fixture("tiny-llama", "Q4_1").read_bytes()  # 158,400 bytes; tensor data from 29,120


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(autouse=True)
def _loggers_on_this_tests_stderr(capsys, monkeypatch):
    """Hydra's job logging leaves handlers on an earlier test's captured stream (closed or not);
    a real command is one process and never meets this. Point every stream handler here, and
    let a handler still left on a closed capture drop its record instead of printing a trace."""
    monkeypatch.setattr("logging.raiseExceptions", False)
    import logging
    import sys

    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream not in (sys.stderr, sys.stdout):
                handler.stream = sys.stderr


@pytest.fixture(autouse=True)
def _hub_state():
    """Each test decides online/offline afresh, and leaves the process as it found it (going
    offline sets environment variables and the hub libraries' constants)."""
    import os
    import sys

    from circuitkit.core import hub

    env = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    constants = sys.modules.get("huggingface_hub.constants")
    offline = getattr(constants, "HF_HUB_OFFLINE", None)
    hub.forget()
    yield
    hub.forget()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if constants is not None:
        constants.HF_HUB_OFFLINE = offline


@pytest.fixture(autouse=True)
def _cache(monkeypatch):
    _tiny()  # built once, before the snapshot
