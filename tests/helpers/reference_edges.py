"""The edge circuit written the direct way (CircuitKit's first implementation, kept as the reference):
every downstream input v reads resid_v - Σ_u removed(u, v) (write_u(live) - write_u(ablated)),
with the upstream writes concatenated and contracted against the full removed mask at each input."""

from __future__ import annotations

import torch

from circuitkit.discovery.attribution.eap import graph_of, head_writes
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, first_output, replace_first
from circuitkit.models.placement import resident


def _install_edge_circuit(adapter: ModelAdapter, hk: HookSet, removed: torch.Tensor, ablated: torch.Tensor) -> None:
    """Hooks that make every downstream input read only its kept edges (see module docstring)."""
    graph = graph_of(adapter)
    H, KV, dh, L = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim, adapter.n_layers
    live: list[torch.Tensor] = []  # upstream writes of this pass, in graph order
    state: dict = {}
    removed = removed.float()

    def shift(n_up: int, cols) -> torch.Tensor:
        diff = torch.cat(live)[:n_up] - ablated[:n_up]  # (n_up, B, T, d): rows written so far
        return torch.einsum("uv,ubtd->vbtd", removed[:n_up, cols], diff)

    hk.pre(adapter.blocks[0], lambda m, a, k: live.append(first_input(a, k).float().unsqueeze(0)), with_kwargs=True)
    for layer in range(L):
        cols = graph.layer_columns(layer)
        with resident(adapter.blocks[layer]):  # offloaded layers (model.device_map): real weights
            w = adapter.qkv_weights(layer)
            attn_spec = adapter.norm_spec(adapter.attn_norm(layer))
            mlp_spec = adapter.norm_spec(adapter.mlp_norm(layer))

        def attn_in(module, args, out, layer=layer, cols=cols, attn_spec=attn_spec, w=w):
            s = shift(graph.upstream_before_attn(layer), slice(cols.start, cols.stop - 1))  # (H+2KV, B, T, d)
            x = attn_spec.apply(args[0].unsqueeze(0) - s)  # each input's own normed residual
            q = torch.einsum("nbtd,ned->btne", x[:H], w.w_q.float())
            k = torch.einsum("nbtd,ned->btne", x[H:H + KV], w.w_k.float())
            v = torch.einsum("nbtd,ned->btne", x[H + KV:], w.w_v.float())
            for name, t, b in (("q", q, w.b_q), ("k", k, w.b_k), ("v", v, w.b_v)):
                state[name] = t if b is None else t + b.float()
        hk.post(adapter.attn_norm(layer), attn_in)
        for site in adapter.qkv_sites(layer):
            def qkv(module, args, out, site=site):
                parts = site.split(out)
                return site.merge({k: state[k].to(out.dtype) for k in parts})
            hk.post(site.module, qkv)

        def z_hook(module, args, layer=layer):
            state["z"] = args[0]
            if adapter.post_attn_norm(layer) is None:
                live.append(head_writes(adapter, layer, args[0].unflatten(-1, (H, dh)), None))
        hk.pre(adapter.z_input(layer), z_hook)
        if adapter.post_attn_norm(layer) is not None:
            def total_hook(module, args, layer=layer):
                live.append(head_writes(adapter, layer, state["z"].unflatten(-1, (H, dh)), args[0]))
            hk.pre(adapter.post_attn_norm(layer), total_hook)

        def mlp_in(module, args, out, layer=layer, cols=cols, mlp_spec=mlp_spec):
            s = shift(graph.upstream_before_mlp(layer), [cols.stop - 1])[0]
            return mlp_spec.apply(args[0] - s).to(out.dtype)
        hk.post(adapter.mlp_norm(layer), mlp_in)

        def mlp_out(module, args, out):
            live.append(first_output(out).float().unsqueeze(0))
        hk.post(adapter.mlp_write(layer), mlp_out)

    def final(module, args, kwargs):
        x = first_input(args, kwargs)
        return replace_first(args, kwargs, (x - shift(len(graph.upstream), [graph.logits_column])[0]).to(x.dtype))
    hk.pre(adapter.final_norm, final, with_kwargs=True)


@torch.no_grad()
def reference_metric(evaluator, kept: torch.Tensor) -> float:
    """The mean metric of `evaluator`'s batches (an EdgeEvaluator) with only `kept` edges live, the direct way."""
    total = 0.0
    for i, (batch, clean_answer, _) in enumerate(evaluator.batches):
        ablated = evaluator.ablated(i)  # recorded, or recomputed past the evaluator's memory budget
        with HookSet() as hk:
            _install_edge_circuit(evaluator.adapter, hk, ~kept.to(ablated.device), ablated)
            logits = answer_forward(evaluator.adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        total += compute_metric(evaluator.metric, logits, batch, clean_answer).sum().item()
    return total / evaluator.n
