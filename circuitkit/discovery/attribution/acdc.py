"""ACDC: automatic circuit discovery by iterative activation patching (Conmy et al., NeurIPS 2023).

Start from the full graph. Walk the downstream inputs from the logits backwards (the reverse of
forward order: logits, then per layer from the last the MLP input, then the V, K and Q inputs)
and, for each input v, its incoming edges from the latest upstream node to the input embedding.
Each edge u→v is removed tentatively, on top of every edge removed so far, and the metric is
measured over all the examples:

    score(u→v) = m(current circuit) − m(current circuit without u→v)
    remove u→v when score < τ (discovery.acdc_threshold); the circuit without it becomes current

Removed edges stay removed. Without an edge, v reads u's write from the corrupted run instead of
the live one: v's input is shifted by −(w_u(live) − w_u(corrupted)), where w_u is what u writes
to the residual stream. That is exact patching's edge shift (`exact._edge_patch`) with u's live
write in place of its clean one; they differ once u's own inputs are patched.

`level: node` walks the nodes the same way (per layer from the last: the MLP, then the heads
from the last), removing a node by giving it its corrupted value (exact patching's node patch,
`exact._node_patches`) on top of the nodes removed so far. The input embedding is tested last
and always kept.

Scores are the metric changes measured when each edge (node) was tested: removed ones score
below τ, kept ones τ or more, so `pruning` and its selections work on them as on any other
algorithm's (a threshold of τ on the scores gives ACDC's own circuit). At edge level a node's
score is the sum of its outgoing edges' scores. Edges into a node none of whose outgoing edges
is kept (it no longer reaches the logits) are removed without a pass, with score 0: what the
pass would measure, since nothing it writes is read any more.

Cost: one forward over all the examples per tested edge (node), no backward: at most
n_edges × n_batches forward passes at edge level (GPT-2 small: 32,491 edges), L × (H + 1) + 1 × n_batches
at node level. The decisions need the metric over all the examples, so every batch's
corrupted run is cached for the whole walk; the peak is that cache plus one forward with the
removed edges patched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from circuitkit.core.progress import Tasks as Progress
from circuitkit.discovery.attribution.accumulators import total_dtype
from circuitkit.discovery.attribution.eap import (
    AttributionScores,
    RecordedRun,
    cached_run,
    graph_of,
    head_writes,
    record_writes,
)
from circuitkit.discovery.attribution.exact import _edge_patch, _metric, _node_patches
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.config import DiscoveryConfig
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device

DEFAULT_ACDC_THRESHOLD = DiscoveryConfig().acdc_threshold


@dataclass
class _CachedBatch:
    """One batch as every test runs it: the pairs, the clean answer logits (B, V) float32 and the
    corrupted run's writes."""

    batch: TaskData
    clean_answer: torch.Tensor
    corrupted: RecordedRun


def _cache_batches(adapter: ModelAdapter, data: TaskData, batch_size: int, metric: str, edges: bool
                   ) -> tuple[list[_CachedBatch], float, float]:
    """Every batch's corrupted run, and the metric sums on clean and corrupted inputs."""
    device = input_device(adapter.model)
    cached, sums = [], torch.zeros(2, dtype=total_dtype(device), device=device)  # clean, corrupted
    for batch in data.length_batches(batch_size):
        batch = batch.to(device, non_blocking=True)
        with torch.no_grad():
            clean_answer = answer_forward(adapter.model, batch.clean_ids, batch.forward_mask,
                                          batch.answers).float()
        corrupted = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, edges)
        sums += torch.stack([compute_metric(metric, clean_answer, batch, clean_answer).sum(),
                             compute_metric(metric, corrupted.logits, batch, clean_answer).sum()]).to(sums)
        cached.append(_CachedBatch(batch, clean_answer, corrupted))
    m_clean, m_corrupted = sums.tolist()
    return cached, m_clean, m_corrupted


def _mean_metric(adapter: ModelAdapter, cached: list[_CachedBatch], metric: str, install, n: int) -> float:
    """The metric's mean over all the examples, each batch run with `install(hk, index)`'s hooks."""
    total = None  # float64 on the device: one wait per evaluation, not per batch
    for i, c in enumerate(cached):
        batch_sum = _metric(adapter, c.batch, metric, c.clean_answer, lambda hk, i=i: install(hk, i)).sum().to(total_dtype(c.clean_answer.device))
        total = batch_sum if total is None else total + batch_sum.to(total.device)
    return total.item() / n


