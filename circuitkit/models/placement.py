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


def is_split(model: nn.Module) -> bool:
    """True when accelerate placed the model with a device map (several devices or offload)."""
    return bool(getattr(model, "hf_device_map", None))


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


def planned_weight_bytes(cfg) -> dict[str, int] | None:
    """Weight bytes per device that `cfg.model.device_map` will place, from the model's config
    alone (an empty `meta` model, no weights read); None without a device map.

    A strategy (auto, balanced, sequential) is resolved the way accelerate does for
    from_pretrained, with `model.max_memory`; a mapping is taken as given (longest module
    prefix wins). Keys are device names: "0" (GPU 0), "cpu", "disk".
    """
    if cfg.device_map is None:
        return None
    from accelerate import init_empty_weights
    from accelerate.utils import get_balanced_memory, infer_auto_device_map
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoModelForCausalLM

    from circuitkit.models.loading import DTYPES, resolve_model_path

    dtype = DTYPES[cfg.precision]
    hf_config = AutoConfig.from_pretrained(resolve_model_path(cfg.name), revision=cfg.revision,
                                           trust_remote_code=cfg.trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    model.tie_weights()  # a tied unembedding is one tensor, counted once (as from_pretrained loads it)
    device_map = OmegaConf.to_container(cfg.device_map) if OmegaConf.is_config(cfg.device_map) else cfg.device_map
    if isinstance(device_map, str):
        max_memory = cfg.max_memory
        if max_memory is not None:
            max_memory = {(int(k) if str(k).isdigit() else k): v for k, v in dict(max_memory).items()}
        no_split = getattr(model, "_no_split_modules", None) or []
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        owners = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        target = str(device_map[max(owners, key=len)]) if owners else "unplaced"
        out[target] = out.get(target, 0) + p.numel() * p.element_size()
    return out


def per_device_estimates(cfg, estimate):
    """Split a stage's whole-model MemoryEstimate over the devices of `cfg.device_map`.

    Each device holds its planned weight share ("weights"); the other terms (activations,
    buffers, scores) are spread in proportion to the weights each device *executes*: layers
    mapped to `cpu` or `disk` next to a GPU run on the first GPU (accelerate streams their
    weights there), so their share counts there. An approximation (activations per layer are
    about equal; logits sit with the last layer), not a measurement. Returns {device: estimate};
    `disk` holds weights only.
    """
    from circuitkit.memory import MemoryEstimate

    shares = planned_weight_bytes(cfg)
    if not shares:
        return {}
    devices = [d for d in shares if d not in ("disk", "cpu", "unplaced")]
    main = devices[0] if devices else "cpu"
    executed = {d: b for d, b in shares.items() if d in devices}
    executed[main] = executed.get(main, 0) + sum(b for d, b in shares.items() if d not in devices)
    total = max(sum(shares.values()), 1)
    out = {}
    for device, weight_bytes in shares.items():
        frac = executed.get(device, 0) / total
        terms = {"weights": weight_bytes}
        terms.update({name: int(value * frac) for name, value in estimate.terms.items() if name != "weights"})
        out[device] = MemoryEstimate(terms, phase=f"{estimate.phase}, {device}" if estimate.phase else device)
    return out


def device_of(name: str) -> torch.device:
    """A device-map target ("0", "cuda:1", "cpu", "mps") as a torch.device."""
    return torch.device("cuda", int(name)) if name.isdigit() else torch.device(name)
