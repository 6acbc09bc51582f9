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

from circuitkit.core.device import free_memory_bytes
from circuitkit.discovery.attribution.eap import cached_run, deltas, graph_of, head_writes
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, first_output, replace_first
from circuitkit.models.placement import input_device, resident


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


def _install_edge_circuit(adapter: ModelAdapter, hk: HookSet, kept: torch.Tensor, ablated: torch.Tensor,
                          soft: bool = False) -> None:
    """Hooks that make every downstream input read only its kept edges (see module docstring).

    `soft=True` takes `kept` as a float mask in [0, 1] (the edge-pruning mask of
    `circuitkit.discovery.pruning.optimize`) and stays differentiable in it: the shift of input v is
    Σ_u (1 - kept[u, v]) d_u over every row written before v, one contraction per group of
    rows written together (the groups are kept as written, not copied into one buffer).

    The shift of input v is Σ_u removed(u, v) d_u with d_u = write_u(live) - write_u(ablated).
    Every input reads every upstream row written before it (`Graph.edge_mask`), so removed =
    1 - kept on those rows and the shift is (Σ_u d_u) - Σ_{u kept} d_u: a running sum of the
    rows written so far minus a contraction over the kept rows only. Small circuits (the
    curve's first points) cost little more than a plain forward; rows are written into one
    preallocated buffer (no per-input concatenation).
    """
    graph = graph_of(adapter)
    H, KV, dh, L = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim, adapter.n_layers
    kept = kept.float()
    state: dict = {"n": 0, "diff": None, "cum": {}, "groups": []}  # rows written, their d_u, Σ of the first n rows

    def append(rows: torch.Tensor) -> None:  # rows (k, B, T, d) live writes, in graph order
        n, k = state["n"], rows.shape[0]
        if soft:
            state["groups"].append((n, rows.float() - (ablated[n:n + k] if ablated.shape[0] > 1 else ablated[0])))
            state["n"] = n + k
            return
        if state["diff"] is None:
            state["diff"] = torch.empty(len(graph.upstream), *rows.shape[1:], dtype=torch.float32, device=rows.device)
            state["cum"][0] = torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
        d = state["diff"][n:n + k]
        torch.sub(rows, ablated[n:n + k] if ablated.shape[0] > 1 else ablated[0], out=d)
        state["cum"][n + k] = state["cum"][n] + d.sum(0)
        state["n"] = n + k

    def shift(n_up: int, cols) -> torch.Tensor:
        if soft:
            total = None
            for start, d in state["groups"]:
                if start >= n_up:
                    break
                d = d[:n_up - start]
                part = torch.einsum("uv,ubtd->vbtd", 1 - kept[start:start + d.shape[0], cols], d)
                total = part if total is None else total + part
            return total
        sub = kept[:n_up, cols]  # (n_up, n_cols)
        base = state["cum"][n_up]
        rows = sub.any(1).nonzero().flatten()
        if rows.numel() == 0:
            return base.unsqueeze(0).expand(sub.shape[1], *base.shape)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if 2 * rows.numel() >= hi - lo:  # mostly kept rows: a view of the span, no gathered copy
            return base.unsqueeze(0) - torch.einsum("uv,ubtd->vbtd", sub[lo:hi], state["diff"][lo:hi])
        return base.unsqueeze(0) - torch.einsum("uv,ubtd->vbtd", sub[rows], state["diff"][rows])

    hk.pre(adapter.blocks[0], lambda m, a, k: append(first_input(a, k).float().unsqueeze(0)), with_kwargs=True)
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
                append(head_writes(adapter, layer, args[0].unflatten(-1, (H, dh)), None))
        hk.pre(adapter.z_input(layer), z_hook)
        if adapter.post_attn_norm(layer) is not None:
            def total_hook(module, args, layer=layer):
                append(head_writes(adapter, layer, state["z"].unflatten(-1, (H, dh)), args[0]))
            hk.pre(adapter.post_attn_norm(layer), total_hook)

        def mlp_in(module, args, out, layer=layer, cols=cols, mlp_spec=mlp_spec):
            s = shift(graph.upstream_before_mlp(layer), [cols.stop - 1])[0]
            return mlp_spec.apply(args[0] - s).to(out.dtype)
        hk.post(adapter.mlp_norm(layer), mlp_in)

        def mlp_out(module, args, out):
            append(first_output(out).float().unsqueeze(0))
        hk.post(adapter.mlp_write(layer), mlp_out)

    def final(module, args, kwargs):
        x = first_input(args, kwargs)
        return replace_first(args, kwargs, (x - shift(len(graph.upstream), [graph.logits_column])[0]).to(x.dtype))
    hk.pre(adapter.final_norm, final, with_kwargs=True)