def node_order(n_layers: int, n_heads: int) -> list[tuple[str, object]]:
    """ACDC's walk over nodes: per layer from the last, the MLP then the heads from the last; the
    input embedding last."""
    order: list[tuple[str, object]] = []
    for layer in reversed(range(n_layers)):
        order.append(("mlp", layer))
        order += [("head", (layer, h)) for h in reversed(range(n_heads))]
    return [*order, ("embed", None)]


def column_order(graph: Graph) -> list[int]:
    """ACDC's walk over downstream inputs: the logits, then per layer from the last the MLP input
    and the attention inputs from the last column (V groups, K groups, Q heads)."""
    order = [graph.logits_column]
    for layer in reversed(range(graph.n_layers)):
        cols = graph.layer_columns(layer)
        order += list(reversed(range(cols.start, cols.stop)))
    return order


def column_owners(graph: Graph, column: int) -> list[int]:
    """Upstream rows of the node(s) that read `column` (a K or V input: every head of its KV
    group); empty for the logits."""
    if column == graph.logits_column:
        return []
    layer, j = divmod(column, graph.per_layer_inputs)
    H, KV = graph.n_heads, graph.n_kv_heads
    if j == graph.per_layer_inputs - 1:
        return [graph.mlp_index(layer)]
    if j < H:
        return [graph.head_index(layer, j)]
    group, per_group = (j - H) % KV, H // KV
    return [graph.head_index(layer, h) for h in range(group * per_group, (group + 1) * per_group)]


class _EdgePatches:
    """The removed edges as hooks, for one forward at a time: v's input shifted by
    −Σ_{u removed into v} (w_u(live) − w_u(corrupted))."""

    def __init__(self, adapter: ModelAdapter, graph: Graph, cached: list[_CachedBatch]) -> None:
        self.adapter, self.graph, self.cached = adapter, graph, cached
        self.removed: dict[int, list[int]] = {}  # column -> upstream rows removed into it
        self._installs: dict = {}  # column -> install(hk), built once
        self._live: RecordedRun | None = None
        self._corrupted: RecordedRun | None = None
        self._memo: dict[int, torch.Tensor] = {}  # layer -> (H, B, T, d_model) head write differences

    def _difference(self, row: int) -> torch.Tensor:
        """w_u(live) − w_u(corrupted) of upstream row u, float32 (B, T, d_model)."""
        live, corrupted, a = self._live, self._corrupted, self.adapter
        if row == 0:
            return live.embed.float() - corrupted.embed.float()
        layer, j = divmod(row - 1, self.graph.n_heads + 1)
        if j == self.graph.n_heads:
            return live.mlp[layer].float() - corrupted.mlp[layer].float()
        if layer not in self._memo:
            heads = (a.n_heads, a.head_dim)
            self._memo[layer] = (head_writes(a, layer, live.z[layer].unflatten(-1, heads), live.attn_total[layer])
                                 - head_writes(a, layer, corrupted.z[layer].unflatten(-1, heads),
                                               corrupted.attn_total[layer]))
        return self._memo[layer][j]

    def _shift(self, column: int) -> torch.Tensor:
        total = None
        for row in self.removed[column]:
            d = self._difference(row)
            total = d if total is None else total + d.to(total.device)
        return total

    def install(self, hk, index: int) -> None:
        """Hooks for batch `index`: record the live writes, and patch every removed edge."""
        L = self.adapter.n_layers
        self._live = RecordedRun(z=[None] * L, mlp=[None] * L, attn_total=[None] * L)
        self._corrupted, self._memo = self.cached[index].corrupted, {}
        record_writes(self.adapter, hk, self._live, edges=True)
        for column, rows in self.removed.items():
            if not rows:
                continue
            if column not in self._installs:
                self._installs[column] = _edge_patch(self.adapter, self.graph, column,
                                                     lambda column=column: self._shift(column))
            self._installs[column](hk)


