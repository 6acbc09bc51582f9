"""EAP-IG-activations: integrated gradients along each layer's own activations (MIB's second IG variant).

EAP-IG-inputs (`circuitkit.discovery.attribution.eap`) interpolates only the input embeddings. Here each
group of nodes G (the input embedding; the heads of attention layer l, through z; MLP l's
output) is interpolated on its own, with the rest of the forward computed live from the clean
prompt:

    a_G(α) = ã_G + α (a_G - ã_G)          (ã: the corrupted run's value)

    node:  s(u)   = Σ_positions Δ_u · Σ_k w_k ∂m/∂a_u        at a_{G(u)}(α_k)
    edge:  s(u→v) = Σ_positions Δ_u · Σ_k w_k ∂m/∂in_v       at a_{G(u)}(α_k)

with the points α_k and weights w_k of `discovery.ig_rule` (every rule of
`circuitkit.discovery.attribution.quadrature`; m = ig_steps). A node's gradient is read only in the
passes that interpolate its own group, so the cost is m forward+backward passes per group and
batch: m · (2L + 1) passes (O(m x layers)), against m for EAP-IG-inputs. The peak memory is
that of one EAP-IG pass (one group's gradient sums live at a time).
"""

from __future__ import annotations

import torch

from circuitkit.core.progress import Tasks as Progress
from circuitkit.discovery.attribution.accumulators import add_metrics, host_copy, score_accumulators, to_host
from circuitkit.discovery.attribution.eap import (
    AttributionScores,
    _gradient_run,
    _GradientSums,
    cached_run,
    deltas,
    graph_of,
    integration_rule,
)
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_output, replace_first_output
from circuitkit.models.placement import input_device


def groups(n_layers: int) -> list[tuple[str, int | None]]:
    """The interpolated groups in forward order: input, then per layer attention and MLP."""
    out: list[tuple[str, int | None]] = [("input", None)]
    for layer in range(n_layers):
        out += [("attn", layer), ("mlp", layer)]
    return out


def passes_per_batch(n_layers: int, ig_steps: int | None, ig_rule: str) -> int:
    """Forward+backward passes per batch: m · (2L + 1)."""
    return integration_rule("eap-ig", ig_steps, ig_rule).passes * len(groups(n_layers))


def _interpolate(adapter: ModelAdapter, hk: HookSet, kind: str, layer: int, clean: torch.Tensor,
                 corrupted: torch.Tensor, alpha: float) -> None:
    """Replace group (kind, layer)'s activation by corrupted + α (clean - corrupted)."""
    value = (corrupted.float() + alpha * (clean.float() - corrupted.float())).to(clean.dtype).detach()
    # value + 0 x (the live activation): the forward sees the interpolated value and the backward
    # still reaches the input embedding, so the gradient hooks of `_gradient_run` fire here
    if kind == "attn":
        def pre(module, args):
            return (value + args[0] * 0, *args[1:])
        hk.pre(adapter.z_input(layer), pre)
    else:
        def post(module, args, out):
            live = first_output(out)
            return replace_first_output(out, value.to(live.dtype) + live * 0)
        hk.post(adapter.mlp_write(layer), post)


def _rows(graph, kind: str, layer: int | None) -> list[int]:
    """Upstream rows of a group."""
    if kind == "input":
        return [0]
    if kind == "attn":
        return [graph.head_index(layer, h) for h in range(graph.n_heads)]
    return [graph.mlp_index(layer)]


def _contract(adapter, graph, kind, layer, delta, grad_sums, n_points, out, per_example) -> None:
    """Add group (kind, layer)'s scores (its nodes; at edge level its rows) to `out`, and to the
    batch's `per_example` rows (on out's device) when kept."""
    H, dh = adapter.n_heads, adapter.head_dim
    dev = out["head"].device
    if kind == "input":
        contrib = (delta.embed * grad_sums.embed).flatten(1).sum(1) / n_points  # (B,)
        out["embed"] += contrib.sum().to(dev)
    elif kind == "attn":
        contrib = torch.einsum("bthe,bthe->bh", delta.z[layer], grad_sums.z[layer].unflatten(-1, (H, dh))) / n_points
        out["head"][layer] += contrib.sum(0).to(dev)
        if per_example is not None:
            per_example["head"][:, layer] += contrib.to(dev)
    else:
        out["mlp"][layer] += ((delta.mlp[layer] * grad_sums.mlp[layer]).sum() / n_points).to(dev)
    if not grad_sums.edges:
        return
    rows = _rows(graph, kind, layer)
    up = delta.up[rows].flatten(2)  # (k, B, T*d)
    first = rows[0]
    for j in range(adapter.n_layers):
        cols = graph.layer_columns(j)
        n_attn, n_mlp = graph.upstream_before_attn(j), graph.upstream_before_mlp(j)
        g = grad_sums.inputs[j].flatten(2).to(up.device)  # (per_layer_inputs, B, T*d)
        if first < n_attn:
            e = torch.einsum("ubx,vbx->buv", up, g[:-1]) / n_points
            out["edges"][rows, cols.start:cols.stop - 1] += e.sum(0).to(dev)
            if per_example is not None:
                per_example["edges"][:, rows, cols.start:cols.stop - 1] += e.to(dev)
        if first < n_mlp:
            e = torch.einsum("ubx,bx->bu", up, g[-1]) / n_points
            out["edges"][rows, cols.stop - 1] += e.sum(0).to(dev)
            if per_example is not None:
                per_example["edges"][:, rows, cols.stop - 1] += e.to(dev)
    e = torch.einsum("ubx,bx->bu", up, grad_sums.logits.flatten(1).to(up.device)) / n_points
    out["edges"][rows, graph.logits_column] += e.sum(0).to(dev)
    if per_example is not None:
        per_example["edges"][:, rows, graph.logits_column] += e.to(dev)


