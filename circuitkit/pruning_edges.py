"""Edge-level circuits: keep the top edges, ablate the rest, measure the metric.

In a circuit forward pass every downstream input v (a head's Q, K or V input, an MLP input,
the logits) reads its own residual stream

    in_v = resid_v - Σ_{u→v removed} (write_u(live) - write_u(ablated))

where write_u(live) is what node u writes in this very pass and write_u(ablated) is its
corrupted, mean or zero value. With every edge kept this is the model itself; with none kept,
every input sees only ablated writes.
"""

from __future__ import annotations

import torch

from circuitkit.attribution.eap import cached_run, deltas, graph_of, head_writes
from circuitkit.attribution.metrics import answer_forward, compute_metric
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, first_output, replace_first
from circuitkit.models.placement import input_device, resident
from circuitkit.tasks.base import TaskData


def fit_positions(values: torch.Tensor, n_positions: int) -> torch.Tensor:
    """(..., T, D) -> (..., n_positions, D): truncate, or extend with the mean over positions."""
    T = values.shape[-2]
    if n_positions <= T:
        return values[..., :n_positions, :]
    extra = values.mean(-2, keepdim=True).expand(*values.shape[:-2], n_positions - T, values.shape[-1])
    return torch.cat([values, extra], dim=-2)


def upstream_writes(adapter: ModelAdapter, rec: dict) -> torch.Tensor:
    """What every upstream node wrote in a recorded run: (n_upstream, B, T, d_model) float32."""
    H, dh = adapter.n_heads, adapter.head_dim
    rows = [rec.embed.float().unsqueeze(0)]
    for layer in range(adapter.n_layers):
        z = rec.z[layer].unflatten(-1, (H, dh))
        rows.append(head_writes(adapter, layer, z, rec.attn_total[layer]))
        rows.append(rec.mlp[layer].float().unsqueeze(0))
    return torch.cat(rows)


@torch.no_grad()
def mean_writes(adapter: ModelAdapter, data: TaskData, batch_size: int) -> torch.Tensor:
    """Mean write of every upstream node over the clean examples per position: (n_up, T, d)."""
    device = input_device(adapter.model)
    total = count = None
    for batch in data.batches(batch_size):
        batch = batch.to(device)
        writes = upstream_writes(adapter, cached_run(adapter, batch.clean_ids, batch.attention_mask,
                                                     batch.answer_pos, edges=True))
        w = batch.attention_mask.float()[None, :, :, None]
        part, n = (writes * w).sum(1), w.sum(1)
        total = part if total is None else total + part
        count = n if count is None else count + n
    return (total / count.clamp(min=1)).cpu()


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


class EdgeEvaluator:
    """Mean metric on held-out examples when only the kept edges carry live values."""

    def __init__(self, adapter: ModelAdapter, data: TaskData, metric: str, ablation: str,
                 mean_values: torch.Tensor | None, batch_size: int) -> None:
        self.adapter, self.metric = adapter, metric
        device = input_device(adapter.model)
        self.batches = []
        for batch in data.batches(batch_size):
            batch = batch.to(device)
            clean = cached_run(adapter, batch.clean_ids, batch.attention_mask, batch.answer_pos, edges=True)
            if ablation == "corrupted":
                corrupted = cached_run(adapter, batch.corrupted_ids, batch.attention_mask, batch.answer_pos, edges=True)
                ablated = upstream_writes(adapter, clean) - deltas(adapter, clean, corrupted, edges=True).up
            elif ablation == "mean":
                ablated = fit_positions(mean_values.to(device), batch.clean_ids.shape[1]).unsqueeze(1)
            else:
                ablated = torch.zeros(1, 1, 1, 1, device=device)
            self.batches.append((batch, clean.logits.float(), ablated))
        self.n = len(data)

    @torch.no_grad()
    def __call__(self, kept: torch.Tensor | None) -> float:
        """kept: (n_upstream, n_downstream) bool, or None for the full model."""
        total = 0.0
        for batch, clean_answer, ablated in self.batches:
            with HookSet() as hk:
                if kept is not None:
                    _install_edge_circuit(self.adapter, hk, ~kept.to(ablated.device), ablated)
                logits = answer_forward(self.adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
            total += compute_metric(self.metric, logits, batch, clean_answer).sum().item()
        return total / self.n
