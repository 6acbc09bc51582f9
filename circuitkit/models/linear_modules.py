"""Which linear modules of a Hugging Face model `grads.module_filter` selects, and their shapes.

One rule for both sides of Gradian: `select_modules` walks the loaded model (what the index
projects), `linear_module_shapes` / `circuit_module_shapes` name the same modules from the
model's shape alone (what the memory estimate counts, before any weight is loaded), from the
family's `linear_layout` (`circuitkit.models.families`). Their names agree for every family; `tests/gradian/capture/test_supervised_tokens.py` compares them on each fixture.
`module_pattern_matches` is the filter's one matching rule.

A model with a LoRA adapter kept (`circuitkit.models.lora`, Gradian's view) has, inside each target,
its base linear and the adapter's two linears. They are named as an index records them
(`canonical_name`): the base linear by its target's name, the adapter's `<target>.lora_A` (r, d_in)
and `<target>.lora_B` (d_out, r). The adapter's linears are selected only by a pattern that names
them (one containing `lora_`, e.g. `lora_A`, `*.lora_B`) or by the alias `adapter` (all of them), and
by an empty filter; a base module's pattern (`attn`) selects its base weight only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

from torch import nn

from circuitkit.models.families import family
from circuitkit.models.families.base import ATTENTION, is_linear, module_shape
from circuitkit.models.lora import ADAPTER_ALIAS, LORA_KINDS, canonical_name, is_lora_name, strip_lora
from circuitkit.preflight.memory import shape_dict


def modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Every module by its canonical name (`canonical_name`); where a PEFT layer and its base
    linear share one, the linear (what a name in an index means)."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():  # a parent comes before its children: the linear wins
        out[canonical_name(name)] = module
    return out


def module_shapes(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, tuple[int, int]]:
    """name -> (d_out, d_in) for the output of `select_modules`, in the same order."""
    return {name: module_shape(m) for name, m in modules}


def select_modules(model: nn.Module, adapter, patterns: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The linear modules inside the transformer blocks whose full name matches a pattern.

    `patterns` are substrings ("down_proj") or fnmatch globs on the full module name
    ("*.mlp.c_proj", "model.layers.1.*"); None or [] selects every linear module in the blocks.
    Names are canonical (`canonical_name`): with a kept LoRA adapter the base linear of a target
    keeps the target's name, and its LoRA linears (`<target>.lora_A`, `.lora_B`) are selected only
    by `adapter` or a pattern containing `lora_` (`filter_matches`), or by an empty filter.
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
                candidates.append((canonical_name(sub), module))
    if not candidates:
        raise ValueError(f"No linear modules found in the blocks of {type(model).__name__}.")
    if not patterns:
        fused = fused_expert_parameters(model, adapter)
        if fused:
            share = sum(n for _, n in fused) / sum(p.numel() for p in model.parameters())
            kinds = sorted({".".join(p for p in n.split(".") if not p.isdigit()) for n, _ in fused})
            raise ValueError(_experts_refused(f"{share:.1%} of the model's parameters are", kinds))
        return candidates
    if ADAPTER_ALIAS in patterns and not any(is_lora_name(n) for n, _ in candidates):
        raise ValueError(f"grads.module_filter names {ADAPTER_ALIAS!r}, the linears of a LoRA adapter, but the model"
                         " has no adapter: set model.adapter, or drop it from the filter.")
    chosen = [(n, m) for n, m in candidates if filter_matches(n, patterns)]
    if not chosen:
        # Show distinct module "kinds" (name without the layer index) first: more useful than
        # the first few names, which all belong to layer 0.
        kinds = sorted({".".join(p for p in n.split(".") if not p.isdigit()) for n, _ in candidates})
        lora = any(is_lora_name(n) for n, _ in candidates)
        raise ValueError(
            f"grads.module_filter {list(patterns)} matches no linear module in the transformer blocks."
            f" Patterns are substrings or fnmatch globs of the full name. Available (e.g.):"
            f" {', '.join(n for n, _ in candidates[:6])}; kinds: {', '.join(kinds[:12])}"
            + (f". The LoRA adapter's linears: a pattern with lora_ (lora_A, lora_B) or {ADAPTER_ALIAS}" if lora else "")
            + ".")
    return chosen


def _experts_refused(what: str, kinds: list[str]) -> str:
    return (f"{what} mixture-of-experts weights stored as fused 3-D tensors ({', '.join(kinds[:4])}), which"
            " Gradian does not index; an index of every linear module would leave them out: set"
            " grads.module_filter to the modules to index (e.g. [attn], the attention projections) to index the"
            " rest knowingly.")


def filter_matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether grads.module_filter `patterns` select the module `name` (canonical): the adapter's
    LoRA linears only by the alias `adapter` or a pattern containing `lora_`, every other module by
    `module_pattern_matches`."""
    lora = is_lora_name(name)
    for pattern in patterns:
        if pattern == ADAPTER_ALIAS:
            if lora:
                return True
        elif (not lora or "lora_" in pattern) and module_pattern_matches(name, pattern):
            return True
    return False


