"""Slow reference for edge scores: every Q/K/V/MLP input of a layer gets its own explicit copy
of the residual stream, so ∂m/∂in_v is read straight off autograd (no closed-form norm
backward, no W_Qᵀ trick). One forward+backward per layer and interpolation point.
"""

from __future__ import annotations

import torch

from circuitkit.discovery.attribution.eap import cached_run, deltas, graph_of, interpolation_points
from circuitkit.discovery.attribution.metrics import answer_logits, compute_metric
from circuitkit.models.hooks import HookSet, replace_first


def _layer_input_grads(adapter, batch, e_k, layer, metric, clean_answer):
    """(per_layer_inputs, B, T, d) gradients at explicit copies of layer `layer`'s inputs.

    Two passes: copies of the attention inputs, then a copy of the MLP input (a copy of the
    MLP input in the first pass would cut the attention -> MLP path of the same layer)."""
    attn = _input_grads(adapter, batch, e_k, layer, metric, clean_answer, "attn")
    mlp = _input_grads(adapter, batch, e_k, layer, metric, clean_answer, "mlp")
    return torch.cat([attn, mlp])


def _input_grads(adapter, batch, e_k, layer, metric, clean_answer, which):
    H, KV = adapter.n_heads, adapter.n_kv_heads
    w = adapter.qkv_weights(layer)
    attn_spec, mlp_spec = adapter.norm_spec(adapter.attn_norm(layer)), adapter.norm_spec(adapter.mlp_norm(layer))
    copies = {}

    def per_head(x, weight, bias, n, key):
        xs = x.detach().float().unsqueeze(0).repeat(n, 1, 1, 1).requires_grad_(True)  # (n, B, T, d)
        copies[key] = xs
        out = torch.einsum("nbtd,ned->btne", attn_spec.apply(xs), weight.float())
        return out if bias is None else out + bias.float()

    with HookSet() as hk:
        hk.pre(adapter.blocks[0], lambda m, a, k: replace_first(a, k, e_k), with_kwargs=True)
        live = {}
        hk.post(adapter.attn_norm(layer), lambda m, args, out: live.__setitem__("x", args[0]))
        for site in adapter.qkv_sites(layer) if which == "attn" else []:
            def hook(module, args, out, site=site):
                parts = site.split(out)
                for key, weight, bias, n in (("q", w.w_q, w.b_q, H), ("k", w.w_k, w.b_k, KV), ("v", w.w_v, w.b_v, KV)):
                    if key in parts:
                        parts[key] = per_head(live["x"], weight, bias, n, key).to(out.dtype)
                return site.merge(parts)
            hk.post(site.module, hook)

        def mlp_hook(module, args, out):
            xm = args[0].detach().float().unsqueeze(0).requires_grad_(True)
            copies["mlp"] = xm
            return mlp_spec.apply(xm)[0].to(out.dtype)
        if which == "mlp":
            hk.post(adapter.mlp_norm(layer), mlp_hook)
        logits = adapter.model(input_ids=batch.clean_ids, attention_mask=batch.attention_mask).logits
        value = compute_metric(metric, logits, batch, clean_answer).sum()
    keys = ["q", "k", "v"] if which == "attn" else ["mlp"]
    grads = torch.autograd.grad(value, [copies[k] for k in keys])
    return torch.cat([g.float() for g in grads])


def _logits_grad(adapter, batch, e_k, metric, clean_answer):
    with HookSet() as hk:
        hk.pre(adapter.blocks[0], lambda m, a, k: replace_first(a, k, e_k), with_kwargs=True)
        leaf = {}

        def final_hook(module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
            leaf["x"] = x
            return replace_first(args, kwargs, x)
        hk.pre(adapter.final_norm, final_hook, with_kwargs=True)
        logits = adapter.model(input_ids=batch.clean_ids, attention_mask=batch.attention_mask).logits
        value = compute_metric(metric, logits, batch, clean_answer).sum()
    return torch.autograd.grad(value, leaf["x"])[0].float()


def reference_edge_scores(adapter, data, algorithm="eap-ig", metric="logit_diff", ig_steps=3,
                          alphas=None) -> torch.Tensor:
    """(n_upstream, n_downstream) edge scores, means over examples, computed the slow way.

    `alphas`: the interpolation points, equal weights (default: the `right` rule's, as CircuitKit
    computes them); pass another grid to reproduce another implementation's."""
    graph = graph_of(adapter)
    alphas = interpolation_points(algorithm, ig_steps) if alphas is None else list(alphas)
    mask = graph.edge_mask()
    scores = torch.zeros(mask.shape)
    dtype = adapter.embed.weight.dtype
    for batch in data.batches(len(data)):
        clean = cached_run(adapter, batch.clean_ids, batch.attention_mask, batch.answer_pos, True)
        corrupted = cached_run(adapter, batch.corrupted_ids, batch.attention_mask, batch.answer_pos, True)
        clean_answer = answer_logits(clean.logits, batch)
        up = deltas(adapter, clean, corrupted, True).up.flatten(1)
        for alpha in alphas:
            e_k = (corrupted.embed.float() + alpha * (clean.embed.float() - corrupted.embed.float())).to(dtype)
            cols = []
            for layer in range(adapter.n_layers):
                cols.append(_layer_input_grads(adapter, batch, e_k, layer, metric, clean_answer))
            cols.append(_logits_grad(adapter, batch, e_k, metric, clean_answer).unsqueeze(0))
            g = torch.cat(cols).flatten(1)  # (n_downstream, B*T*d)
            scores += (up @ g.T) / len(alphas)
    return (scores * mask) / len(data)
