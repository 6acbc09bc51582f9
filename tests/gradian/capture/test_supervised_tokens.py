"""Only supervised tokens count: prompt tokens do not grow the peak or change the stored rows' shape."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.core.device import measure_peak
from circuitkit.fixtures.models import FIXTURE_NAMES
from circuitkit.models.adapters import get_adapter
from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import (
    circuit_module_shapes,
    linear_module_shapes,
    module_shapes,
    select_modules,
)
from circuitkit.models.loading import load_model
from circuitkit.preflight.memory import shape_for
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import circuit_sites, site_shapes
from gradian.projection.projector import Projector

SUPERVISED, VOCAB = 16, 50257


def _peak_and_rows(model, adapter, modules, projector, prompt_len: int) -> tuple[int, torch.Tensor]:
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, VOCAB, (4, prompt_len + SUPERVISED), generator=g)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, prompt_len:] = True
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervised": sup}
    with measure_peak(torch.device("cpu")) as peak:
        rows = per_example_gradients(model, adapter, modules, projector, batch).row()
    return peak.peak_bytes, rows


def test_prompt_tokens_do_not_grow_the_peak_with_a_large_vocabulary():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512)).eval()
    model.requires_grad_(False)
    adapter = get_adapter(model)
    modules = select_modules(model, adapter, ["mlp.c_proj"])
    projector = Projector(module_shapes(modules), "kronecker", 64, seed=0)
    short_peak, short_rows = _peak_and_rows(model, adapter, modules, projector, 16)
    long_peak, long_rows = _peak_and_rows(model, adapter, modules, projector, 240)
    assert short_rows.shape == long_rows.shape == (4, 2 * 64)
    logits_fp32 = 4 * SUPERVISED * VOCAB * 4  # the dominant tensor: batch x supervised x vocab x 4 bytes
    assert short_peak > logits_fp32
    # 15x more tokens: a full-logits upcast would grow the peak ~15x; here only activations grow.
    assert long_peak < 1.5 * short_peak, (short_peak, long_peak)


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_estimate_counts_the_modules_the_index_projects(fixture):
    """The memory estimate names the modules from the shape alone; the index finds them in the
    loaded model. Same names, same shapes, same order, for every filter and every family (a
    Gemma 3 text model keeps its layers at model.layers, the multimodal one under
    model.language_model)."""
    cfg = ModelConfig(name=f"builtin:{fixture}", precision="float32")
    loaded = load_model(cfg)
    shape = shape_for(cfg)
    fused = loaded.adapter.fused_experts  # experts in 3-D weights: every-linear index refused, both sides
    if fused:
        for refuse in (lambda: select_modules(loaded.model, loaded.adapter, None),
                       lambda: linear_module_shapes(shape, None)):
            with pytest.raises(ValueError, match="mixture-of-experts weights stored as fused 3-D tensors"):
                refuse()
    everything = module_shapes(select_modules(loaded.model, loaded.adapter, ["attn"] if fused else None))
    first_block = next(iter(everything)).rsplit(".", 2)[0]  # e.g. model.layers.0.self_attn
    layer_glob = first_block.rsplit(".", 2)[0].replace(".0", ".1") + ".*"  # every module of layer 1
    filters = ([["attn"], [layer_glob], ["o_proj"]] if fused
               else [None, ["*.mlp.*"], [layer_glob], ["c_proj", "down_proj", "dense_4h_to_h"]])
    for patterns in filters:
        indexed = module_shapes(select_modules(loaded.model, loaded.adapter, patterns))
        assert list(linear_module_shapes(shape, patterns).items()) == list(indexed.items()), patterns
    n_layers, n_heads = loaded.adapter.n_layers, loaded.adapter.n_heads
    mlps = None if fused else torch.ones(n_layers, dtype=torch.bool)
    sites = circuit_sites(loaded.model, loaded.adapter, torch.ones(n_layers, n_heads, dtype=torch.bool), mlps)
    assert list(circuit_module_shapes(shape).items()) == list(site_shapes(sites).items())
    if fused:  # the circuit's MLPs have no output linear: refused in one line
        with pytest.raises(ValueError, match="grads.circuit_mlps=none"):
            circuit_sites(loaded.model, loaded.adapter, torch.ones(n_layers, n_heads, dtype=torch.bool),
                          torch.ones(n_layers, dtype=torch.bool))
