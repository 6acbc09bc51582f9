"""Leaner rewrites of the gradient pass. Exact: activations recomputed in the backward
(`circuitkit.models.recompute`) and the unembedding in chunks of supervised positions
(`gradian.capture.gradients.supervised_loss_grad`) give the rows of the plain one-pass computation.
Measured against an oracle: GPT-2's GELU as one fused kernel (`grads.activations=fused`) gives
rows as close to float64 rows as the model's own ops do, and the index records which ran."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.activations import NewGELUActivation

import gradian.capture.gradients as capture
from circuitkit.core.device import measure_peak
from circuitkit.models.adapters import get_adapter
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.recompute import fused_activations, recomputable_activations, recomputed_activations
from gradian.projection.projector import Projector


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
    rows, losses = _rows(model, batch, loss_reduction=reduction, activations="recompute")
    # The plain computation: no recompute, every supervised position unembedded in one chunk.
    monkeypatch.setitem(capture.LOGIT_CHUNK_ELEMENTS, "cpu", 10**12)
    plain_rows, plain_losses = _rows(model, batch, loss_reduction=reduction, activations="model")
    assert torch.equal(rows, plain_rows)
    assert torch.equal(losses, plain_losses)
    # One position per chunk: each row's gradient comes from its own logits only.
    monkeypatch.setitem(capture.LOGIT_CHUNK_ELEMENTS, "cpu", 1)
    chunked_rows, chunked_losses = _rows(model, batch, loss_reduction=reduction, activations="model")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunked_rows, plain_rows, rtol=tol, atol=tol * plain_rows.abs().max().item())
    torch.testing.assert_close(chunked_losses, plain_losses, rtol=tol, atol=0)


def test_recompute_fusing_and_chunks_lower_the_peak(monkeypatch):
    """GPT-2's tanh GELU keeps 4 (N, 4d) tensors per layer with the model's ops, 1 recomputed or
    fused; the logits stay at one chunk's (rows, V) instead of (N_s, V)."""
    model = _gpt2(vocab=8192, n_embd=128)
    batch = _batch(8192, lengths=(120, 120, 120, 120), prompt=20)

    def peak(activations: str) -> int:
        with measure_peak(torch.device("cpu")) as p:
            _rows(model, batch, activations=activations)
        return p.peak_bytes

    recomputed, fused = peak("recompute"), peak("fused")
    as_written = peak("model")
    assert peak("auto") == as_written  # auto: float32 runs the model's own ops
    monkeypatch.setitem(capture.LOGIT_CHUNK_ELEMENTS, "cpu", 10**12)
    plain = peak("model")
    n_tokens, f = 4 * 120, 4 * 128
    for lean in (recomputed, fused):  # three (N, f) float32 tensors per layer, 2 layers
        assert as_written - lean > 0.8 * 2 * 3 * n_tokens * f * 4
    n_sup, chunk = 4 * 100, capture.logit_chunk_rows(8192)
    assert plain - as_written > 0.8 * 3 * (n_sup - chunk) * 8192 * 4  # three float32 (rows, V) tensors


def test_activation_setting_follows_the_model_dtype():
    """auto fuses for 16-bit weights and keeps the model's ops in float32 (docs/memory.md); the
    index records the numerics (recompute is the model's bits); a bad setting is refused by name."""
    mode = capture.activation_mode
    assert [mode("auto", d) for d in (torch.bfloat16, torch.float16, torch.float32)] == ["fused", "fused", "model"]
    assert mode("recompute", torch.float32) == "recompute" and mode("model", torch.bfloat16) == "model"
    assert [capture.activation_numerics(m) for m in ("model", "recompute", "fused")] == ["model", "model", "fused"]
    with pytest.raises(ValueError, match="grads.activations='sometimes'"):
        mode("sometimes", torch.float32)


