"""The model group's schema (`model.*`): what is loaded, how, and its shape known without loading.

The keys' docs, choices and ranges are the fields' metadata (`circuitkit.core.config._f`), read by
validation, docs/configuration.md and the command-line flags that mirror a key. `check_placement`
is the one rule that reads several model keys together (device_map, max_memory, offload_folder).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from circuitkit.core.config import ConfigError, _f, validate_block


@dataclass
class ModelShape:
    """Shape of a model, known without loading weights (used by the memory estimate)."""

    # Not a closed list here: a family is a module of circuitkit/models/families/, which names it
    # (an unknown name is refused where the shape is used, listing the known ones).
    family: Optional[str] = _f(None, "architecture family: the name of a module of circuitkit/models/families/"
                               " (gpt2, gpt_neox, llama, gemma3, qwen3, qwen3_moe, ...)")
    n_layers: Optional[int] = _f(None, "transformer blocks", ge=1)
    n_heads: Optional[int] = _f(None, "attention (query) heads per layer", ge=1)
    n_kv_heads: Optional[int] = _f(None, "key/value heads per layer (GQA when < n_heads)", ge=1)
    head_dim: Optional[int] = _f(None, "width of one head", ge=1)
    d_model: Optional[int] = _f(None, "residual stream width", ge=1)
    d_mlp: Optional[int] = _f(None, "MLP hidden width", ge=1)
    vocab_size: Optional[int] = _f(None, "vocabulary size (rows of the unembedding)", ge=1)
    n_params: Optional[int] = _f(None, "parameter count", ge=1)


@dataclass
class ModelConfig:
    name: str = _f("builtin:tiny-gpt2", "hub name, local directory, a .gguf file, builtin:NAME (a local fixture) or"
                   " fetched:NAME (a model `circuitkit fetch NAME` installed, e.g. fetched:smollm2)")
    gguf_file: Optional[str] = _f(None, "a GGUF file inside model.name (a directory or hub id), loaded through"
                                  " transformers and dequantized to float32; null = model.name is not a GGUF")
    revision: Optional[str] = _f(None, "hub revision (branch, tag or commit); null = default branch")
    adapter: Optional[str] = _f(None, "a PEFT LoRA adapter directory (what save_pretrained wrote: adapter_config.json"
                                " and adapter_model.safetensors) applied on top of model.name; circuit discovery runs"
                                " on the merged weights, Gradian keeps the LoRA linears (grads.module_filter=[adapter]"
                                " selects them). Needs peft (pip install 'circuitkit-gradian[peft]'); null = none")
    base_name: Optional[str] = _f(None, "for a full fine-tune in model.name: the model it was tuned from (hub name,"
                                  " local directory or builtin:NAME, loaded at its default revision), recorded in the"
                                  " run manifest and the index; null = none")
    precision: str = _f("auto", "weight dtype: auto = bfloat16 where the device computes it natively (CUDA"
                        " compute capability 8.0+, MPS on macOS 14+, a CPU with AVX512-BF16 or AMX), else float32;"
                        " bfloat16, float16, float32 = that dtype everywhere",
                        choices=("auto", "bfloat16", "float16", "float32"))
    trust_remote_code: bool = _f(False, "allow model code from the hub; off unless you set it")
    attn_implementation: str = _f("sdpa", "attention kernel", choices=("sdpa", "eager"))
    device_map: Any = _f(None, "split the model over devices with accelerate: null = whole model on one device;"
                         " auto, balanced, balanced_low_0, sequential; or {module name: GPU number, cpu or disk}")
    max_memory: Any = _f(None, "with device_map: the most each device may hold, e.g. {0: 20GiB, 1: 20GiB, cpu: 64GiB};"
                         " null = what accelerate finds free")
    offload_folder: Optional[str] = _f(None, "with device_map: where layers mapped to 'disk' are stored")
    shape: ModelShape = field(default_factory=ModelShape, metadata={"doc": "shape known without loading"})



DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_placement(m: ModelConfig) -> None:
    """model.device_map, model.max_memory and model.offload_folder agree (free-form keys, checked here)."""
    dm = m.device_map
    if dm is None:
        if m.max_memory is not None or m.offload_folder is not None:
            raise ConfigError("Config keys 'model.max_memory' / 'model.offload_folder' only apply with"
                              " model.device_map set (e.g. model.device_map=auto).")
        return
    if isinstance(dm, str):
        if dm not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(f"Config key 'model.device_map' = {dm!r} is not allowed; it must be null, one of"
                              f" {', '.join(DEVICE_MAP_STRATEGIES)}, or a mapping {{module name: device}}.")
    elif isinstance(dm, Mapping):
        bad = [f"{k}: {v!r}" for k, v in dm.items()
               if not (isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str))]
        if not dm or bad:
            raise ConfigError(f"Config key 'model.device_map' has {', '.join(bad) or 'no entries'}; each module"
                              " must map to a GPU number, a device name (cuda:1, cpu) or 'disk'.")
        if "disk" in dm.values() and m.offload_folder is None:
            raise ConfigError("Config key 'model.device_map' maps modules to 'disk', so model.offload_folder must"
                              " name a directory for them.")
    else:
        raise ConfigError(f"Config key 'model.device_map' = {dm!r} must be null, a strategy name"
                          f" ({', '.join(DEVICE_MAP_STRATEGIES)}) or a mapping {{module name: device}}.")
    if m.max_memory is not None and not isinstance(m.max_memory, Mapping):
        raise ConfigError(f"Config key 'model.max_memory' = {m.max_memory!r} must be a mapping {{device: size}},"
                          " e.g. {0: 20GiB, cpu: 64GiB}.")


def validate_model(data: Mapping[str, Any]) -> ModelConfig:
    """A `model` block (a plain dict) checked as the composed config's is: keys, types, ranges, placement."""
    m = validate_block(data, ModelConfig, "model.")
    check_placement(m)
    return m
