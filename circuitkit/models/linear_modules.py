"""Which linear modules of a Hugging Face model `grads.module_filter` selects, and their shapes.

One rule for both sides of Gradian: `select_modules` walks the loaded model (what the index
projects), `linear_module_shapes` / `circuit_module_shapes` name the same modules from the
model's shape alone (what the memory estimate counts, before any weight is loaded). Their
names agree for every family; `tests/test_gradian_memory.py` compares them on each fixture.
`module_pattern_matches` is the filter's one matching rule.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from circuitkit.memory import shape_dict

# MLP projections by their Hugging Face names: an input projection keeps the MLP's activations
# for the backward, an output projection keeps nothing of its own block (gradian.memory).
MLP_IN_NAMES = ("c_fc", "gate_proj", "up_proj", "dense_h_to_4h", "fc1", "fc_in")
MLP_OUT_NAMES = ("c_proj", "down_proj", "dense_4h_to_h", "fc2", "fc_out")


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency, but keep it optional here
        return None
    return Conv1D


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2's linear layer, weight stored (in, out))."""
    conv1d = _conv1d_type()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def module_shape(module: nn.Module) -> tuple[int, int]:
    """(d_out, d_in) of a linear module in nn.Linear orientation, whatever its weight layout.

    nn.Linear stores W as (d_out, d_in); Conv1D stores it transposed, (d_in, d_out).
    """
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    conv1d = _conv1d_type()
    if conv1d is not None and isinstance(module, conv1d):
        d_in, d_out = module.weight.shape
        return int(d_out), int(d_in)
    raise TypeError(f"{type(module).__name__} is not a linear module (nn.Linear or Conv1D).")


def module_shapes(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, tuple[int, int]]:
    """name -> (d_out, d_in) for the output of `select_modules`, in the same order."""
    return {name: module_shape(m) for name, m in modules}


