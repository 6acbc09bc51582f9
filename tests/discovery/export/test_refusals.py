"""Export's refusals: an export that fails or is killed mid-write leaves no folder that looks complete, a
circuit.pt with a flipped byte is bad content, an export dir overlapping the run or the model is a config
error; MIB names and `check-mib` on a missing or damaged folder end in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from circuitkit.discovery.export.hf import PROVENANCE_FILE, export_hf
from tests.discovery.export.test_export_hf import _circuit, _load
from tests.helpers.refusals import (
    SMALL,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
    invoke,
)

ROOT = Path(__file__).resolve().parents[3]


def _looks_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / PROVENANCE_FILE).is_file()


def test_an_export_that_fails_mid_write_leaves_no_folder(tmp_path, monkeypatch):
    """The model's weights are written, then the tokenizer's save fails: no `out`, no temp folder."""
    from transformers import PreTrainedTokenizerBase

    _circuit(_load("tiny-gpt2"), tmp_path / "circuit.pt")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", fail)
    with pytest.raises(OSError):
        export_hf(tmp_path / "circuit.pt", tmp_path / "out", "zero")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["circuit.pt"]


KILLED_EXPORT = """
import os, signal, sys
from transformers import PreTrainedTokenizerBase
from circuitkit.discovery.export.hf import export_hf
def die(self, folder, *a, **k):
    assert any(n.endswith(".safetensors") for n in os.listdir(folder))  # the weights are written
    os.kill(os.getpid(), signal.SIGKILL)
PreTrainedTokenizerBase.save_pretrained = die
export_hf(sys.argv[1], sys.argv[2], "zero")
"""


def test_an_export_killed_mid_write_leaves_no_folder_that_looks_complete(tmp_path):
    """SIGKILL after the weights are written: `out` does not exist; what is left is a hidden
    temp folder that holds no provenance (an earlier export there would be untouched)."""
    _circuit(_load("tiny-gpt2"), tmp_path / "circuit.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(tmp_path / "circuit.pt"), str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    left = [p for p in tmp_path.iterdir() if p.name != "circuit.pt"]
    assert all(p.name.startswith(".out.tmp-") and not (p / PROVENANCE_FILE).exists() for p in left), left


def _flip_a_byte(path: Path, text: bytes) -> None:
    """One byte of `text` in the file flipped (a flip inside tensor data is caught only by a
    recorded sha256, as a run's manifest has; torch's zip reader checks no CRC)."""
    data = bytearray(path.read_bytes())
    data[data.index(text)] ^= 0x01
    path.write_bytes(bytes(data))


def test_circuit_pt_with_a_flipped_byte_is_bad_content(tmp_path, capsys):
    _circuit(_load("tiny-gpt2"), tmp_path / "circuit.pt")
    _flip_a_byte(tmp_path / "circuit.pt", b"head_mask")
    code, _, err = invoke("cli", ["export", str(tmp_path / "circuit.pt"), "--format", "hf", str(tmp_path / "o")],
                          capsys)
    line = _one_error(err)
    assert code == 1 and "circuit.pt" in line and "not a CircuitKit circuit" in line, (code, line)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["run", "run_parent", "model", "model_sub"])
def test_export_dir_overlapping_the_run_or_the_model_is_a_config_error(where, tmp_path, monkeypatch, capsys):
    from circuitkit.fixtures.models import ensure_fixture

    monkeypatch.chdir(tmp_path)
    model = ensure_fixture("tiny-gpt2")
    target = {"run": tmp_path / "run", "run_parent": tmp_path, "model": model, "model_sub": model / "pruned"}[where]
    argv = [*SMALL, "stages=[data,attribution,pruning,export]", "export.format=hf", f"export.dir={target}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, _, err = invoke("run", argv, capsys)
    line = _one_error(err)
    assert code == 2 and "export.dir=" in line, (code, line)
    assert not (tmp_path / "run").exists() and not (model / "pruned").exists()


def test_an_unknown_mib_model_name_is_a_wrong_argument(tmp_path, capsys):
    from tests.discovery.export.test_mib_names import _scores

    src = _scores(tmp_path, "builtin:tiny-gpt2")
    code, _, err = invoke("cli", ["export", str(src), str(tmp_path / "out"), "--format", "mib", "--model", "bogus"],
                          capsys)
    line = _one_error(err)
    assert code == 2 and "--model 'bogus' is not a MIB model name" in line and "gpt2, qwen2.5, gemma2, llama3" in line
    assert not (tmp_path / "out").exists()


def test_check_mib_on_a_missing_path_is_one_error_line(tmp_path, capsys):
    code, _, err = invoke("cli", ["export", "--check-mib", str(tmp_path / "nowhere")], capsys)
    line = _one_error(err)
    assert code == 2 and "--check-mib" in line and "does not exist" in line, (code, line)


def test_check_mib_on_a_damaged_folder_ends_in_a_one_line_verdict(tmp_path, capsys):
    (tmp_path / "sub" / "ioi_gpt2").mkdir(parents=True)
    (tmp_path / "sub" / "ioi_gpt2" / "importances.json").write_text("garbage{")
    (tmp_path / "sub" / "ioi_bogus").mkdir()
    (tmp_path / "sub" / "ioi_bogus" / "importances.json").write_text('{"a": NaN}')
    code, out, err = invoke("cli", ["export", "--check-mib", str(tmp_path / "sub")], capsys)
    assert code == 1 and "Traceback" not in err
    assert out.splitlines()[-1] == f"{tmp_path / 'sub'}: not ready for MIB: 2 problem(s), listed above"
