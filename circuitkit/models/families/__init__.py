"""The architecture families: one module each, and the registry that finds them.

    gpt2       GPT-2                                     families/gpt2.py
    gpt_neox   GPT-NeoX (Pythia)                         families/gpt_neox.py
    llama      Llama, Mistral, Qwen2                     families/llama.py
    gemma3     Gemma 3 (text, and the multimodal text path)  families/gemma3.py
    qwen3      Qwen3 (per-head q/k norms)                families/qwen3.py
    qwen3_moe  Qwen3-MoE (fused 3-D expert weights)      families/qwen3_moe.py

A family module holds one `ModelAdapter` subclass (`families.base`): the only code in the
project with Hugging Face module names and family-specific config fields (checked by
tests/test_architecture.py; the fixtures and `gradian doctor`'s self-test model, built by hand,
aside). Fields with one meaning in every family are read generically: `model_type`,
`vocab_size`, `text_config`, the context length (`loading.context_length`). A new family is a
new module here: the registry finds every module of this package (but `base`) and the
ModelAdapter subclass it defines (listed in `listed` order).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from torch import nn

from circuitkit.models.families.base import ModelAdapter, UnsupportedArchitectureError


def _discover() -> tuple[type[ModelAdapter], ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        classes = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, ModelAdapter)
                   and v.__module__ == module.__name__ and v.family]
        if len(classes) != 1:
            raise RuntimeError(f"{module.__name__} defines {len(classes)} families; a family module defines one.")
        found.append(classes[0])
    return tuple(sorted(found, key=lambda cls: (cls.listed, cls.family)))


_FAMILY_CLASSES: tuple[type[ModelAdapter], ...] = _discover()

# family name -> class; Hugging Face model_type -> class.
FAMILIES: dict[str, type[ModelAdapter]] = {cls.family: cls for cls in _FAMILY_CLASSES}
BY_MODEL_TYPE: dict[str, type[ModelAdapter]] = {mt: cls for cls in _FAMILY_CLASSES for mt in cls.model_types}
# model_type -> display name, for messages.
SUPPORTED_MODEL_TYPES: dict[str, str] = {mt: name for cls in _FAMILY_CLASSES for mt, name in cls.model_types.items()}
# What each family declares of its own model_types (a subclass serving other model_types, as
# Qwen3-MoE does Qwen3, does not inherit them): GGUF files it loads, multimodal checkpoint classes.
GGUF_MODEL_TYPES: frozenset[str] = frozenset(mt for cls in _FAMILY_CLASSES for mt in cls.gguf_model_types
                                             if mt in cls.model_types)
IMAGE_TEXT_MODEL_TYPES: frozenset[str] = frozenset(mt for cls in _FAMILY_CLASSES for mt in cls.image_text_model_types
                                                   if mt in cls.model_types)


def family(name: str) -> type[ModelAdapter]:
    """The family called `name` (a shape's `family`); ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} is unknown; known: {', '.join(FAMILIES)}"
                         " (one module each in circuitkit/models/families/).") from None


def family_of_config(hf_config: Any) -> type[ModelAdapter]:
    """The family of a Hugging Face config, by its (text config's) model_type."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    model_type = getattr(cfg, "model_type", None)
    cls = BY_MODEL_TYPE.get(model_type)
    if cls is None:
        raise ValueError(f"model_type {model_type!r} has no family; known: {', '.join(sorted(BY_MODEL_TYPE))}")
    return cls


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`, chosen by `model.config.model_type`."""
    model_type = getattr(model.config, "model_type", None)
    cls = BY_MODEL_TYPE.get(model_type)
    if cls is None:
        supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise UnsupportedArchitectureError(
            f"Architecture '{model_type}' ({type(model).__name__}) is not supported. Supported families:"
            f" {supported}.")
    return cls(model)
