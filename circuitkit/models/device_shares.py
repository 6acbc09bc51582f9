"""How much of a stage's estimated peak each device of `model.device_map` holds, from the
model's config alone: the weight share accelerate will place on each device (an empty `meta`
model, no weights read), and the other terms of the estimate in proportion to the layers each
device runs. The preflight prints and checks these per device (docs/scale-out.md).
"""

from __future__ import annotations

from circuitkit.models.config import ModelConfig
from circuitkit.preflight.memory import MemoryEstimate


def planned_weight_bytes(cfg: ModelConfig) -> dict[str, int] | None:
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
    from transformers import AutoModelForCausalLM

    from circuitkit.core.device import model_dtype
    from circuitkit.models.loading import auto_config, pretrained_args

    dtype = model_dtype(cfg)
    path, kwargs = pretrained_args(cfg)
    hf_config = auto_config(path, kwargs, cfg.revision, cfg.trust_remote_code)
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


def per_device_estimates(cfg: ModelConfig, estimate: MemoryEstimate) -> dict[str, MemoryEstimate]:
    """Split a stage's whole-model MemoryEstimate over the devices of `cfg.device_map`.

    Each device holds its planned weight share ("weights"); the other terms (activations,
    buffers, scores) are spread in proportion to the weights each device *executes*: layers
    mapped to `cpu` or `disk` next to a GPU run on the first GPU (accelerate streams their
    weights there), so their share counts there. An approximation (activations per layer are
    about equal; logits sit with the last layer), not a measurement. Returns {device: estimate};
    `disk` holds weights only.
    """
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
