"""Exact activation patching: the oracle that EAP / EAP-IG approximate (small models only).

    node u:    s(u)   = m(clean) - m(clean with u's value taken from the corrupted run)
    edge u→v:  s(u→v) = m(clean) - m(clean with v's own input shifted by -Δ_u)

where Δ_u is the difference of what u writes to the residual stream (clean - corrupted).
Only v sees the change (for a head's Q/K/V input, only that head or KV head); everything
downstream of v responds. Costs one forward per node or per edge and batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from circuitkit.core.progress import Tasks as Progress
from circuitkit.discovery.attribution.eap import AttributionScores, cached_run, deltas, graph_of
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, replace_first, replace_first_output
from circuitkit.models.placement import input_device


def _metric(adapter, batch, metric, clean_answer, hooks_fn=None) -> torch.Tensor:
    with torch.no_grad(), HookSet() as hk:
        if hooks_fn is not None:
            hooks_fn(hk)
        logits = answer_forward(adapter.model, batch.clean_ids, batch.forward_mask, batch.answers)
    return compute_metric(metric, logits, batch, clean_answer)


def _node_patches(adapter: ModelAdapter, corrupted: dict):
    """(kind, index, install) for every node; install(hk) patches it to its corrupted value."""
    H, dh = adapter.n_heads, adapter.head_dim
    yield "embed", None, lambda hk: hk.pre(adapter.blocks[0], lambda m, a, k: replace_first(a, k, corrupted.embed),
                                           with_kwargs=True)
    for layer in range(adapter.n_layers):
        for h in range(H):
            def patch_z(hk, layer=layer, h=h):
                def hook(module, args):
                    z = args[0].clone()
                    z[..., h * dh:(h + 1) * dh] = corrupted.z[layer][..., h * dh:(h + 1) * dh]
                    return (z, *args[1:])
                hk.pre(adapter.z_input(layer), hook)
            yield "head", (layer, h), patch_z

        def patch_mlp(hk, layer=layer):
            def hook(module, args, out):
                return replace_first_output(out, corrupted.mlp[layer])
            hk.post(adapter.mlp_write(layer), hook)
        yield "mlp", layer, patch_mlp


def _edge_patch(adapter: ModelAdapter, graph, column: int, delta_u: torch.Tensor | Callable[[], torch.Tensor]):
    """install(hk) that shifts downstream input `column` by -delta_u (B, T, d_model).

    `delta_u` may be a function called when the hook fires (ACDC: a shift made of the live run's
    own upstream writes, `circuitkit.discovery.attribution.acdc`)."""
    shift = delta_u if callable(delta_u) else (lambda: delta_u)
    if column == graph.logits_column:
        def install(hk):
            hk.pre(adapter.final_norm, lambda m, a, k: replace_first(a, k, first_input(a, k) - shift().to(first_input(a, k).dtype)),
                   with_kwargs=True)
        return install
    layer, j = divmod(column, graph.per_layer_inputs)
    H, KV = adapter.n_heads, adapter.n_kv_heads
    if j == graph.per_layer_inputs - 1:  # the MLP input
        spec = adapter.norm_spec(adapter.mlp_norm(layer))

        def install(hk):
            hk.post(adapter.mlp_norm(layer), lambda m, args, out: spec.apply(args[0] - shift()).to(out.dtype))
        return install
    key, head = ("q", j) if j < H else (("k", j - H) if j < H + KV else ("v", j - H - KV))
    w = adapter.qkv_weights(layer)
    weight = {"q": w.w_q, "k": w.w_k, "v": w.w_v}[key][head].float()  # (dh, d_model)
    bias = {"q": w.b_q, "k": w.b_k, "v": w.b_v}[key]
    spec = adapter.norm_spec(adapter.attn_norm(layer))
    x_live: dict = {}

    def install(hk):
        def grab(module, args, out):
            x_live["x"] = args[0]
        hk.post(adapter.attn_norm(layer), grab)
        for site in adapter.qkv_sites(layer):
            def hook(module, args, out, site=site):
                parts = site.split(out)
                if key not in parts:
                    return None
                new = spec.apply(x_live["x"] - shift()) @ weight.T
                if bias is not None:
                    new = new + bias[head].float()
                patched = parts[key].clone()
                patched[..., head, :] = new.to(patched.dtype)
                return site.merge({**parts, key: patched})
            hk.post(site.module, hook)
    return install


def exact_patching(adapter: ModelAdapter, data: TaskData, level: str = "node", metric: str = "logit_diff",
                   batch_size: int = 4, progress: bool = True, sums: bool = False,
                   per_example: bool = False) -> AttributionScores:
    """Exact patching scores, in the same layout as `attribute` (means over examples; sums
    over them with `sums=True`; `per_example=True` also keeps every example's head scores,
    `per_example["head"]` (N, L, H), for stability and bootstrapped selection)."""
    graph = graph_of(adapter)
    device = input_device(adapter.model)
    L, H = adapter.n_layers, adapter.n_heads
    head, mlp, embed = torch.zeros(L, H), torch.zeros(L), torch.zeros(())
    edge_mask = graph.edge_mask()
    edges = torch.zeros(edge_mask.shape) if level == "edge" else None
    m_clean_total = m_corrupted_total = 0.0
    head_rows: list[torch.Tensor] = []
    n_batches = (len(data) + batch_size - 1) // batch_size
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"patching every {level} exactly", total=n_batches)
        for batch in data.batches(batch_size):
            batch = batch.to(device)
            clean = cached_run(adapter, batch.clean_ids, batch.forward_mask, batch.answers, level == "edge")
            corrupted = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, level == "edge")
            clean_answer = clean.logits.float()
            m_clean = compute_metric(metric, clean.logits, batch, clean_answer)
            m_clean_total += m_clean.sum().item()
            m_corrupted_total += compute_metric(metric, corrupted.logits, batch, clean_answer).sum().item()
            rows = torch.zeros(batch.clean_ids.shape[0], L, H)
            for kind, idx, install in _node_patches(adapter, corrupted):
                per = (m_clean - _metric(adapter, batch, metric, clean_answer, install)).float().cpu()
                s = per.sum()
                if kind == "embed":
                    embed += s
                elif kind == "head":
                    head[idx] += s
                    rows[:, idx[0], idx[1]] = per
                else:
                    mlp[idx] += s
            if per_example:
                head_rows.append(rows)
            if edges is not None:
                up = deltas(adapter, clean, corrupted, edges=True).up
                for u, v in edge_mask.nonzero().tolist():
                    install = _edge_patch(adapter, graph, v, up[u])
                    edges[u, v] += (m_clean - _metric(adapter, batch, metric, clean_answer, install)).sum().cpu()
                del up
            del clean, corrupted, install  # freed before the next batch's runs, not after
            bar.advance(task)
    n = 1 if sums else len(data)
    return AttributionScores(head / n, mlp / n, embed / n, graph, None if edges is None else edges / n,
                             m_clean_total / n, m_corrupted_total / n, len(data),
                             {"algorithm": "exact", "level": level, "metric": metric, "batch_size": batch_size},
                             per_example={"head": torch.cat(head_rows)} if per_example else None)
