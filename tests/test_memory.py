"""Memory preflight (attribution half): closed-form shapes, parameter counts and peak estimates."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from circuitkit.config import ModelConfig, ModelShape
from circuitkit.memory import count_params, estimate_attribution, shape_for, shape_from_config

REPO = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("check_memory_estimates",
                                                  REPO / "scripts" / "check_memory_estimates.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-qwen2", "tiny-gemma3"])
def test_closed_form_params_match_fixture(tiny_model, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_model(name)
    shape = shape_from_config(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape["n_params"] == sum(p.numel() for p in model.parameters())


def test_closed_form_params_match_yaml_counts():
    for name in ("gpt2", "pythia70m", "llama1b", "llama3b"):
        shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml").shape)
        assert count_params(shape) == shape["n_params"], name


def test_shape_from_yaml_is_offline(monkeypatch):
    import transformers

    def no_network(*args, **kwargs):
        raise AssertionError("shape_for must not read a config when model.shape is complete")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_network)
    raw = OmegaConf.load(REPO / "conf" / "model" / "gemma4b.yaml")
    cfg = ModelConfig(name=raw.name, shape=ModelShape(**OmegaConf.to_container(raw.shape)))
    shape = shape_for(cfg)
    assert shape["family"] == "gemma3" and shape["n_layers"] == 34 and shape["n_params"] == 4300079472


def test_shape_for_builtin_reads_config(tiny_model):
    shape = shape_for(ModelConfig(name="builtin:tiny-llama"))
    assert (shape["family"], shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]) == ("llama", 4, 2, 16)


def test_estimate_terms_and_scaling():
    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "gpt2.yaml").shape)
    est = estimate_attribution(shape, 2, 4, 32, "eap-ig", "node", 5)
    assert est.terms["weights"] == shape["n_params"] * 2
    assert est.total_bytes == sum(est.terms.values())
    assert est.table().row_count == len(est.terms) + 1
    more = estimate_attribution(shape, 2, 8, 32, "eap-ig", "node", 5)
    assert more.total_bytes > est.total_bytes
    # ig_steps changes time, not the peak (from the second point on)
    assert estimate_attribution(shape, 2, 4, 32, "eap-ig", "node", 30).total_bytes == est.total_bytes
    exact = estimate_attribution(shape, 2, 4, 32, "exact", "node", None)
    assert "activations saved for backward" not in exact.terms and exact.total_bytes < est.total_bytes


def test_quick_sweep_within_tolerance():
    script = _load_script()
    rows = script.run_sweep(quick=True)
    assert rows
    bad = [r for r in rows if abs(r.ratio - 1) > script.TOLERANCE]
    assert not bad, bad