def module_pattern_matches(name: str, pattern: str) -> bool:
    """grads.module_filter semantics: a glob ("*.mlp.c_proj") matches the whole module name,
    a plain pattern ("down_proj") is a substring."""
    return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name


def _layout(s: dict[str, Any]) -> tuple[str, list[tuple[str, str, tuple[int, int]]]]:
    """(block prefix, linear layout) of a shape, from its family; a shape without `model_type`
    (given in a model yaml) is taken to be the family's released checkpoint class."""
    fam = family(s["family"])
    return fam.prefix(s.get("model_type")), fam.linear_layout(s)


def linear_module_shapes(shape: dict[str, Any], patterns: list[str] | None = None,
                         lora: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """Linear modules of the blocks as name -> (d_out, d_in), from the shape alone (no model),
    filtered like grads.module_filter; names follow the Hugging Face modules of each family.
    `lora`: a kept LoRA adapter's linears, `<target>.lora_A` / `.lora_B` -> (d_out, d_in)
    (`circuitkit.models.lora.lora_linear_shapes`), placed after their target as `select_modules`
    finds them."""
    s = shape_dict(shape)
    prefix, layout = _layout(s)
    if not patterns and family(s["family"]).fused_experts:
        raise ValueError(_experts_refused(f"the experts of this {s['family']} model are", ["the MLPs' experts"]))
    out = {}
    for layer in range(s["n_layers"]):
        for suffix, _, dims in layout:
            name = prefix.format(l=layer) + suffix
            for one, one_dims in [(name, dims), *((f"{name}.{k}", (lora or {}).get(f"{name}.{k}")) for k in LORA_KINDS)]:
                if one_dims is not None and (not patterns or filter_matches(one, patterns)):
                    out[one] = one_dims
    return out


def circuit_module_shapes(shape: dict[str, Any], head_mask: Any | None = None,
                          mlp_mask: Any | None = None) -> dict[str, tuple[int, int]]:
    """Sites of a circuit-restricted index (`gradian.capture.sites`) as name -> (d_out, d_in), from the
    shape alone: per kept head its (d_model, head_dim) block of the attention output projection
    (the family's z input), per kept MLP its output linear (none for fused experts). head_mask
    (L, H) / mlp_mask (L,) None = all kept (the upper bound used before the pruning stage has
    written the circuit)."""
    s = shape_dict(shape)
    fam = family(s["family"])
    prefix = fam.prefix(s.get("model_type"))
    dims = {suffix: d for suffix, _, d in fam.linear_layout(s)}
    o_suffix, mlp_out = fam.paths["attn_out"], fam.paths.get("mlp_out")
    out: dict[str, tuple[int, int]] = {}
    for layer in range(s["n_layers"]):
        for h in range(s["n_heads"]):
            if head_mask is None or bool(head_mask[layer][h]):
                out[f"{prefix.format(l=layer)}{o_suffix}:head{h}"] = (s["d_model"], s["head_dim"])
        if mlp_out is not None and (mlp_mask is None or bool(mlp_mask[layer])):
            out[prefix.format(l=layer) + mlp_out] = dims[mlp_out]
    return out


def block_role(name: str, shape: dict[str, Any]) -> tuple[int, str]:
    """(layer, role) of a module of the blocks named as `linear_module_shapes` or
    `circuit_module_shapes` name it: role "mlp_in" (an MLP input projection), "mlp_out" (an MLP
    output projection) or "attention" (anything else, circuit sites such as `...:head1` included),
    as the shape's family lays its linear modules out."""
    s = shape_dict(shape)
    prefix, layout = _layout(s)
    head, _, tail = prefix.partition("{l}")
    if not name.startswith(head):
        return 0, ATTENTION
    layer_text, _, suffix = name[len(head):].partition(tail or ".")
    if not layer_text.isdigit():
        return 0, ATTENTION
    roles = {path: role for path, role, _ in layout}
    return int(layer_text), roles.get(strip_lora(suffix.split(":", 1)[0]), ATTENTION)


def parameter_share(model: nn.Module, modules: Sequence[tuple[str, nn.Module]]) -> float:
    """Share of the model's parameters (elements) held by `modules` (their weights and biases)."""
    total = sum(p.numel() for p in model.parameters())
    covered = sum(p.numel() for _, m in modules for p in m.parameters(recurse=False))
    return covered / total if total else 0.0


def fused_expert_parameters(model: nn.Module, adapter) -> list[tuple[str, int]]:
    """(name, elements) of the 3-D parameters inside the blocks (mixture-of-experts weights stored
    fused, one slice per expert), which no linear module holds and so no index covers."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for block in adapter.blocks:
        for name, p in block.named_parameters(prefix=names[id(block)]):
            if p.dim() >= 3:
                out.append((name, p.numel()))
    return out
