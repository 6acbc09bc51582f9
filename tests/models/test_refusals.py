"""Model inputs refused with one line naming the file: a GGUF file cut anywhere or with a garbled length,
a damaged LoRA adapter or one for another base model (before the model loads), a NaN weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from circuitkit.models.gguf import GGUFError, read_gguf_header
from tests.helpers.refusals import (
    SMALL,
    _gguf_bytes,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
    _write,
    invoke,
)


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


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    pytest.importorskip("peft")
    from tests.models.test_lora_adapter import make_adapter

    return make_adapter("tiny-gpt2", tmp_path_factory.mktemp("lora") / "lora", ["c_attn"], seed=1)




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
