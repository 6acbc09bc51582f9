"""Only supervised tokens count: prompt tokens do not grow the peak or change the stored rows' shape."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.device import measure_peak
from circuitkit.models.adapters import get_adapter
from gradian.capture import per_example_gradients
from gradian.projection import Projector, module_shapes, select_modules

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
