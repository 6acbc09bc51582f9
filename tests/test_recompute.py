"""Memory-saving rewrites of the gradient pass are exact: activations recomputed in the backward
(`circuitkit.models.recompute`) and the unembedding in chunks of supervised positions
(`gradian.capture.supervised_loss_grad`) give the rows of the plain one-pass computation."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.activations import NewGELUActivation

import gradian.capture as capture
from circuitkit.device import measure_peak
from circuitkit.models.adapters import get_adapter
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.recompute import recomputable_activations, recomputed_activations
from gradian.projection import Projector


def _gpt2(dtype=torch.float32, vocab=512, n_embd=64):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=n_embd, vocab_size=vocab, n_positions=128)
    return GPT2LMHeadModel(cfg).eval().to(dtype).requires_grad_(False)


def _batch(vocab: int, lengths=(40, 23, 9), prompt=5):
    g = torch.Generator().manual_seed(1)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros_like(ids)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        sup[b, prompt:n] = True
    return {"input_ids": ids, "attention_mask": mask, "supervised": sup}


def _rows(model, batch, **kw):
    adapter = get_adapter(model)
    modules = select_modules(model, adapter, ["mlp.c_proj", "attn.c_proj", "mlp.c_fc"])
    projector = Projector(module_shapes(modules), "kronecker", 16, seed=0)
    out = capture.per_example_gradients(model, adapter, modules, projector, batch, **kw)
    return out.row(), out.losses


def test_gpt2_gelu_is_recomputed_llama_silu_is_not():
    model = _gpt2()
    found = recomputable_activations(model, torch.float32)
    assert len(found) == 2 and all(isinstance(m, NewGELUActivation) for m in found)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    assert recomputable_activations(llama, torch.float32) == []  # fused F.silu keeps only its input
    with recomputed_activations(model, torch.float32) as n:
        assert n == 2 and "forward" in found[0].__dict__
    assert "forward" not in found[0].__dict__  # restored: the class's forward again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_recompute_and_chunked_loss_give_the_one_pass_rows(monkeypatch, dtype, reduction):
    model = _gpt2(dtype)
    batch = _batch(512)
    rows, losses = _rows(model, batch, loss_reduction=reduction, recompute="always")
    # The plain computation: no recompute, every supervised position unembedded in one chunk.
    monkeypatch.setattr(capture, "LOGIT_CHUNK_ELEMENTS", 10**12)
    plain_rows, plain_losses = _rows(model, batch, loss_reduction=reduction, recompute="never")
    assert torch.equal(rows, plain_rows)
    assert torch.equal(losses, plain_losses)
    # One position per chunk: each row's gradient comes from its own logits only.
    monkeypatch.setattr(capture, "LOGIT_CHUNK_ELEMENTS", 1)
    chunked_rows, chunked_losses = _rows(model, batch, loss_reduction=reduction, recompute="never")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunked_rows, plain_rows, rtol=tol, atol=tol * plain_rows.abs().max().item())
    torch.testing.assert_close(chunked_losses, plain_losses, rtol=tol, atol=0)


def test_recompute_and_chunks_lower_the_peak(monkeypatch):
    """GPT-2's tanh GELU keeps 4 (N, 4d) tensors per layer without the recompute, 1 with it; the
    logits stay at one chunk's (rows, V) instead of (N_s, V)."""
    model = _gpt2(vocab=8192, n_embd=128)
    batch = _batch(8192, lengths=(120, 120, 120, 120), prompt=20)

    def peak(recompute: str) -> int:
        with measure_peak(torch.device("cpu")) as p:
            _rows(model, batch, recompute=recompute)
        return p.peak_bytes

    lean = peak("always")
    no_recompute = peak("never")
    assert peak("auto") == no_recompute  # auto: float32 does not recompute
    monkeypatch.setattr(capture, "LOGIT_CHUNK_ELEMENTS", 10**12)
    plain = peak("never")
    n_tokens, f = 4 * 120, 4 * 128
    assert no_recompute - lean > 0.8 * 2 * 3 * n_tokens * f * 4  # three (N, f) float32 tensors per layer, 2 layers
    n_sup, chunk = 4 * 100, capture.logit_chunk_rows(8192)
    assert plain - no_recompute > 0.8 * 3 * (n_sup - chunk) * 8192 * 4  # three float32 (rows, V) tensors


def test_recompute_setting_follows_the_model_dtype():
    """auto recomputes for 16-bit weights only (docs/memory.md: where it lowers the peak); a
    bad setting is refused by name."""
    assert [capture.recomputes("auto", d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [True, True, False]
    assert capture.recomputes("always", torch.float32) and not capture.recomputes("never", torch.bfloat16)
    with pytest.raises(ValueError, match="grads.recompute_activations='sometimes'"):
        capture.recomputes("sometimes", torch.float32)


def test_the_estimate_follows_the_recompute_setting():
    """The grads estimate counts GPT-2's GELU as 1 saved (N, f) tensor per layer when the run
    recomputes it and as the calibrated count otherwise; the rest of the terms are the same."""
    from gradian.memory import estimate_grads

    shape = {"family": "gpt2", "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "d_model": 64,
             "d_mlp": 256, "vocab_size": 512, "n_params": 10**5}
    projector = Projector({"h.0.mlp.c_fc": (256, 64)}, "kronecker", 16)
    lean = estimate_grads(shape, 4, 4, 64, 16, projector, recompute=True)
    full = estimate_grads(shape, 4, 4, 64, 16, projector, recompute=False)
    acts = "activations saved for backward"
    assert full.terms[acts] > lean.terms[acts]
    assert {k: v for k, v in full.terms.items() if k not in (acts, "block temporaries")} == \
        {k: v for k, v in lean.terms.items() if k not in (acts, "block temporaries")}
