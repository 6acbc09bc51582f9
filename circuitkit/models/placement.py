"""Where a model's weights live when `model.device_map` splits it (Hugging Face accelerate).

With a device map, layers sit on different devices (GPUs, CPU) or are offloaded to disk and
loaded for each forward by accelerate's hooks; the parameters of an offloaded layer are `meta`
tensors between forwards. Hooks' tensors already sit on each layer's own device. Two things
need help: where the inputs go (the embedding's execution device, not the first parameter's
device, which may be `meta`), and code that reads weights outside a forward (the adapters'
per-head Q/K/V/O and norm weights, the weights hash), which `resident(module)` makes real.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def input_device(model: nn.Module) -> torch.device:
    """The device input ids go to: the first placed module's device under a device map
    (accelerate moves activations between layers itself), else the parameters' device."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        for target in device_map.values():
            if target not in ("disk", "meta"):
                return torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
        return torch.device("cpu")  # everything offloaded: accelerate executes on the CPU
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def resident(module: nn.Module) -> contextlib.AbstractContextManager:
    """Context in which the offloaded weights of `module` and its submodules are real tensors
    on their execution device (a no-op for a model without offload). Tensors taken inside
    stay valid after it; the module goes back to `meta` on exit."""
    offloaded = [m for m in module.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    if not offloaded:
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    stack = contextlib.ExitStack()
    for m in offloaded:
        stack.enter_context(align_module_device(m))
    return stack


def state_entries(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """`model.state_dict()`'s names -> (owning module, attribute), without reading a weight:
    read one with `resident(module)` (an offloaded model is never loaded whole)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        names = [n for n, p in module._parameters.items() if p is not None]
        names += [n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set]
        for name in names:
            out[f"{prefix}.{name}" if prefix else name] = (module, name)
    return out


def device_of(name: str) -> torch.device:
    """A device-map target ("0", "cuda:1", "cpu", "mps") as a torch.device."""
    return torch.device("cuda", int(name)) if name.isdigit() else torch.device(name)