def _walk_edges(adapter, graph, cached, metric, threshold, n, m_clean, bar, task
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """ACDC over edges: scores (n_up, n_down) float32, the kept edges (bool, same shape), forward
    passes per batch."""
    mask = graph.edge_mask()
    kept = mask.clone()
    scores = torch.zeros(mask.shape)
    patches = _EdgePatches(adapter, graph, cached)
    current, tests = m_clean, 0
    for column in column_order(graph):
        rows = list(reversed(mask[:, column].nonzero().flatten().tolist()))
        owners = column_owners(graph, column)
        if owners and not kept[owners].any():  # its reader no longer reaches the logits
            kept[rows, column] = False
            bar.advance(task, len(rows))
            continue
        removed = patches.removed.setdefault(column, [])
        for row in rows:
            removed.append(row)
            value = _mean_metric(adapter, cached, metric, patches.install, n)
            tests += 1
            score = current - value
            scores[row, column] = score
            if score < threshold:
                kept[row, column] = False
                current = value
            else:
                removed.pop()
            bar.advance(task)
    return scores, kept, tests


def _walk_nodes(adapter, cached, metric, threshold, n, m_clean, bar, task) -> tuple[dict, int]:
    """ACDC over nodes: ({(kind, index): score}, forward passes per batch)."""
    patches = [{(kind, idx): install for kind, idx, install in _node_patches(adapter, c.corrupted)} for c in cached]
    removed: list = []
    current, scores = m_clean, {}
    for key in node_order(adapter.n_layers, adapter.n_heads):
        trial = [*removed, key]

        def install(hk, index, trial=trial):
            for k in trial:
                patches[index][k](hk)
        value = _mean_metric(adapter, cached, metric, install, n)
        scores[key] = current - value
        if scores[key] < threshold and key[0] != "embed":
            removed.append(key)
            current = value
        bar.advance(task)
    return scores, len(scores)


def acdc(adapter: ModelAdapter, data: TaskData, level: str = "edge", metric: str = "logit_diff",
         threshold: float = DEFAULT_ACDC_THRESHOLD, batch_size: int = 4, progress: bool = True,
         sums: bool = False) -> AttributionScores:
    """ACDC scores in the layout of `attribute`: head (L, H), mlp (L,), embed () and, at edge level,
    edges (n_upstream, n_downstream), each the metric change measured when it was tested (means
    over the examples; × N with `sums=True`). `info["kept"]` counts the edges (nodes) ACDC keeps:
    those scoring `threshold` or more; `info["passes"]` the forward passes per batch."""
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"discovery.acdc_threshold={threshold!r} must be a finite number >= 0 (in the metric's"
                         " units; an edge is removed when its metric change is below it)")
    edges = level == "edge"
    graph = graph_of(adapter)
    L, H = adapter.n_layers, adapter.n_heads
    cached, m_clean, m_corrupted = _cache_batches(adapter, data, batch_size, metric, edges)
    n = len(data)
    total = int(graph.edge_mask().sum()) if edges else L * (H + 1) + 1
    with Progress(disable=not progress, transient=True, unit="steps") as bar:
        task = bar.add_task(f"pruning every {level} with acdc", total=total)
        if edges:
            edge_scores, kept_edges, tests = _walk_edges(adapter, graph, cached, metric, threshold, n, m_clean / n, bar, task)
            head = torch.stack([torch.stack([edge_scores[graph.head_index(layer, h)].sum() for h in range(H)])
                                for layer in range(L)])
            mlp = torch.stack([edge_scores[graph.mlp_index(layer)].sum() for layer in range(L)])
            embed = edge_scores[0].sum()
            kept = int(kept_edges.sum())
        else:
            node_scores, tests = _walk_nodes(adapter, cached, metric, threshold, n, m_clean / n, bar, task)
            edge_scores = None
            head, mlp = torch.zeros(L, H), torch.zeros(L)
            for (kind, idx), score in node_scores.items():
                if kind == "head":
                    head[idx] = score
                elif kind == "mlp":
                    mlp[idx] = score
            embed = torch.tensor(node_scores[("embed", None)])
            kept = int((head >= threshold).sum() + (mlp >= threshold).sum()) + 1
    del cached
    scale = n if sums else 1
    metric_scale = 1 if sums else n
    return AttributionScores(
        head=head.float() * scale, mlp=mlp.float() * scale, embed=embed.float() * scale, graph=graph,
        edges=None if edge_scores is None else edge_scores * scale, metric_clean=m_clean / metric_scale,
        metric_corrupted=m_corrupted / metric_scale, n_examples=n,
        info={"algorithm": "acdc", "level": level, "metric": metric, "batch_size": batch_size,
              "threshold": float(threshold), "passes": tests, "kept": kept})
