"""Architecture adapters on tiny random models of every family."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from circuitkit.models.adapters import UnsupportedArchitectureError, get_adapter
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from tests.helpers.named_hooks import hook_names, hooks, run_with_cache

FAMILIES = {"tiny-gpt2": "gpt2", "tiny-neox": "gpt_neox", "tiny-neox-seq": "gpt_neox", "tiny-llama": "llama",
            "tiny-qwen2": "llama", "tiny-gemma3": "gemma3", "tiny-gemma3-cg": "gemma3", "tiny-qwen3": "qwen3",
            "tiny-qwen3-moe": "qwen3_moe"}


@functools.cache
def loaded(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))


def _ids(lm, n: int = 2, t: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, len(lm.tokenizer) - 20, (n, t), generator=g)


@pytest.mark.parametrize("name", FAMILIES)
def test_adapter_shape_and_frozen_parameters(name):
    lm = loaded(name)
    a = lm.adapter
    assert a.family == FAMILIES[name]
    assert a.n_layers == len(a.blocks) >= 2
    assert a.n_heads % a.n_kv_heads == 0
    if name in ("tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-gemma3-cg", "tiny-qwen3", "tiny-qwen3-moe"):
        assert a.n_kv_heads < a.n_heads  # the fixtures use GQA
    assert a.parallel_residual == (name == "tiny-neox")
    assert a.has_post_norms == name.startswith("tiny-gemma3")
    assert all(not p.requires_grad for p in lm.model.parameters())
    assert a.shape()["vocab_size"] == a.unembed.weight.shape[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_hooks_leave_logits_bit_identical(name):
    lm = loaded(name)
    ids = _ids(lm)
    with torch.no_grad():
        reference = lm.model(input_ids=ids).logits
        seen = []
        with hooks(lm.adapter, {n: (lambda v, n: seen.append(n)) for n in hook_names(lm.adapter)}):
            read_only = lm.model(input_ids=ids).logits
        # Hooks that hand back a (new) tensor force the merge paths (q/k/v re-assembly, z reshape).
        with hooks(lm.adapter, {n: (lambda v, n: v.clone()) for n in hook_names(lm.adapter)}):
            rewritten = lm.model(input_ids=ids).logits
    assert set(seen) == set(hook_names(lm.adapter))
    assert torch.equal(reference, read_only)
    assert torch.equal(reference, rewritten)


@pytest.mark.parametrize("name", FAMILIES)
def test_per_head_qkv_match_weights(name):
    lm = loaded(name)
    a = lm.adapter
    ids = _ids(lm)
    names = [f"blocks.{layer}.{s}" for layer in range(a.n_layers)
             for s in ("hook_resid_pre", "hook_attn_in", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
                       "hook_attn_out")]
    with torch.no_grad():
        _, cache = run_with_cache(a, ids, names)
    for layer in range(a.n_layers):
        w = a.qkv_weights(layer)
        x = cache[f"blocks.{layer}.hook_attn_in"]
        for part, weight, bias, n in (("q", w.w_q, w.b_q, a.n_heads), ("k", w.w_k, w.b_k, a.n_kv_heads),
                                      ("v", w.w_v, w.b_v, a.n_kv_heads)):
            direct = torch.einsum("btd,hed->bthe", x, weight) + (0 if bias is None else bias)
            got = cache[f"blocks.{layer}.attn.hook_{part}"]
            assert got.shape == (*ids.shape, n, a.head_dim)
            torch.testing.assert_close(got, direct, rtol=1e-5, atol=1e-5)
        # the attention norm as maths equals the module
        spec = a.norm_spec(a.attn_norm(layer))
        torch.testing.assert_close(spec.apply(cache[f"blocks.{layer}.hook_resid_pre"]), x, rtol=1e-5, atol=1e-5)
        # per-head W_O rebuilds what attention writes (before Gemma's post-norm)
        if not a.has_post_norms:
            w_o, b_o = a.o_weights(layer)
            z = cache[f"blocks.{layer}.attn.hook_z"]
            write = torch.einsum("bthe,hde->btd", z, w_o) + (0 if b_o is None else b_o)
            torch.testing.assert_close(write, cache[f"blocks.{layer}.hook_attn_out"], rtol=1e-5, atol=1e-5)


def test_ablating_a_head_through_z_changes_logits():
    lm = loaded("tiny-llama")
    ids = _ids(lm)
    with torch.no_grad():
        ref = lm.model(input_ids=ids).logits

        def zero_head0(z, name):
            z = z.clone()
            z[..., 0, :] = 0
            return z
        with hooks(lm.adapter, {"blocks.1.attn.hook_z": zero_head0}):
            ablated = lm.model(input_ids=ids).logits
    assert not torch.allclose(ref, ablated)


def test_unknown_hook_name_and_unsupported_architecture_are_clear_errors():
    lm = loaded("tiny-gpt2")
    with pytest.raises(KeyError, match="blocks.0.attn.hook_z"):
        with hooks(lm.adapter, {"blocks.0.attn.hook_zz": lambda v, n: None}):
            pass
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                 vocab_size=50))
    with pytest.raises(UnsupportedArchitectureError, match="GPT-2.*GPT-NeoX.*Llama.*Gemma 3"):
        get_adapter(model)


def test_precision_warning_and_bfloat16_default(caplog):
    with caplog.at_level("WARNING"):
        lm = load_model(ModelConfig(name="builtin:tiny-gpt2"))
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    assert "precision" not in caplog.text
    with caplog.at_level("WARNING"):
        load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32"))
    assert "model.precision=float32" in caplog.text


def test_unknown_builtin_names_the_available_ones():
    with pytest.raises(ValueError, match="builtin:tiny-gpt2"):
        load_model(ModelConfig(name="builtin:nope"))


def test_every_model_yaml_names_a_known_family_and_an_unknown_one_is_refused():
    # model.shape.family is the name of a family module (circuitkit/models/families/).
    from omegaconf import OmegaConf

    from circuitkit.models.adapters import FAMILIES, MODEL_TYPE_FAMILIES, family

    assert set(MODEL_TYPE_FAMILIES.values()) == set(FAMILIES)
    conf = Path(__file__).resolve().parents[2] / "conf" / "model"
    for path in conf.glob("*.yaml"):
        fam = OmegaConf.load(path).get("shape", {}).get("family")
        assert fam is None or fam in FAMILIES, path
    with pytest.raises(ValueError, match="unknown; known: gpt2, gpt_neox, llama, gemma3"):
        family("bert")