def test_fused_gelu_runs_one_kernel_and_is_restored():
    model = _gpt2()
    gelus = recomputable_activations(model, torch.float32)
    x = torch.randn(3, 7, 256, dtype=torch.float64)
    with fused_activations(model, torch.float32) as n:
        assert n == 2
        assert torch.equal(gelus[0](x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert "forward" not in gelus[0].__dict__
    # The same formula: in float64 the fused kernel and the model's seven ops agree to round-off.
    torch.testing.assert_close(gelus[0](x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-12, atol=1e-12)


def _relative_errors(rows: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    return (rows.double() - oracle).norm(dim=1) / oracle.norm(dim=1)


def test_fused_rows_are_as_close_to_float64_rows_as_the_models_ops():
    """The oracle is the model's own ops in float64. float32: fused rows within 1e-5 of it (the
    model's ops are); bfloat16: fused rows no further from it than the model's bfloat16 ops (a
    10% margin over their median error on these rows)."""
    batch = _batch(512)
    oracle, _ = _rows(_gpt2(torch.float64), batch, activations="model")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        model = _gpt2(dtype)
        as_written = _relative_errors(_rows(model, batch, activations="model")[0], oracle)
        fused = _relative_errors(_rows(model, batch, activations="fused")[0], oracle)
        assert fused.max() < tol and as_written.max() < tol
        if dtype == torch.bfloat16:
            assert fused.median() <= 1.1 * as_written.median()


def test_the_estimate_follows_the_activation_setting():
    """The grads estimate counts GPT-2's GELU as 1 saved (N, f) tensor per layer when the run
    recomputes or fuses it and as the calibrated count otherwise; the rest of the terms are the same."""
    from gradian.build.memory import estimate_grads

    shape = {"family": "gpt2", "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "d_model": 64,
             "d_mlp": 256, "vocab_size": 512, "n_params": 10**5}
    projector = Projector({"h.0.mlp.c_fc": (256, 64)}, "kronecker", 16)
    full = estimate_grads(shape, 4, 4, 64, 16, projector, activations="model")
    acts = "activations saved for backward"
    for mode in ("recompute", "fused"):
        lean = estimate_grads(shape, 4, 4, 64, 16, projector, activations=mode)
        assert full.terms[acts] > lean.terms[acts]
        assert {k: v for k, v in full.terms.items() if k not in (acts, "block temporaries")} == \
            {k: v for k, v in lean.terms.items() if k not in (acts, "block temporaries")}


def test_the_index_records_its_activations_and_queries_run_them(tmp_path):
    """A bfloat16 index made with the default records `activations: fused`; resuming it with the
    model's ops is refused by name (their rows differ in bits); its queries run fused, as its rows did."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.build.indexer import build_index
    from gradian.index.manifest import IndexMismatchError, read_manifest
    from gradian.rank.queries import query_gradients
    from gradian.settings.grads import GradsConfig

    rows = [{"prompt": f"row {i} says", "completion": f" the number {i} twice: {i} {i}."} for i in range(6)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_cfg = ModelConfig(name="builtin:tiny-gpt2", precision="bfloat16")
    loaded = load_model(model_cfg)
    grads = GradsConfig(data_path=str(data), projection_dim=16, module_filter=["mlp.c_proj"], batch_size=3)
    build_index(model_cfg, grads, tmp_path / "idx", loaded=loaded)
    manifest = read_manifest(tmp_path / "idx")
    assert manifest["activations"] == "fused"
    with pytest.raises(IndexMismatchError, match="activations"):
        build_index(model_cfg, GradsConfig(**{**vars(grads), "activations": "model"}), tmp_path / "idx", loaded=loaded)

    modules = select_modules(loaded.model, loaded.adapter, ["mlp.c_proj"])
    projector = Projector(module_shapes(modules), "kronecker", 16, seed=0)
    got, _ = query_gradients(manifest, loaded, projector, data, batch_size=3)
    by_mode = {}
    for mode in ("fused", "model"):
        out, _ = query_gradients({**manifest, "activations": mode}, loaded, projector, data, batch_size=3)
        by_mode[mode] = out
    assert torch.equal(got, by_mode["fused"]) and not torch.equal(got, by_mode["model"])
