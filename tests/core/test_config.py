"""Strict config: bad keys, types and ranges fail before any work with actionable messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from circuitkit.core.config import ConfigError, iter_keys
from circuitkit_app.config import ALL_STAGES, DEFAULT_STAGES, AppConfig, compose, validate


def test_defaults_compose_and_validate():
    cfg, typed = compose([])
    assert typed.model.name == "builtin:tiny-gpt2"
    assert typed.model.precision == "auto"  # bfloat16 where native, else float32
    assert typed.model.trust_remote_code is False
    assert typed.discovery.algorithm == "eap-ig" and typed.discovery.ig_steps == 5
    assert typed.stages == list(DEFAULT_STAGES) == [s for s in ALL_STAGES if s != "attribute"]


@pytest.mark.parametrize("group,name,hub", [
    ("model", "gpt2", "openai-community/gpt2"), ("model", "pythia70m", "EleutherAI/pythia-70m"),
    ("model", "llama1b", "meta-llama/Llama-3.2-1B"), ("model", "llama3b", "meta-llama/Llama-3.2-3B"),
    ("model", "gemma4b", "google/gemma-3-4b-it")])
def test_named_models_carry_hub_name_and_shape(group, name, hub):
    _, typed = compose([f"{group}={name}"])
    shape = typed.model.shape
    assert typed.model.name == hub
    assert all(v is not None for v in vars(shape).values()), shape
    assert shape.n_heads * shape.head_dim >= shape.d_model // 2
    assert shape.n_heads % shape.n_kv_heads == 0


def test_eap_group_is_ig_steps_one():
    _, typed = compose(["discovery=eap"])
    assert typed.discovery.algorithm == "eap" and typed.discovery.ig_steps == 1


def test_grads_off_disables_the_stage():
    _, typed = compose(["grads=off"])
    assert typed.grads.enabled is False and typed.grads.batch_size == 8


@pytest.mark.parametrize("override,must_mention", [
    ("discovery.memory_efficient=true", ["discovery.memory_efficient", "Valid keys of 'discovery'", "batch_size"]),
    ("+discovery.use_half_precision_activations=true",
     ["discovery.use_half_precision_activations", "Valid keys of 'discovery'"]),
    ("discovery.ig_steps=0", ["discovery.ig_steps", "0", ">= 1", "null"]),
    ("pruning.target_sparsity=1.5", ["pruning.target_sparsity", "1.5", "< 1.0"]),
    ("grads.storage_dtype=int3", ["grads.storage_dtype", "int3", "float16", "bfloat16", "float32"]),
    ("discovery.data_params.batch_size=4", ["discovery.data_params.batch_size", "discovery.batch_size",
                                            "num_examples"]),
    ("discovery.data_params.n_examples=64", ["Did you mean 'discovery.data_params.num_examples'"]),
    ("discovery.ig_step=3", ["Did you mean 'discovery.ig_steps'"]),
    ("discovery.ig_steps=abc", ["discovery.ig_steps", "'abc'", "integer"]),
    ("discovery.batch_size=0", ["discovery.batch_size", ">= 1"]),
    ("model.precision=fp8", ["model.precision", "bfloat16"]),
    ("model.trust_remote_code=maybe", ["model.trust_remote_code", "true or false"]),
    ("stages=[data,graphs]", ["stages", "graphs"]),
    ("grads.shard_index=3", ["grads.shard_index", "num_shards"]),
    ("preflight.on_exceed=ignore", ["preflight.on_exceed", "'error'", "'warn'"]),
    ("devices=cuda", ["Unknown config key 'devices'", "top level"]),
])
def test_bad_override_is_an_error_naming_key_value_and_allowed(override, must_mention):
    with pytest.raises(ConfigError) as info:
        compose([override])
    for text in must_mention:
        assert text in str(info.value), (text, str(info.value))


def test_stages_out_of_order_and_sweep_values_are_checked():
    with pytest.raises(ConfigError, match="pipeline order"):
        compose(["stages=[attribution,data]"])
    from circuitkit_app.config import check_overrides

    check_overrides(["discovery.batch_size=1,2,4"])  # a valid sweep
    with pytest.raises(ConfigError, match="discovery.batch_size"):
        check_overrides(["discovery.batch_size=1,0,4"])


def test_null_ig_steps_is_allowed_and_means_backend_default():
    _, typed = compose(["discovery.ig_steps=null"])
    assert typed.discovery.ig_steps is None


def test_plain_dict_validation_catches_unknown_and_misplaced_keys():
    good = validate({"model": {"name": "gpt2"}, "discovery": {"batch_size": 1, "data_params": {"num_examples": 64}}})
    assert good.discovery.batch_size == 1 and good.discovery.data_params.num_examples == 64
    with pytest.raises(ConfigError, match="belongs at discovery.batch_size"):
        validate({"discovery": {"data_params": {"batch_size": 1}}})
    with pytest.raises(ConfigError, match="model.device"):
        validate({"model": {"device": "cuda"}})


def test_every_schema_key_has_documentation():
    for path, _tp, meta in iter_keys(AppConfig):
        assert meta.get("doc"), path


def test_cli_rejects_bad_key_fast_with_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "discovery.memory_efficient=true",
                           f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "discovery.memory_efficient" in proc.stderr and "Valid keys" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
