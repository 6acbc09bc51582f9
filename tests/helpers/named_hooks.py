"""Named hook points on a Hugging Face model (TransformerLens' vocabulary), for the tests.

    hook_embed                    residual stream entering block 0 (token (+ position) embedding)
    blocks.{l}.hook_resid_pre     residual stream entering block l              (B, T, d_model)
    blocks.{l}.hook_attn_in       attention input after its norm                (B, T, d_model)
    blocks.{l}.attn.hook_q        query projection per head, before RoPE/q_norm (B, T, n_heads, head_dim)
    blocks.{l}.attn.hook_k        key projection per KV head                    (B, T, n_kv_heads, head_dim)
    blocks.{l}.attn.hook_v        value projection per KV head                  (B, T, n_kv_heads, head_dim)
    blocks.{l}.attn.hook_z        input of the output projection, per head      (B, T, n_heads, head_dim)
    blocks.{l}.hook_attn_out      what attention writes to the residual (after Gemma's post-norm)
    blocks.{l}.hook_mlp_in        MLP input after its norm                      (B, T, d_model)
    blocks.{l}.hook_mlp_out       what the MLP writes to the residual (after Gemma's post-norm)
    blocks.{l}.hook_resid_post    residual stream leaving block l
    hook_resid_final              input of the final norm

A hook function is `fn(value, name) -> new_value | None`; returning None leaves the model's
own tensor in place, so read-only hooks leave the logits bit-identical.

The package hooks through `circuitkit.models.hooks.HookSet` at the sites the adapter names
(`z_input`, `attn_write`, `mlp_write`, `qkv_sites`); this layer of names on the same sites is
the tests' way to read and patch an activation by name (tests/models/test_adapters.py checks that it
leaves the logits bit-identical and that its per-head Q/K/V and z agree with the weights).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, first_output, replace_first, replace_first_output

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]
_NAME = re.compile(r"^blocks\.(\d+)\.(hook_resid_pre|hook_attn_in|attn\.hook_[qkvz]|hook_attn_out|"
                   r"hook_mlp_in|hook_mlp_out|hook_resid_post)$")



def hook_names(adapter: ModelAdapter) -> list[str]:
    """Every hook point of the model, in forward order."""
    names = ["hook_embed"]
    for layer in range(adapter.n_layers):
        names += [f"blocks.{layer}.{s}" for s in (
            "hook_resid_pre", "hook_attn_in", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
            "hook_attn_out", "hook_mlp_in", "hook_mlp_out", "hook_resid_post")]
    return names + ["hook_resid_final"]


def _apply(fns: Sequence[tuple[str, HookFn]], value: torch.Tensor) -> torch.Tensor | None:
    changed = None
    for name, fn in fns:
        out = fn(value if changed is None else changed, name)
        if out is not None:
            changed = out
    return changed


def _pre_hook(fns: Sequence[tuple[str, HookFn]]):
    """Forward pre-hook acting on the module's first input (positional or `hidden_states`)."""
    def hook(module, args, kwargs):
        new = _apply(fns, first_input(args, kwargs))
        return None if new is None else replace_first(args, kwargs, new)
    return hook


def _post_hook(fns: Sequence[tuple[str, HookFn]]):
    """Forward hook acting on the module's output (first element when it returns a tuple)."""
    def hook(module, args, output):
        new = _apply(fns, first_output(output))
        return None if new is None else replace_first_output(output, new)
    return hook


def _z_hook(fns: Sequence[tuple[str, HookFn]], n_heads: int, head_dim: int):
    def hook(module, args):
        z = args[0]
        new = _apply(fns, z.view(*z.shape[:-1], n_heads, head_dim))
        return None if new is None else (new.reshape(z.shape), *args[1:])
    return hook


def _qkv_hook(site, fns_by_part: Mapping[str, Sequence[tuple[str, HookFn]]]):
    def hook(module, args, output):
        parts = site.split(output)
        changed = False
        for part, fns in fns_by_part.items():
            if part in parts and fns:
                new = _apply(fns, parts[part])
                if new is not None:
                    parts[part] = new
                    changed = True
        return site.merge(parts) if changed else None
    return hook


@contextmanager
def hooks(adapter: ModelAdapter, fns: Mapping[str, HookFn | Sequence[HookFn]]) -> Iterator[None]:
    """Install hook functions by name for the duration of the block.

    >>> with hooks(adapter, {"blocks.1.attn.hook_z": lambda z, name: z * 0}):
    ...     logits = model(input_ids).logits
    """
    groups: dict[tuple[str, int], list[tuple[str, HookFn]]] = defaultdict(list)
    for name, fn_or_list in fns.items():
        fn_list = list(fn_or_list) if isinstance(fn_or_list, (list, tuple)) else [fn_or_list]
        if name == "hook_embed":
            key = ("blocks.0.hook_resid_pre", -1)
        elif name == "hook_resid_final":
            key = (name, -1)
        else:
            m = _NAME.match(name)
            if m is None or int(m.group(1)) >= adapter.n_layers:
                raise KeyError(f"Unknown hook point '{name}'. Valid names look like"
                               f" 'blocks.0.attn.hook_z' (layers 0..{adapter.n_layers - 1}); see hook_names().")
            key = (m.group(2), int(m.group(1)))
        groups[key] += [(name, fn) for fn in fn_list]

    qkv: dict[int, dict[str, list[tuple[str, HookFn]]]] = defaultdict(dict)
    with HookSet() as hk:
        for (kind, layer), fl in groups.items():
            if kind == "blocks.0.hook_resid_pre" or kind == "hook_resid_pre":
                block = adapter.blocks[0 if layer < 0 else layer]
                hk.pre(block, _pre_hook(fl), with_kwargs=True)
            elif kind == "hook_resid_final":
                hk.pre(adapter.final_norm, _pre_hook(fl), with_kwargs=True)
            elif kind == "hook_attn_in":
                hk.post(adapter.attn_norm(layer), _post_hook(fl))
            elif kind.startswith("attn.hook_") and kind[-1] in "qkv":
                qkv[layer][kind[-1]] = fl
            elif kind == "attn.hook_z":
                hook = _z_hook(fl, adapter.n_heads, adapter.head_dim)
                hk.pre(adapter.z_input(layer), hook)
            elif kind == "hook_attn_out":
                module = adapter.attn_write(layer)
                hk.post(module, _post_hook(fl))
            elif kind == "hook_mlp_in":
                hk.pre(adapter.mlp(layer), _pre_hook(fl), with_kwargs=True)
            elif kind == "hook_mlp_out":
                module = adapter.mlp_write(layer)
                hk.post(module, _post_hook(fl))
            elif kind == "hook_resid_post":
                hk.post(adapter.blocks[layer], _post_hook(fl))
        for layer, by_part in qkv.items():
            for site in adapter.qkv_sites(layer):
                hk.post(site.module, _qkv_hook(site, by_part))
        yield


def run_with_cache(adapter: ModelAdapter, input_ids: torch.Tensor, names: Sequence[str],
                   **forward_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward pass returning (logits, {hook name: value}) for the requested hook points."""
    cache: dict[str, torch.Tensor] = {}

    def store(value: torch.Tensor, name: str) -> None:
        cache[name] = value.detach()

    with hooks(adapter, {n: store for n in names}):
        logits = adapter.model(input_ids=input_ids, **forward_kwargs).logits
    return logits, cache
