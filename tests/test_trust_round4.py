"""Trust, round four: the newer surfaces (export, report, adapters, the eigen projection, the
gradian commands' flags, diagnose, MIB names, provenance) end in the project's exit code (2: a
wrong command, argument or config, nothing ran; 1: bad file content or a failed stage) and one
error line that names the file, key or flag and what to do; an export is atomic by construction.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from circuitkit.discovery.export.hf import PROVENANCE_FILE, export_hf
from tests.discovery.export.test_export_hf import _circuit, _load
from tests.test_trust_pipeline import (
    SMALL,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    error_lines,
    invoke,
)

ROOT = Path(__file__).resolve().parents[1]


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- export


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


# ----------------------------------------------------------------------------- report


def _hand_run(run: Path, output_path: str | None, artifacts: dict | None = None) -> Path:
    """A run directory with only a manifest.json, as a run writes it (config, stages)."""
    from circuitkit.core.config import to_dict
    from circuitkit_app.config import AppConfig

    run.mkdir(parents=True, exist_ok=True)
    config = {**to_dict(AppConfig()), "output_path": output_path}
    stages = {"pruning": {"status": "ok", "artifacts": artifacts or {}}}
    (run / "manifest.json").write_text(json.dumps({"config": config, "stages": stages, "status": "ok"}))
    return run


@pytest.mark.parametrize("how", ["edited_output_path", "link_to_outside"])
def test_report_reads_only_the_runs_own_artifacts(how, tmp_path, capsys):
    run = tmp_path / "run"
    if how == "edited_output_path":
        _hand_run(run, "/etc/passwd")
    else:  # circuit.pt in the run directory is a link to a file outside it
        _hand_run(run, None)
        (run / "circuit.pt").symlink_to("/etc/passwd")
    code, _, err = invoke("cli", ["report", str(run)], capsys)
    line = _one_error(err)
    assert code == 1 and "outside the run directory" in line and "manifest.json" in line, (code, line)
    assert "/etc/passwd" in line or "circuit.pt" in line
    assert not (run / "report.html").exists()


def test_report_reads_a_recorded_output_path_outside_the_run(tmp_path, capsys):
    """output_path elsewhere is the run's own artifact when its stage recorded it (with its sha256)."""
    from circuitkit.core.io import sha256_file

    circuit = tmp_path / "elsewhere" / "circuit.pt"
    circuit.parent.mkdir()
    _circuit(_load("tiny-gpt2"), circuit)
    run = _hand_run(tmp_path / "run", str(circuit), {str(circuit): {"sha256": sha256_file(circuit)}})
    code, _, err = invoke("cli", ["report", str(run)], capsys)
    assert code == 0, err[-2000:]
    assert 'id="circuit"' in (run / "report.html").read_text()


# ----------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    from tests.models.test_lora_adapter import make_adapter

    return make_adapter("tiny-gpt2", tmp_path_factory.mktemp("lora") / "lora", ["c_attn"], seed=1)


@pytest.fixture
def no_load(monkeypatch):
    """Every refusal of an adapter comes before the model loads."""
    import circuitkit.models.loading
    import gradian.build.indexer

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the adapter was checked")
    for module in (circuitkit.models.loading, gradian.build.indexer):
        monkeypatch.setattr(module, "load_model", refuse)


def _adapter_copy(src: Path, dst: Path, config: dict | None = None, weights=None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        stored = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**stored, **config}))
    if weights is not None:
        path = dst / "adapter_model.safetensors"
        path.write_bytes(weights(path.read_bytes()))
    return dst


def _gradian_index(tmp_path: Path, adapter: Path, capsys) -> tuple[int, str]:
    from circuitkit_app.gradian_cli import main

    capsys.readouterr()
    code = main(["index", "model.name=builtin:tiny-gpt2", f"model.adapter={adapter}", "model.precision=float32",
                 f"grads.index_dir={tmp_path / 'idx'}"])
    return code, _one_error(capsys.readouterr().err)


