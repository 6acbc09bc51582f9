"""The family-independent view of a model (`ModelAdapter`) and how one is found for a model.

Each architecture family is one module of `circuitkit/models/families/` (its module names,
hook sites, config fields, parameter count and memory coefficients); this module re-exports
what the rest of the project uses, so that nothing above `models/` imports a family.
"""

from __future__ import annotations

from circuitkit.models.families import (
    BY_MODEL_TYPE,
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    family,
    family_of_config,
    get_adapter,
)
from circuitkit.models.families.base import (
    ModelAdapter,
    NormSpec,
    QKVSite,
    QKVWeights,
    UnsupportedArchitectureError,
    norm_spec,
)

# Hugging Face model_type -> family name (Qwen2 and Mistral are Llama-shaped).
MODEL_TYPE_FAMILIES = {model_type: cls.family for model_type, cls in BY_MODEL_TYPE.items()}
SUPPORTED_FAMILIES = SUPPORTED_MODEL_TYPES

__all__ = ["FAMILIES", "MODEL_TYPE_FAMILIES", "SUPPORTED_FAMILIES", "ModelAdapter", "NormSpec", "QKVSite",
           "QKVWeights", "UnsupportedArchitectureError", "family", "family_of_config", "get_adapter", "norm_spec"]