def select_modules(model: nn.Module, adapter, patterns: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The linear modules inside the transformer blocks whose full name matches a pattern.

    `patterns` are substrings ("down_proj") or fnmatch globs on the full module name
    ("*.mlp.c_proj", "model.layers.1.*"); None or [] selects every linear module in the blocks.
    The embedding and unembedding are never selected (they are not in `adapter.blocks`).
    Order is forward order: blocks in layer order, modules in registration order inside each.

    Raises ValueError when nothing matches, listing some available names.
    """
    names = {id(m): n for n, m in model.named_modules()}
    candidates: list[tuple[str, nn.Module]] = []
    for block in adapter.blocks:
        prefix = names[id(block)]
        for sub, module in block.named_modules(prefix=prefix):
            if is_linear(module):
                candidates.append((sub, module))
    if not candidates:
        raise ValueError(f"No linear modules found in the blocks of {type(model).__name__}.")
    if not patterns:
        return candidates
    chosen = [(n, m) for n, m in candidates if any(module_pattern_matches(n, p) for p in patterns)]
    if not chosen:
        # Show distinct module "kinds" (name without the layer index) first: more useful than
        # the first few names, which all belong to layer 0.
        kinds = sorted({".".join(p for p in n.split(".") if not p.isdigit()) for n, _ in candidates})
        raise ValueError(
            f"grads.module_filter {list(patterns)} matches no linear module in the transformer blocks."
            f" Patterns are substrings or fnmatch globs of the full name. Available (e.g.):"
            f" {', '.join(n for n, _ in candidates[:6])}; kinds: {', '.join(kinds[:12])}.")
    return chosen


def module_pattern_matches(name: str, pattern: str) -> bool:
    """grads.module_filter semantics: a glob ("*.mlp.c_proj") matches the whole module name,
    a plain pattern ("down_proj") is a substring."""
    return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name


_LINEAR_LAYOUT = {  # family -> (block prefix, [(module suffix, (d_out, d_in) as a function of the shape)])
    "gpt2": ("transformer.h.{l}.", [("attn.c_attn", lambda s: (3 * s["n_heads"] * s["head_dim"], s["d_model"])),
                                     ("attn.c_proj", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
                                     ("mlp.c_fc", lambda s: (s["d_mlp"], s["d_model"])),
                                     ("mlp.c_proj", lambda s: (s["d_model"], s["d_mlp"]))]),
    "gpt_neox": ("gpt_neox.layers.{l}.", [
        ("attention.query_key_value", lambda s: (3 * s["n_heads"] * s["head_dim"], s["d_model"])),
        ("attention.dense", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
        ("mlp.dense_h_to_4h", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.dense_4h_to_h", lambda s: (s["d_model"], s["d_mlp"]))]),
    "llama": ("model.layers.{l}.", [
        ("self_attn.q_proj", lambda s: (s["n_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.k_proj", lambda s: (s["n_kv_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.v_proj", lambda s: (s["n_kv_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.o_proj", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
        ("mlp.gate_proj", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.up_proj", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.down_proj", lambda s: (s["d_model"], s["d_mlp"]))]),
}
# Gemma 3: Gemma3ForConditionalGeneration (model_type gemma3, the released checkpoints) keeps
# its text blocks under model.language_model; the text-only Gemma3ForCausalLM (gemma3_text)
# under model.layers, as the adapter finds them.
_LINEAR_LAYOUT["gemma3"] = ("model.language_model.layers.{l}.", _LINEAR_LAYOUT["llama"][1])
_TEXT_ONLY_PREFIX = {"gemma3_text": "model.layers.{l}."}


def _layout(s: dict[str, Any]) -> tuple[str, list]:
    """(block prefix, linear layout) of a shape; a shape without `model_type` (given in a model
    yaml) is taken to be the family's released checkpoint class."""
    prefix, layout = _LINEAR_LAYOUT[s["family"]]
    return _TEXT_ONLY_PREFIX.get(s.get("model_type"), prefix), layout


def linear_module_shapes(shape: dict[str, Any], patterns: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Linear modules of the blocks as name -> (d_out, d_in), from the shape alone (no model),
    filtered like grads.module_filter; names follow the Hugging Face modules of each family."""
    s = shape_dict(shape)
    prefix, layout = _layout(s)
    out = {}
    for layer in range(s["n_layers"]):
        for suffix, dims in layout:
            name = prefix.format(l=layer) + suffix
            if not patterns or any(module_pattern_matches(name, p) for p in patterns):
                out[name] = dims(s)
    return out


def circuit_module_shapes(shape: dict[str, Any], head_mask: Any | None = None,
                          mlp_mask: Any | None = None) -> dict[str, tuple[int, int]]:
    """Sites of a circuit-restricted index (`gradian.restrict`) as name -> (d_out, d_in), from the
    shape alone: per kept head its (d_model, head_dim) block of the attention output projection,
    per kept MLP its output projection. head_mask (L, H) / mlp_mask (L,) None = all kept (the
    upper bound used before the pruning stage has written the circuit)."""
    s = shape_dict(shape)
    prefix, layout = _layout(s)
    # The attention output projection is the 2nd attention linear of every layout; the MLP
    # output projection is the last linear.
    o_suffix = {"gpt2": "attn.c_proj", "gpt_neox": "attention.dense"}.get(s["family"], "self_attn.o_proj")
    mlp_out = layout[-1]
    out: dict[str, tuple[int, int]] = {}
    for layer in range(s["n_layers"]):
        for h in range(s["n_heads"]):
            if head_mask is None or bool(head_mask[layer][h]):
                out[f"{prefix.format(l=layer)}{o_suffix}:head{h}"] = (s["d_model"], s["head_dim"])
        if mlp_mask is None or bool(mlp_mask[layer]):
            out[prefix.format(l=layer) + mlp_out[0]] = mlp_out[1](s)
    return out


def block_role(name: str) -> tuple[int, str]:
    """(layer, role) of a module of the blocks, from its Hugging Face name: role "mlp_in" (an
    MLP input projection), "mlp_out" (an MLP output projection) or "attention" (anything else,
    circuit sites such as `...attn.c_proj:head1` included)."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    layer = int(m.group(1)) if m else 0
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf in MLP_IN_NAMES:
        return layer, "mlp_in"
    if leaf in MLP_OUT_NAMES and "attn" not in parent and "attention" not in parent:
        return layer, "mlp_out"
    return layer, "attention"