ADAPTER_CONTENT = {
    "truncated_weights": (None, lambda b: b[: len(b) // 2], "adapter_model.safetensors"),
    "garbage_header": (None, lambda b: b"\xff" * 8 + b[8:], "adapter_model.safetensors"),
    "lora_alpha_nan": ({"lora_alpha": float("nan")}, None, "lora_alpha is nan"),
    "lora_alpha_inf": ({"lora_alpha": float("inf")}, None, "lora_alpha is inf"),
    "r_zero": ({"r": 0}, None, "r is 0"),
    "r_absurd": ({"r": 10**12}, None, "r is 1000000000000"),
    "r_not_a_number": ({"r": "four"}, None, "r is 'four'"),
    "rank_pattern_nan": ({"rank_pattern": {"c_attn": -3}}, None, "rank_pattern['c_attn'] is -3"),
}


@pytest.mark.parametrize("case", list(ADAPTER_CONTENT))
def test_a_damaged_adapter_is_bad_content_named_before_the_model_loads(case, lora_dir, tmp_path, capsys, no_load):
    config, weights, needle = ADAPTER_CONTENT[case]
    adapter = _adapter_copy(lora_dir, tmp_path / "lora", config, weights)
    code, line = _gradian_index(tmp_path, adapter, capsys)
    assert code == 1 and needle in line, (code, line)
    if config is not None:
        assert "adapter_config.json" in line
    assert not (tmp_path / "idx").exists()


def test_an_adapter_for_another_base_model_is_refused_before_anything_runs(tmp_path, capsys, no_load):
    """A Llama adapter on GPT-2: exit 2 from the config check, naming the adapter's base model and
    its target modules; the pipeline refuses it before the run directory exists."""
    pytest.importorskip("peft")
    from tests.models.test_lora_adapter import make_adapter

    llama = make_adapter("tiny-llama", tmp_path / "llama-lora", ["q_proj", "v_proj"], seed=3)
    code, line = _gradian_index(tmp_path, llama, capsys)
    assert code == 2 and "tiny-llama" in line and "q_proj" in line and "does not fit" in line, (code, line)
    code, _, err = invoke("run", [*SMALL, f"model.adapter={llama}", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    line = _one_error(err)
    assert code == 2 and "tiny-llama" in line and "target_modules" in line, (code, line)
    assert not (tmp_path / "run").exists()


def test_target_modules_the_model_lacks_are_refused_before_the_model_loads(lora_dir, tmp_path, capsys, no_load):
    adapter = _adapter_copy(lora_dir, tmp_path / "lora", {"target_modules": ["c_attn", "nonexistent_proj"]})
    code, line = _gradian_index(tmp_path, adapter, capsys)
    assert code == 2 and "'nonexistent_proj'" in line and "name no module" in line, (code, line)


# ----------------------------------------------------------------------------- non-finite weights and factors


def _nan_weight_model(tmp_path: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    from circuitkit.fixtures.models import ensure_fixture

    target = tmp_path / "nan-model"
    shutil.copytree(ensure_fixture("tiny-gpt2"), target)
    state = load_file(str(target / "model.safetensors"))
    state["transformer.h.1.mlp.c_fc.weight"][3, 5] = float("nan")
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_nan_weight_is_named_where_the_model_loads(tmp_path, capsys):
    """grads=signs (the eigen projection's factor pass) on a model with a NaN weight: one line naming
    the weight, exit 1, instead of linalg.eigh failing to converge."""
    from circuitkit_app.gradian_cli import main

    model = _nan_weight_model(tmp_path)
    capsys.readouterr()
    code = main(["index", f"model.name={model}", "grads=signs", "model.precision=float32",
                 f"grads.index_dir={tmp_path / 'idx'}"])
    line = _one_error(capsys.readouterr().err)
    assert code == 1 and "transformer.h.1.mlp.c_fc.weight holds NaN or infinity" in line, (code, line)


@pytest.mark.parametrize("projection", ["eigen", "whitened", "spectrum"])
def test_non_finite_factor_sums_are_refused_before_any_decomposition(projection, monkeypatch):
    from circuitkit.core.errors import UserError
    from gradian.curvature.allocation import spectrum_widths
    from gradian.curvature.factors import FactorSums
    from gradian.curvature.whitening import eigen_tensors, whitened_tensors

    def no_decomposition(*args, **kwargs):
        raise AssertionError("a decomposition ran on non-finite factors")
    for name in ("eigh", "eigvalsh"):
        monkeypatch.setattr(torch.linalg, name, no_decomposition)
    sums = FactorSums(["h.0.mlp", "h.1.mlp"])
    sums.projected = projection == "eigen"
    for name in sums.names:
        sums.a[name], sums.s[name] = torch.eye(4, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    sums.s["h.1.mlp"][1, 1] = float("inf")
    sums.tokens = 10
    call = {"eigen": lambda: eigen_tensors(None, sums, 4), "whitened": lambda: whitened_tensors(None, sums, 4),
            "spectrum": lambda: spectrum_widths({n: (3, 4) for n in sums.names}, sums, 4, 4)}[projection]
    with pytest.raises(UserError) as err:
        call()
    text = str(err.value)
    assert "output-gradient (S) sum of module h.1.mlp" in text and "NaN or infinity" in text
    assert {"eigen": "grads.projection=eigen", "whitened": "grads.projection=whitened",
            "spectrum": "grads.width_allocation=spectrum"}[projection] in text
    assert err.value.exit_code == 1


# ----------------------------------------------------------------------------- the flag sweep


def _sweep_commands():
    """(entry, base argv, parser) of every command whose numeric options the sweep covers: the parsers
    are the commands' own, so a numeric option added later is swept (and must declare its range)."""
    from circuitkit.core.flags import subparser
    from circuitkit.discovery.export import hf, interop, mib
    from gradian.cli import _parser

    gradian = _parser()
    return [
        ("gradian", ["attribute", "--index", "IDX", "--eval-dataset", "EVAL.jsonl"], subparser(gradian, "attribute")),
        ("gradian", ["rank", "--index", "IDX", "--queries", "Q.jsonl"], subparser(gradian, "rank")),
        ("gradian", ["diagnose", "--dataset", "TRAIN.jsonl"], subparser(gradian, "diagnose")),
        ("gradian", ["inspect", "IDX"], subparser(gradian, "inspect")),
        ("circuitkit", ["export", "SRC.pt", "OUT.json"], interop.export_parser()),
        ("circuitkit", ["export", "SRC.pt", "OUT", "--format", "mib", "--model", "gpt2"], mib.export_parser()),
        ("circuitkit", ["export", "SRC.pt", "OUT", "--format", "hf"], hf.export_parser()),
    ]


def _bad_values(action) -> list[str]:
    b = action.bounds
    values = ["nan", "inf", "-inf", "1e400"] if action.type is float else []
    low = b.ge if b.ge is not None else b.gt
    if low is not None:
        values.append(str(int(low) - 1) if action.type is int else repr(float(low) - (1.0 if b.ge is not None else 0)))
    if b.le is not None:
        values.append("9" * 400 if action.type is int else repr(float(b.le) * 10))
    return values


def _sweep_cases():
    from circuitkit.core.flags import flag_name, numeric_actions

    cases = []
    for entry, base, parser in _sweep_commands():
        for action in numeric_actions(parser):
            assert hasattr(action, "bounds"), f"{entry} {base[0]} {flag_name(action)} declares no range"
            for value in _bad_values(action):
                cases.append(pytest.param(entry, [*base, f"{flag_name(action)}={value}"], flag_name(action),
                                          id=f"{entry}-{base[0]}{'-' + base[-1] if '--format' in base else ''}"
                                             f"-{flag_name(action)}={value[:12]}"))
    return cases


def test_the_sweep_covers_every_numeric_option():
    from circuitkit.core.flags import flag_name, numeric_actions

    flags = {(base[0], flag_name(a)) for _, base, parser in _sweep_commands() for a in numeric_actions(parser)}
    assert {("attribute", "--lr"), ("attribute", "--seed"), ("attribute", "--lora-alpha"), ("rank", "--damping"),
            ("rank", "--top-k"), ("diagnose", "--max-seq-length"), ("export", "--d-model")} <= flags
    assert len(_sweep_cases()) >= 2 * len(flags)


@pytest.mark.parametrize(("entry", "argv", "flag"), _sweep_cases())
def test_every_numeric_flag_refuses_nan_infinity_and_out_of_range(entry, argv, flag, tmp_path, monkeypatch,
                                                                  capsys, no_load):
    from circuitkit_app.cli import main as circuitkit_main
    from circuitkit_app.gradian_cli import main as gradian_main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = (gradian_main if entry == "gradian" else circuitkit_main)(argv)
    line = _one_error(capsys.readouterr().err)
    value = argv[-1].split("=", 1)[1].replace("1e400", "inf")  # parsed as float: it is infinity
    assert code == 2 and line.startswith(f"error: {flag} ") and "it must be" in line, (code, line)
    assert len(line) < 300 and (value in line or len(value) > 24)
    assert list(tmp_path.iterdir()) == []


def test_attribute_seed_minus_one_names_the_flag(capsys):
    from circuitkit_app.gradian_cli import main

    code = main(["attribute", "--index", "IDX", "--eval-dataset", "E.jsonl", "--seed", "-1"])
    line = _one_error(capsys.readouterr().err)
    assert code == 2 and line.startswith("error: --seed -1: it must be >= 0 and <= 4294967295"), (code, line)


# ----------------------------------------------------------------------------- MIB export


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


# ----------------------------------------------------------------------------- gradian diagnose


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


# ----------------------------------------------------------------------------- sign index manifest


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


# ----------------------------------------------------------------------------- config contradictions


@pytest.mark.parametrize(("overrides", "key"), [
    (["discovery.task=ioi", "discovery.data_params.corruption=name_swap"], "discovery.data_params.corruption"),
    (["discovery.task=induction", "discovery.data_params.ioi_corruption=abc"], "discovery.data_params.ioi_corruption"),
    (["discovery.task=ioi", "discovery.data_params.induction_format=single"], "discovery.data_params.induction_format"),
    (["discovery.task=induction", "discovery.data_params.induction_format=single",
      "discovery.data_params.induction_corruption=fresh"], "discovery.data_params.induction_corruption"),
    (["discovery.task=greater_than", "discovery.data_params.data_path=mine.jsonl"], "discovery.data_params.data_path"),
    (["discovery.task=jsonl", "discovery.data_params.min_valid_share=0.9"], "discovery.data_params.min_valid_share"),
])
def test_a_data_params_key_the_task_does_not_read_is_a_config_error(overrides, key, tmp_path, capsys):
    code, _, err = invoke("run", [*SMALL, "stages=[data]", *overrides, f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    line = _one_error(err)
    assert code == 2 and line.startswith(f"error: {key}=") and "does not apply to discovery.task=" in line, line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- provenance


def _names_us(record: dict) -> None:
    from circuitkit.core.provenance import git_commit

    assert record["circuitkit-gradian"] == "0.1.0" or record["circuitkit-gradian"].startswith("0.1.0")
    assert "not installed" not in record["circuitkit-gradian"]
    assert record["git_commit"] == git_commit() and (ROOT / ".git").exists() == (record["git_commit"] is not None)


def test_a_run_records_circuitkit_gradians_version_and_commit(tmp_path, capsys):
    from circuitkit.core.circuit_file import load_circuit

    run = tmp_path / "run"
    code, _, err = invoke("run", [*SMALL, "stages=[data,attribution,pruning]", "pruning.graph=false",
                                  "pruning.bootstrap_resamples=0", f"hydra.run.dir={run}"], capsys)
    assert code == 0, err[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    _names_us(manifest["versions"])
    assert "circuitkit" not in manifest["versions"]  # PyPI's circuitkit is another project
    _names_us(load_circuit(run / "circuit.pt").versions)
    page = (run / "report.html").read_text()
    assert "circuitkit-gradian" in page and manifest["versions"]["git_commit"] in page


def test_the_index_header_and_an_export_record_the_software(tmp_path):
    from gradian.build.indexer import build_index
    from gradian.index.reader import IndexReader
    from tests.gradian.index.test_sign_rows import _cfg as sign_cfg

    cfg = sign_cfg(tmp_path)
    build_index(cfg.model, cfg.grads, tmp_path / "idx")
    _names_us(IndexReader(tmp_path / "idx").manifest["software"])
    _circuit(_load("tiny-gpt2"), tmp_path / "circuit.pt")
    provenance = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "zero")
    _names_us(provenance["software"])
    _names_us(json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["software"])


def test_an_index_written_before_the_software_was_recorded_still_reads(tmp_path):
    from gradian.build.indexer import build_index
    from gradian.index.reader import IndexReader
    from tests.gradian.index.test_sign_rows import _cfg as sign_cfg

    cfg = sign_cfg(tmp_path)
    build_index(cfg.model, cfg.grads, tmp_path / "idx")
    path = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["software"]
    path.write_text(json.dumps(manifest))
    reader = IndexReader(tmp_path / "idx")
    assert reader.manifest["software"] is None
    build_index(cfg.model, cfg.grads, tmp_path / "idx")  # a resume of the older index is the same index


@pytest.mark.slow
def test_an_installed_wheel_records_its_version_and_no_commit(tmp_path):
    """A non-editable install: the version comes from the wheel's metadata, and no commit (the package
    lives in site-packages, not in a checkout)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "wheel").glob("circuitkit_gradian-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=600)
    script = ("import json, circuitkit; from circuitkit.core.provenance import software;"
              " print(json.dumps([circuitkit.__file__, software()]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    where, record = json.loads(out)
    assert where.startswith(str(tmp_path / "site"))
    assert record == {"circuitkit-gradian": "0.1.0", "git_commit": None}


# ----------------------------------------------------------------------------- gradian doctor


def test_doctor_json_lists_every_optional_dependency_with_its_state(monkeypatch, capsys):
    import importlib.util

    from gradian import doctor

    real = importlib.util.find_spec

    def hidden(name, *args, **kwargs):  # peft and scikit-learn installed but not importable
        return None if name in ("peft", "sklearn") else real(name, *args, **kwargs)
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setattr(doctor, "self_tests", lambda: {})  # not what this test is about (seconds)
    assert doctor.main(["--json"]) == 0
    rows = {o["package"]: o for o in json.loads(capsys.readouterr().out)["optional"]}
    assert {"peft", "scikit-learn", "playwright", "ray", "datasets", "accelerate"} <= set(rows)
    for name in ("peft", "scikit-learn"):
        assert rows[name]["state"] in ("not importable", "not installed") and not rows[name]["importable"]
        assert "pip install 'circuitkit-gradian[" in rows[name]["install"]
    assert "model.adapter" in rows["peft"]["enables"] and "clusters" in rows["scikit-learn"]["enables"]
    assert all(o["enables"] and o["state"] in ("ok", "not importable", "not installed") for o in rows.values())
