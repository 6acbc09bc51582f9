"""`gradian diagnose`'s refusals: an empty dataset and bad trainer arguments name the file (and the key);
the tokenizer's long-row warning stays off the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.refusals import (
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("content", ["", "\n\n   \n\n"])
def test_diagnose_of_an_empty_dataset_names_the_file(content, tmp_path, capsys):
    from circuitkit_app.gradian_cli import main

    (tmp_path / "train.jsonl").write_text(content)
    capsys.readouterr()
    code = main(["diagnose", "--dataset", str(tmp_path / "train.jsonl")])
    line = _one_error(capsys.readouterr().err)
    assert code == 1 and "train.jsonl" in line and "holds no rows" in line, (code, line)


@pytest.mark.parametrize(("key", "value", "needle"), [("learning_rate", "fast", "learning_rate is 'fast'"),
                                                      ("max_steps", int("9" * 400), "max_steps is 9999"),
                                                      ("num_train_epochs", float("nan"), "num_train_epochs is nan"),
                                                      ("max_seq_length", 512.5, "max_seq_length is 512.5")])
def test_diagnose_trainer_args_name_the_file_and_the_key(key, value, needle, tmp_path, capsys):
    from circuitkit_app.gradian_cli import main

    (tmp_path / "train.jsonl").write_text('{"prompt": "a ", "completion": "b"}\n')
    (tmp_path / "args.json").write_text(json.dumps({key: value, "per_device_train_batch_size": 4}))
    capsys.readouterr()
    code = main(["diagnose", "--dataset", str(tmp_path / "train.jsonl"), "--trainer-args", str(tmp_path / "args.json")])
    line = _one_error(capsys.readouterr().err)
    assert code == 1 and "args.json" in line and needle in line and len(line) < 300, (code, line)


def test_diagnose_keeps_the_tokenizers_long_row_warning_off_the_terminal(tmp_path):
    from circuitkit.fixtures.models import ensure_fixture

    model = ensure_fixture("tiny-gpt2")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "word " * 3000, "completion": "end"}) + "\n")
    script = ("import sys; from gradian.cli import main; sys.exit(main(['diagnose', '--dataset', sys.argv[1],"
              " '--model', sys.argv[2], '--json']))")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "train.jsonl"), str(model)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "Token indices sequence length" not in proc.stderr + proc.stdout
    assert json.loads(proc.stdout) is not None
