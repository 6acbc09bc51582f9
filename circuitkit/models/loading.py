"""Loading a causal LM and its tokenizer by hub name, local directory, or built-in fixture.

`model.name` is passed to `from_pretrained` exactly as users run it (a hub name such as
`google/gemma-3-4b-it`, or a local directory). `builtin:NAME` names a tiny fixture that is
built locally (seconds, cached) and then loaded from its directory the same way.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from circuitkit.config import ModelConfig
from circuitkit.device import get_device
from circuitkit.models.adapters import ModelAdapter, get_adapter

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BUILTIN_PREFIX = "builtin:"


@dataclass
class LoadedModel:
    """A frozen model on its device, its tokenizer and its architecture adapter."""

    model: nn.Module
    tokenizer: object
    adapter: ModelAdapter
    name: str
    revision: str | None
    path: str  # what from_pretrained was given

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve_model_path(name: str) -> str:
    """The argument for `from_pretrained`: builtin fixtures become their cached directory."""
    if name.startswith(BUILTIN_PREFIX):
        from circuitkit.models.tiny import FIXTURE_NAMES, ensure_fixture

        fixture = name[len(BUILTIN_PREFIX):]
        if fixture not in FIXTURE_NAMES:
            raise ValueError(f"model.name '{name}' names no built-in fixture; available:"
                             f" {', '.join(BUILTIN_PREFIX + n for n in FIXTURE_NAMES)}.")
        return str(ensure_fixture(fixture))
    return name


def _auto_class(path: str, revision: str | None, trust_remote_code: bool):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for Gemma 3's multimodal checkpoints."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if getattr(config, "model_type", None) == "gemma3":
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _quiet_transformers() -> None:
    """Our own progress and tables replace transformers' per-file bars; its warnings still show."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def load_model(cfg: ModelConfig, device: torch.device | None = None) -> LoadedModel:
    """Load `cfg.name` at `cfg.revision` in `cfg.precision`, frozen, in eval mode, on `device`.

    Parameters never require grad: CircuitKit only takes activation gradients.
    """
    from transformers import AutoTokenizer

    if cfg.precision != "bfloat16":
        log.warning("model.precision=%s: bfloat16 is the default; %s uses more memory per weight"
                    " and is meant for reference/accuracy checks.", cfg.precision, cfg.precision)
    if cfg.trust_remote_code:
        log.warning("model.trust_remote_code=true: code from '%s' will run on this machine.", cfg.name)
    _quiet_transformers()
    path = resolve_model_path(cfg.name)
    device = device or get_device()
    auto = _auto_class(path, cfg.revision, cfg.trust_remote_code)
    model = auto.from_pretrained(path, revision=cfg.revision, dtype=DTYPES[cfg.precision],
                                 trust_remote_code=cfg.trust_remote_code,
                                 attn_implementation=cfg.attn_implementation)
    model.requires_grad_(False)
    model.eval()
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    return LoadedModel(model, tokenizer, get_adapter(model), cfg.name, cfg.revision, path)


# Config attributes that hold a model's context length, by family (GPT-2: n_positions).
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def context_length(hf_config) -> int | None:
    """The longest sequence (tokens) the model takes, from its Hugging Face config; None if unknown.

    Multimodal configs (Gemma 3) are read through their text config.
    """
    config = getattr(hf_config, "text_config", None) or hf_config
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weights_hash(model: nn.Module) -> str:
    """sha256 over parameter names, shapes, dtypes and bytes: identifies the exact weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

