"""Recompute multi-op activation functions in the backward instead of keeping their intermediates.

GPT-2's tanh GELU (`transformers.activations.NewGELUActivation`) is written as seven tensor
ops, and autograd keeps four (B, T, d_mlp) tensors of them per layer for the backward: its input,
tanh(...), 0.5·x and 1 + tanh(...). That is half of everything a GPT-2 backward keeps. Run under
`torch.utils.checkpoint` the activation keeps only its input, and the backward re-runs the same
ops on the same input before differentiating them, so every value (and every gradient) is
bit-for-bit what it was; the price is one more pass of elementwise ops per layer.

Which activations gain is measured, not listed: a parameter-free leaf module whose class comes
from `transformers.activations` or `torch.nn.modules.activation` is probed once per (class,
dtype) on a small tensor, and recomputed only if autograd saves more for it than its input
(a fused `F.gelu` / `F.silu` saves exactly its input, so recomputing it would gain nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
_SAVES_MORE: dict[tuple[type, torch.dtype], bool] = {}


def _saves_more_than_input(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether autograd keeps anything but the input for `module` (probed on 64 elements)."""
    key = (type(module), dtype)
    if key not in _SAVES_MORE:
        x = torch.randn(64, dtype=dtype).requires_grad_(True)
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(t.untyped_storage().data_ptr())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        _SAVES_MORE[key] = bool(saved - {x.untyped_storage().data_ptr()})
    return _SAVES_MORE[key]


def recomputable_activations(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """The activation modules of `model` that keep more than their input for the backward."""
    out = []
    for module in model.modules():
        if next(module.children(), None) is not None or next(module.parameters(recurse=False), None) is not None:
            continue
        if type(module).__module__ in _ACTIVATION_MODULES and _saves_more_than_input(module, dtype):
            out.append(module)
    return out


@contextmanager
def recomputed_activations(model: nn.Module, dtype: torch.dtype) -> Iterator[int]:
    """Within the block, `recomputable_activations(model, dtype)` run under a non-reentrant
    checkpoint when their input needs a gradient (elsewhere exactly as before). Yields how many
    modules were wrapped; their `forward` is restored on exit."""
    modules = recomputable_activations(model, dtype)
    originals = [m.__dict__.get("forward") for m in modules]

    def wrapped(forward):
        def run(x, *args, **kwargs):
            if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
                return checkpoint(forward, x, *args, use_reentrant=False, **kwargs)
            return forward(x, *args, **kwargs)
        return run

    for m in modules:
        m.forward = wrapped(m.forward)
    try:
        yield len(modules)
    finally:
        for m, original in zip(modules, originals, strict=True):
            if original is None:
                del m.forward
            else:
                m.forward = original