def attribute_activations(adapter: ModelAdapter, data: TaskData, level: str = "node", metric: str = "logit_diff",
                          ig_steps: int | None = 5, batch_size: int = 4, progress: bool = True,
                          ig_rule: str = "right", group_by_length: bool = True, sums: bool = False,
                          per_example: bool = False) -> AttributionScores:
    """EAP-IG-activations scores, in the layout of `attribute` (means over examples; sums with
    `sums=True`; `per_example=True` keeps each example's head and edge scores)."""
    rule = integration_rule("eap-ig", ig_steps, ig_rule)
    edges = level == "edge"
    graph = graph_of(adapter)
    device = input_device(adapter.model)
    dtype = adapter.embed.weight.dtype
    L, H = adapter.n_layers, adapter.n_heads
    out = score_accumulators(graph, edges, device)
    rows_per_example: dict[str, list] = {}
    planned = data.length_batches(batch_size, group_by_length)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"scoring every {level} with eap-ig-activations", total=len(planned) * len(groups(L)))
        for batch in planned:
            batch = batch.to(device, non_blocking=True)
            clean = cached_run(adapter, batch.clean_ids, batch.forward_mask, batch.answers, edges)
            corrupted = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, edges)
            clean_answer = clean.logits.float()
            add_metrics(out, metric, clean.logits, corrupted.logits, batch, clean_answer)
            delta = deltas(adapter, clean, corrupted, edges)
            B = batch.clean_ids.shape[0]
            pe = None
            if per_example:
                pe = {"head": torch.zeros(B, L, H, device=device)}
                if edges:
                    pe["edges"] = torch.zeros(B, len(graph.upstream), len(graph.downstream), device=device)
            for kind, layer in groups(L):
                grad_sums = _GradientSums(adapter, edges)
                for alpha, relative_weight in zip(rule.alphas, rule.relative_weights, strict=True):
                    grad_sums.relative_weight = relative_weight
                    if kind == "input":
                        e_k = (corrupted.embed.float() + alpha * (clean.embed.float() - corrupted.embed.float()))
                        with HookSet():
                            _gradient_run(adapter, batch.clean_ids, batch.forward_mask, e_k.to(dtype), batch,
                                          metric, clean_answer, grad_sums)
                        continue
                    src = (clean.z[layer], corrupted.z[layer]) if kind == "attn" else (clean.mlp[layer],
                                                                                      corrupted.mlp[layer])
                    with HookSet() as hk:  # registered before _gradient_run's hooks, so they see the leaf
                        _interpolate(adapter, hk, kind, layer, src[0], src[1], alpha)
                        _gradient_run(adapter, batch.clean_ids, batch.forward_mask, clean.embed, batch, metric,
                                      clean_answer, grad_sums)
                _contract(adapter, graph, kind, layer, delta, grad_sums, rule.passes, out, pe)
                bar.advance(task)
            if pe is not None:
                for key, value in pe.items():  # once per batch, queued
                    rows_per_example.setdefault(key, []).append(host_copy(value))
            del clean, corrupted, delta, grad_sums  # freed before the next batch's runs, not after
    n = 1 if sums else len(data)
    host = to_host(out, n)  # the stage's one wait for the device; per-example rows are complete after it
    metric_clean, metric_corrupted = (host["metric"] / n).tolist()
    return AttributionScores(
        head=host["head"], mlp=host["mlp"], embed=host["embed"], graph=graph, edges=host.get("edges"),
        metric_clean=metric_clean, metric_corrupted=metric_corrupted, n_examples=len(data),
        info={"algorithm": "eap-ig-activations", "level": level, "metric": metric, "ig_steps": rule.passes,
              "ig_rule": rule.rule, "passes": rule.passes * len(groups(L)), "batch_size": batch_size},
        per_example={k: torch.cat(v) for k, v in rows_per_example.items()} if per_example else None)
