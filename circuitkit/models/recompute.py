"""Leaner activation functions for the gradient pass: recomputed in the backward, or fused.

GPT-2's tanh GELU (`transformers.activations.NewGELUActivation`) is written as seven tensor
ops, and autograd keeps four (B, T, d_mlp) tensors of them per layer for the backward: its input,
tanh(...), 0.5·x and 1 + tanh(...). That is half of everything a GPT-2 backward keeps, and its
elementwise ops are about a third of a bfloat16 pass on the CPU. Two ways out:

* **recompute** (`recomputed_activations`): run under `torch.utils.checkpoint` the activation
  keeps only its input, and the backward re-runs the same ops on the same input before
  differentiating them, so every value (and every gradient) is bit-for-bit what it was; the
  price is one more pass of elementwise ops per layer.
* **fused** (`fused_activations`): an activation whose function is one fused torch kernel
  (`FUSED_KERNELS`: GPT-2's `gelu_new` and `gelu_fast` are `F.gelu(x, approximate="tanh")`,
  the same formula) runs as that kernel, which keeps only its input and does the seven ops'
  work in one; the others are recomputed. Same function, other rounding: the kernel computes
  16-bit inputs in float32 and rounds once, where the model's ops round after each op.

Which activations gain is measured, not listed: a parameter-free leaf module whose class comes
from `transformers.activations` or `torch.nn.modules.activation` is probed once per (class,
dtype) on a small tensor, and changed only if autograd saves more for it than its input
(a fused `F.gelu` / `F.silu` saves exactly its input, so recomputing it would gain nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import activations as hf_activations

_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
_SAVES_MORE: dict[tuple[type, torch.dtype], bool] = {}

# Activation classes (exactly these, not subclasses) whose forward is the formula of one fused
# torch kernel. NewGELUActivation: 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))); FastGELUActivation
# the same with sqrt(2/π) written as 0.7978845608; F.gelu(approximate="tanh") computes that formula.
FUSED_KERNELS: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    hf_activations.NewGELUActivation: partial(F.gelu, approximate="tanh"),
    hf_activations.FastGELUActivation: partial(F.gelu, approximate="tanh"),
}


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
def _replaced_forwards(modules: list[nn.Module], make: Callable[[nn.Module], Callable]) -> Iterator[int]:
    """Each module's `forward` replaced by `make(module)` within the block (instance attribute);
    yields how many; the class's (or an earlier instance's) forward is restored on exit."""
    originals = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = make(m)
    try:
        yield len(modules)
    finally:
        for m, original in zip(modules, originals, strict=True):
            if original is None:
                del m.forward
            else:
                m.forward = original


def _checkpointed(forward: Callable) -> Callable:
    def run(x, *args, **kwargs):
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            return checkpoint(forward, x, *args, use_reentrant=False, **kwargs)
        return forward(x, *args, **kwargs)
    return run


@contextmanager
def recomputed_activations(model: nn.Module, dtype: torch.dtype) -> Iterator[int]:
    """Within the block, `recomputable_activations(model, dtype)` run under a non-reentrant
    checkpoint when their input needs a gradient (elsewhere exactly as before). Yields how many
    modules were wrapped; their `forward` is restored on exit."""
    with _replaced_forwards(recomputable_activations(model, dtype), lambda m: _checkpointed(m.forward)) as n:
        yield n


@contextmanager
def fused_activations(model: nn.Module, dtype: torch.dtype) -> Iterator[int]:
    """Within the block, the `recomputable_activations` with a `FUSED_KERNELS` entry run as that
    kernel and the rest are recomputed (`recomputed_activations`). Yields how many run fused."""
    modules = recomputable_activations(model, dtype)
    fused = [m for m in modules if type(m) in FUSED_KERNELS]
    rest = [m for m in modules if type(m) not in FUSED_KERNELS]
    with _replaced_forwards(fused, lambda m: FUSED_KERNELS[type(m)]) as n, \
            _replaced_forwards(rest, lambda m: _checkpointed(m.forward)):
        yield n