# Share of the device memory free when an EdgeEvaluator is built that its recorded ablated writes
# may take. Under corrupted ablation they are (n_upstream, B, T, d_model) float32 per batch, kept
# for every evaluation batch: 1 + 32 x 33 upstream nodes of a Llama-8B shape, 100 pairs of 32
# tokens, make 55 GB. Batches past the share are recomputed (two recorded runs) at every use.
RECORD_SHARE = 0.5


class EdgeEvaluator:
    """Mean metric on held-out examples when only the kept edges carry live values.

    The clean and corrupted runs are recorded once; every edge kept is the clean run's metric
    and, under corrupted ablation, no edge kept is the corrupted run's (no forward for either).
    The ablated writes of each batch are kept while they fit in `record_budget_bytes` (default
    RECORD_SHARE of the free device memory); the batches beyond it recompute theirs from two
    recorded runs whenever a circuit forward needs them (`ablated(i)`): the same values, the peak
    bounded, about three times the forward cost for those batches. `recomputed` counts them.
    """

    def __init__(self, adapter: ModelAdapter, data: TaskData, metric: str, ablation: str,
                 mean_values: torch.Tensor | None, batch_size: int, record_budget_bytes: int | None = None) -> None:
        self.adapter, self.metric, self.ablation, self.mean_values = adapter, metric, ablation, mean_values
        self.valid = graph_of(adapter).edge_mask()
        device = input_device(adapter.model)
        budget = int(RECORD_SHARE * free_memory_bytes(device)) if record_budget_bytes is None else record_budget_bytes
        kept_bytes = 0
        self.batches = []
        self.m_clean = self.m_corrupted = 0.0
        for batch in data.batches(batch_size):
            batch = batch.to(device)
            clean_raw, ablated, corrupted_logits = self._record(batch)
            clean_logits = clean_raw.float()
            if corrupted_logits is not None:
                self.m_corrupted += compute_metric(metric, corrupted_logits, batch, clean_logits).sum().item()
            self.m_clean += compute_metric(metric, clean_raw, batch, clean_logits).sum().item()
            size = ablated.numel() * ablated.element_size()
            if kept_bytes + size > budget and ablated.numel() > 1:
                ablated = None  # recomputed at every use (`ablated`)
            else:
                kept_bytes += size
            self.batches.append((batch, clean_logits, ablated))
        self.n = len(data)
        self.forwards = 0  # circuit forwards run (batches), for cost reports

    @torch.no_grad()
    def _record(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A batch's clean logits (the model's dtype), its ablated writes, and the corrupted run's
        logits (corrupted ablation only, else None)."""
        adapter, device = self.adapter, batch.clean_ids.device
        clean = cached_run(adapter, batch.clean_ids, batch.attention_mask, batch.answer_pos, edges=True)
        corrupted_logits = None
        if self.ablation == "corrupted":
            corrupted = cached_run(adapter, batch.corrupted_ids, batch.attention_mask, batch.answer_pos, edges=True)
            ablated = upstream_writes(adapter, clean) - deltas(adapter, clean, corrupted, edges=True).up
            corrupted_logits = corrupted.logits
        elif self.ablation == "mean":
            ablated = fit_positions(self.mean_values.to(device), batch.clean_ids.shape[1]).unsqueeze(1)
        else:
            ablated = torch.zeros(1, 1, 1, 1, device=device)
        return clean.logits, ablated, corrupted_logits

    @property
    def recomputed(self) -> int:
        """Batches whose ablated writes did not fit the budget (recomputed at every use)."""
        return sum(a is None for _, _, a in self.batches)

    def ablated(self, i: int) -> torch.Tensor:
        """Batch i's ablated writes: recorded, or recomputed now when they did not fit the budget."""
        batch, _, ablated = self.batches[i]
        return ablated if ablated is not None else self._record(batch)[1]

    @torch.no_grad()
    def __call__(self, kept: torch.Tensor | None) -> float:
        """kept: (n_upstream, n_downstream) bool, or None for the full model."""
        if kept is None or bool((kept | ~self.valid).all()):
            return self.m_clean / self.n
        kept = kept & self.valid
        if self.ablation == "corrupted" and not kept.any():
            return self.m_corrupted / self.n
        return self.forward(kept)

    @torch.no_grad()
    def forward(self, kept: torch.Tensor) -> float:
        """The metric by circuit forwards, without the shortcuts of `__call__`."""
        total = 0.0
        for i, (batch, clean_answer, _) in enumerate(self.batches):
            ablated = self.ablated(i)
            with HookSet() as hk:
                _install_edge_circuit(self.adapter, hk, kept.to(ablated.device), ablated)
                logits = answer_forward(self.adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
            self.forwards += 1
            total += compute_metric(self.metric, logits, batch, clean_answer).sum().item()
        return total / self.n
