"""EAP and EAP-IG at node and edge level, through hooks on the Hugging Face model.

With Δ_u = a_u(x) - a_u(x̃) and interpolated input embeddings e_k = ẽ + α_k (e - ẽ):

    node:  s(u)   = Σ_positions Δ_u · Σ_k w_k ∂m/∂a_u (e_k)
    edge:  s(u→v) = Σ_positions Δ_u · Σ_k w_k ∂m/∂in_v (e_k)

`eap-ig` takes m = ig_steps points (null means 30) of the quadrature rule `ig_rule`
(`circuitkit.discovery.attribution.quadrature`); the default `right` rule is α_k = k/m, w_k = 1/m for
k = 1..m, so m = 1 is EAP (the reference's node-level grid; `left`, k = 0..m−1, is its edge-level one). `clean-corrupted` averages the gradients at α = 0 and α = 1.
Node and edge level use the same points and weights. Scores are float32 means over examples
whatever the model dtype; parameters stay frozen (only activation gradients).

The gradient at head h's own residual input never materialises H copies of the residual:
g_res = norm_backward(x, W_Q[h]ᵀ g_q[h]) from the gradient g_q of the query projection output,
and likewise per KV head for K and V (GQA native).

Every sum stays on the device until the stage ends (`circuitkit.discovery.attribution.accumulators`)
and the answer positions come collated with the batch (`TaskData.answers`), so no pass, layer or
batch waits for the device: the stage waits once, when it copies its sums to the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from circuitkit.core.progress import Tasks as Progress
from circuitkit.discovery.attribution.accumulators import add_metrics, host_copy, score_accumulators, to_host
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.attribution.norms import norm_backward
from circuitkit.discovery.attribution.quadrature import (  # noqa: F401  (re-exported: the one rule for points)
    DEFAULT_IG_RULE,
    DEFAULT_IG_STEPS,
    integration_rule,
    interpolation_points,
)
from circuitkit.discovery.tasks.base import AnswerColumns, TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet, first_input, first_output, replace_first
from circuitkit.models.placement import input_device, resident


@dataclass
class AttributionScores:
    """Scores over the examples (float32): means, or sums when `attribute(..., sums=True)`."""

    head: torch.Tensor  # (n_layers, n_heads)
    mlp: torch.Tensor  # (n_layers,)
    embed: torch.Tensor  # () the input embedding node
    graph: Graph
    edges: torch.Tensor | None = None  # (n_upstream, n_downstream); 0 where no edge exists
    metric_clean: float = float("nan")  # mean metric on clean inputs
    metric_corrupted: float = float("nan")
    n_examples: int = 0
    info: dict = field(default_factory=dict)
    per_example: dict | None = None  # attribute(per_example=True): head (N, L, H), edges (N, n_up, n_down)
    # several corruptions (`circuitkit.discovery.attribution.corruptions`): {name: that corruption's
    # scores}, primary first; the fields above are then their combination
    by_corruption: dict | None = field(default=None, repr=False)


def graph_of(adapter: ModelAdapter) -> Graph:
    return Graph(adapter.n_layers, adapter.n_heads, adapter.n_kv_heads, adapter.parallel_residual)


def head_writes(adapter: ModelAdapter, layer: int, z: torch.Tensor, attn_total: torch.Tensor | None) -> torch.Tensor:
    """What each head writes to the residual: (B, T, H, dh) -> (H, B, T, d_model) float32.

    Post-norm models (Gemma 3): γ ⊙ (W_O[h] z_h) / rms(total attention output), which sums
    exactly to the layer's write.
    """
    with resident(adapter.blocks[layer]):  # offloaded layers (model.device_map): real weights for a moment
        w_o, _ = adapter.o_weights(layer)
        norm = adapter.post_attn_norm(layer)
        spec = adapter.norm_spec(norm) if norm is not None else None
    writes = torch.einsum("bthe,hde->hbtd", z.float(), w_o.float())
    if spec is not None:
        total = attn_total.float()
        writes = writes * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + spec.eps) * spec.weight.float()
    return writes


@dataclass
class RecordedRun:
    """What one no-grad forward recorded (cached_run), in the model's dtype."""

    z: list  # per layer (B, T, H*dh): the input of the attention output projection
    mlp: list  # per layer (B, T, d_model): what the MLP writes (after a post-norm)
    attn_total: list  # per layer (B, T, d_model): attention output before its post-norm (Gemma 3, edge level)
    embed: torch.Tensor | None = None  # (B, T, d_model): the residual entering block 0
    logits: torch.Tensor | None = None  # (B, V) at the answer position


@dataclass
class Deltas:
    """Δ = clean - corrupted, float32 (deltas)."""

    embed: torch.Tensor  # (B, T, d_model)
    z: list  # per layer (B, T, H, dh)
    mlp: list  # per layer (B, T, d_model)
    up: torch.Tensor | None = None  # edge level: (n_upstream, B, T, d_model), what each node writes


@torch.no_grad()
def cached_run(adapter: ModelAdapter, ids: torch.Tensor, mask: torch.Tensor,
               answer_pos: AnswerColumns | torch.Tensor, edges: bool) -> RecordedRun:
    """Forward pass recording what each node writes, and the answer logits (B, V).

    `answer_pos`: the batch's collated `AnswerColumns` (`TaskData.answers`; positions (B,) are
    found on the device, a wait for it)."""
    L = adapter.n_layers
    rec = RecordedRun(z=[None] * L, mlp=[None] * L, attn_total=[None] * L)
    with HookSet() as hk:
        record_writes(adapter, hk, rec, edges)
        rec.logits = answer_forward(adapter.model, ids, mask, answer_pos)
    return rec


def record_writes(adapter: ModelAdapter, hk: HookSet, rec: RecordedRun, edges: bool) -> None:
    """Hooks that fill `rec` (embed, z, mlp and, with `edges` on post-norm models, attn_total)
    with what the next forward computes (ACDC records its patched runs' writes with them)."""
    def embed_hook(module, args, kwargs):
        rec.embed = first_input(args, kwargs).detach()
    hk.pre(adapter.blocks[0], embed_hook, with_kwargs=True)
    for layer in range(adapter.n_layers):
        def z_hook(module, args, layer=layer):
            rec.z[layer] = args[0].detach()
        hk.pre(adapter.z_input(layer), z_hook)

        def mlp_hook(module, args, out, layer=layer):
            rec.mlp[layer] = first_output(out).detach()
        hk.post(adapter.mlp_write(layer), mlp_hook)
        if edges and adapter.post_attn_norm(layer) is not None:
            def total_hook(module, args, layer=layer):
                rec.attn_total[layer] = args[0].detach()
            hk.pre(adapter.post_attn_norm(layer), total_hook)


def record_head_runs(adapter: ModelAdapter, data: TaskData, batch_size: int, corrupted: bool = True
                     ) -> list[tuple[TaskData, torch.Tensor, list | None, torch.Tensor | None]]:
    """What a head-scope circuit is run against, per batch of `data` (on the model's input device):
    (batch, clean answer logits float32, the corrupted run's z per layer, its answer logits float32),
    the last two None without `corrupted`."""
    device = input_device(adapter.model)
    out = []
    for batch in data.batches(batch_size):
        batch = batch.to(device, non_blocking=True)
        clean = cached_run(adapter, batch.clean_ids, batch.forward_mask, batch.answers, edges=False)
        z = logits = None
        if corrupted:
            run = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, edges=False)
            z, logits = run.z, run.logits.float()
        out.append((batch, clean.logits.float(), z, logits))
    return out


def deltas(adapter: ModelAdapter, clean: RecordedRun, corrupted: RecordedRun, edges: bool) -> Deltas:
    """Δ = clean - corrupted, float32: per node value (node level) and per write (edge level)."""
    L, H = adapter.n_layers, adapter.n_heads
    d = Deltas(
        embed=clean.embed.float() - corrupted.embed.float(),
        z=[(clean.z[i].float() - corrupted.z[i].float()).unflatten(-1, (H, adapter.head_dim)) for i in range(L)],
        mlp=[clean.mlp[i].float() - corrupted.mlp[i].float() for i in range(L)],
    )
    if edges:
        rows = [d.embed.unsqueeze(0)]
        dev = d.embed.device  # every write's Δ on one device for the edge contraction (model.device_map)
        for layer in range(L):
            zc = clean.z[layer].unflatten(-1, (H, adapter.head_dim))
            zx = corrupted.z[layer].unflatten(-1, (H, adapter.head_dim))
            rows.append((head_writes(adapter, layer, zc, clean.attn_total[layer])
                         - head_writes(adapter, layer, zx, corrupted.attn_total[layer])).to(dev))
            rows.append(d.mlp[layer].unsqueeze(0).to(dev))
        d.up = torch.cat(rows)  # (n_upstream, B, T, d_model)
    return d


def accumulate(total: torch.Tensor | None, g: torch.Tensor, relative_weight: float = 1.0) -> torch.Tensor:
    """total + relative_weight · g in float32 (a float32 copy of the weighted g when total is None).

    The weighted sum of the quadrature rule; the contraction divides by the number of points
    (`Quadrature.relative_weights`), so equal-weight rules multiply by nothing here.
    """
    if total is None:
        # copy=True: autograd hands the same gradient tensor to several hooks (residual adds)
        first = g.to(torch.float32, copy=True)
        return first if relative_weight == 1.0 else first.mul_(relative_weight)
    if relative_weight == 1.0:
        return total.add_(g)
    return total.add_(g.float(), alpha=relative_weight)


class _GradientSums:
    """Running weighted sums over interpolation points of the gradients the scores need (float32).

    `relative_weight` is the current point's weight relative to 1/n_points; set it before each pass.
    """

    def __init__(self, adapter: ModelAdapter, edges: bool) -> None:
        self.adapter, self.edges = adapter, edges
        self.relative_weight = 1.0
        L = adapter.n_layers
        self.embed = None
        self.z: list = [None] * L
        self.mlp: list = [None] * L
        self.inputs: list = [None] * L  # edge level: (per_layer_inputs, B, T, d_model) per layer
        self.logits = None

    def _add(self, total, g):
        return accumulate(total, g, self.relative_weight)

    def add(self, name: str, g: torch.Tensor, layer: int | None = None) -> None:
        """Add gradient `g` to the running sum `name` (per layer for "z" and "mlp")."""
        if layer is None:
            setattr(self, name, self._add(getattr(self, name), g))
        else:
            per_layer = getattr(self, name)
            per_layer[layer] = self._add(per_layer[layer], g)

    def add_layer_inputs(self, layer: int, x_attn, grads_qkv: dict, x_mlp, g_mlp_in) -> None:
        """Residual-space gradients of every input of `layer`, through its own path only."""
        a = self.adapter
        with resident(a.blocks[layer]):  # offloaded layers (model.device_map): real weights for a moment
            w = a.qkv_weights(layer)
            attn_spec, mlp_spec = a.norm_spec(a.attn_norm(layer)), a.norm_spec(a.mlp_norm(layer))
        parts = []
        for key, weight in (("q", w.w_q), ("k", w.w_k), ("v", w.w_v)):
            # (B, T, n, dh) x (n, dh, d_model) -> (n, B, T, d_model): the norm output's gradient
            g_norm_out = torch.einsum("btne,ned->nbtd", grads_qkv[key].float(), weight.float())
            parts.append(norm_backward(attn_spec, x_attn, g_norm_out))
        parts.append(norm_backward(mlp_spec, x_mlp, g_mlp_in.float().unsqueeze(0)))
        self.inputs[layer] = self._add(self.inputs[layer], torch.cat(parts))


def _gradient_run(adapter: ModelAdapter, ids, mask, e_k: torch.Tensor, batch: TaskData, metric: str,
                  clean_answer: torch.Tensor, grad_sums: _GradientSums) -> torch.Tensor:
    """One forward+backward at input embedding e_k, adding the needed gradients to `grad_sums`.

    Returns the metric at e_k per example (B,), float32, detached (EAP-GP steers its path by it)."""
    L = adapter.n_layers
    edges = grad_sums.edges
    # Edge level: each layer's norm inputs and the gradients of its Q/K/V and MLP-input paths.
    saved: dict = {"x_attn": {}, "x_mlp": {}, "qkv": {layer: {} for layer in range(L)}, "g_mlp_in": {}}
    e_k = e_k.detach().requires_grad_(True)
    with HookSet() as hk:
        hk.pre(adapter.blocks[0], lambda m, args, kwargs: replace_first(args, kwargs, e_k), with_kwargs=True)
        for layer in range(L):
            def z_hook(module, args, layer=layer):
                args[0].register_hook(lambda g: grad_sums.add("z", g, layer))
            hk.pre(adapter.z_input(layer), z_hook)

            def mlp_hook(module, args, out, layer=layer):
                t = first_output(out)
                t.register_hook(lambda g: grad_sums.add("mlp", g, layer))
            hk.post(adapter.mlp_write(layer), mlp_hook)
            if not edges:
                continue

            def attn_norm_hook(module, args, out, layer=layer):
                saved["x_attn"][layer] = args[0].detach()
            hk.post(adapter.attn_norm(layer), attn_norm_hook)
            for site in adapter.qkv_sites(layer):
                def qkv_hook(module, args, out, site=site, layer=layer):
                    out.register_hook(lambda g: saved["qkv"][layer].update(site.split(g)))
                hk.post(site.module, qkv_hook)

            def mlp_norm_hook(module, args, out, layer=layer):
                saved["x_mlp"][layer] = args[0].detach()
                out.register_hook(lambda g: saved["g_mlp_in"].__setitem__(layer, g))
            hk.post(adapter.mlp_norm(layer), mlp_norm_hook)
        if edges:
            def final_hook(module, args, kwargs):
                first_input(args, kwargs).register_hook(lambda g: grad_sums.add("logits", g))
            hk.pre(adapter.final_norm, final_hook, with_kwargs=True)
        logits = answer_forward(adapter.model, ids, mask, batch.answers)
        values = compute_metric(metric, logits, batch, clean_answer)
        (grad_embed,) = torch.autograd.grad(values.sum(), e_k)
    grad_sums.add("embed", grad_embed)
    if edges:
        for layer in range(L):
            grad_sums.add_layer_inputs(layer, saved["x_attn"][layer], saved["qkv"][layer],
                                  saved["x_mlp"][layer], saved["g_mlp_in"][layer])
    return values.detach().float()


def _batch_scores(adapter: ModelAdapter, graph: Graph, delta: dict, grad_sums: _GradientSums, n_points: int,
                  out: dict) -> None:
    """Contract Δ with the weighted gradient sums / n_points; add this batch's scores (summed over
    its examples) to `out`."""
    H = adapter.n_heads
    # Under model.device_map each layer's Δ and gradient sums live on that layer's device; the
    # contraction happens there and only the small results move (no-ops on one device).
    dev = out["head"].device
    for layer in range(adapter.n_layers):
        gz = grad_sums.z[layer].unflatten(-1, (H, adapter.head_dim))
        out["head"][layer] += (torch.einsum("bthe,bthe->h", delta.z[layer], gz) / n_points).to(dev)
        out["mlp"][layer] += ((delta.mlp[layer] * grad_sums.mlp[layer]).sum() / n_points).to(dev)
    out["embed"] += ((delta.embed * grad_sums.embed).sum() / n_points).to(dev)
    if "per_example" in out:  # circuitkit.discovery.pruning.stability: per-example scores, resampled without a model pass
        _per_example_scores(adapter, graph, delta, grad_sums, n_points, out["per_example"], dev)
    if grad_sums.edges:
        up = delta.up.flatten(1)  # (n_upstream, B*T*d_model), on the first layer's device
        for layer in range(adapter.n_layers):
            cols = graph.layer_columns(layer)
            g = grad_sums.inputs[layer].flatten(1).to(up.device)  # (per_layer_inputs, B*T*d_model)
            n_attn, n_mlp = graph.upstream_before_attn(layer), graph.upstream_before_mlp(layer)
            out["edges"][:n_attn, cols.start:cols.stop - 1] += up[:n_attn] @ g[:-1].T / n_points
            out["edges"][:n_mlp, cols.stop - 1] += up[:n_mlp] @ g[-1] / n_points
        out["edges"][:, graph.logits_column] += up @ grad_sums.logits.flatten().to(up.device) / n_points


def _per_example_scores(adapter: ModelAdapter, graph: Graph, delta: Deltas, grad_sums: _GradientSums, n_points: int,
                        rows: dict, dev: torch.device) -> None:
    """Append this batch's per-example scores: head (B, L, H) and, at edge level, edges (B, n_up, n_down).

    Computed on `dev` and queued to the host once per batch (`host_copy`), not per layer."""
    H = adapter.n_heads
    head = torch.stack([
        torch.einsum("bthe,bthe->bh", delta.z[i], grad_sums.z[i].unflatten(-1, (H, adapter.head_dim))).to(dev)
        for i in range(adapter.n_layers)], 1)
    rows.setdefault("head", []).append(host_copy(head / n_points))
    if grad_sums.edges:
        up = delta.up.flatten(2)  # (n_upstream, B, T*d_model)
        e = torch.zeros(up.shape[1], len(graph.upstream), len(graph.downstream), device=up.device)
        for layer in range(adapter.n_layers):
            cols = graph.layer_columns(layer)
            g = grad_sums.inputs[layer].flatten(2).to(up.device)
            n_attn, n_mlp = graph.upstream_before_attn(layer), graph.upstream_before_mlp(layer)
            e[:, :n_attn, cols.start:cols.stop - 1] = torch.einsum("ubx,vbx->buv", up[:n_attn], g[:-1])
            e[:, :n_mlp, cols.stop - 1] = torch.einsum("ubx,bx->bu", up[:n_mlp], g[-1])
        e[:, :, graph.logits_column] = torch.einsum("ubx,bx->bu", up, grad_sums.logits.flatten(1).to(up.device))
        rows.setdefault("edges", []).append(host_copy((e / n_points).to(dev)))


def attribute(adapter: ModelAdapter, data: TaskData, algorithm: str = "eap-ig", level: str = "node",
              metric: str = "logit_diff", ig_steps: int | None = 5, batch_size: int = 4,
              progress: bool = True, ig_rule: str = DEFAULT_IG_RULE,
              group_by_length: bool = True, sums: bool = False, per_example: bool = False) -> AttributionScores:
    """EAP / EAP-IG / clean-corrupted scores of every node (and edge, if level='edge').

    data: TaskData with N pairs; scores are means over the N examples, independent of
    batch_size. Pairs of similar length are batched together and each batch is cut to its
    longest pair (`TaskData.length_batches`; `group_by_length=False` keeps the data order).
    Returns AttributionScores with head (L, H), mlp (L,), embed () and, at edge level, edges
    (n_upstream, n_downstream). `ig_rule` chooses the eap-ig quadrature (right: α = k/m,
    k = 1..m, the reference's node level; left: k = 0..m-1, the reference's edge level, what MIB's
    edge scores use; midpoint, trapezoid, gauss_legendre: `circuitkit.discovery.attribution.quadrature`);
    ig_steps is its number of points = passes.
    `sums=True` returns sums over the examples instead of means (scores and metrics), which
    shards of the examples add exactly (`circuitkit.discovery.attribution.shards`).
    `per_example=True` also keeps every example's scores (`AttributionScores.per_example`:
    head (N, L, H), and edges (N, n_up, n_down) at edge level; examples in batch order), so
    resampling the examples needs no model pass (`circuitkit.discovery.pruning.stability`).
    """
    return attribute_corruptions(adapter, [data], algorithm, level, metric, ig_steps, batch_size, progress, ig_rule,
                                 group_by_length, sums, per_example)[0]


def attribute_corruptions(adapter: ModelAdapter, datas: list[TaskData], algorithm: str = "eap-ig",
                          level: str = "node", metric: str = "logit_diff", ig_steps: int | None = 5,
                          batch_size: int = 4, progress: bool = True, ig_rule: str = DEFAULT_IG_RULE,
                          group_by_length: bool = True, sums: bool = False,
                          per_example: bool = False) -> list[AttributionScores]:
    """`attribute` under several corruptions of the same clean pairs: one AttributionScores per
    entry of `datas`, each exactly what `attribute(datas[i], ...)` returns.

    datas: C TaskData of N pairs that share clean_ids, attention_mask and answer_pos (only
    corrupted_ids and incorrect differ; `circuitkit.discovery.tasks.corruption_sets`). Per batch
    the clean run is recorded once; each corruption then has its corrupted run (one cache alive at
    a time), its Δ and its m interpolation passes (the path runs from its own corrupted input):
    1 + C·(1 + m) passes per batch instead of C·(2 + m).
    """
    rule = integration_rule(algorithm, ig_steps, ig_rule)
    data = datas[0]
    divisor = 1 if sums else len(data)
    edges = level == "edge"
    graph = graph_of(adapter)
    device = input_device(adapter.model)
    dtype = adapter.embed.weight.dtype
    outs = [score_accumulators(graph, edges, device) for _ in datas]
    if per_example:
        for out in outs:
            out["per_example"] = {}
    # the same plan for every corruption: it reads the lengths, which the corruptions share
    planned = list(zip(*(d.length_batches(batch_size, group_by_length) for d in datas), strict=True))
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"scoring every {level} with {algorithm}", total=len(planned))
        for batches in planned:
            batch = batches[0].to(device, non_blocking=True)
            # a box the last corruption empties once its Δ is taken, so the recorded clean run is not
            # held through its interpolation passes (a single corruption peaks as it always did)
            clean_box = [cached_run(adapter, batch.clean_ids, batch.forward_mask, batch.answers, edges)]
            clean_answer = clean_box[0].logits.float()
            e_clean = clean_box[0].embed.float()
            for i, other in enumerate(batches):
                if i:  # its corrupted prompts and incorrect answers; clean ids, mask and columns are the primary's
                    other = dataclasses.replace(batch, corrupted_ids=other.corrupted_ids.to(device, non_blocking=True),
                                                incorrect=other.incorrect.to(device, non_blocking=True))
                else:
                    other = batch
                _corruption_scores(adapter, graph, other, clean_box, clean_answer, e_clean, rule, metric, edges,
                                   dtype, outs[i], last=i == len(batches) - 1)
            del e_clean, clean_answer, batch  # freed before the next batch's runs, not after
            bar.advance(task)
    return [_scores_of(out, divisor, graph, len(data), algorithm, level, metric, rule, batch_size, per_example)
            for out in outs]


def _corruption_scores(adapter: ModelAdapter, graph: Graph, batch: TaskData, clean_box: list[RecordedRun],
                       clean_answer: torch.Tensor, e_clean: torch.Tensor, rule, metric: str, edges: bool,
                       dtype: torch.dtype, out: dict, last: bool) -> None:
    """One batch under one corruption: its corrupted run, Δ and interpolation passes, added to `out`.
    `clean_box`: [the batch's recorded clean run], emptied when `last`, once Δ no longer needs it."""
    clean = clean_box[0]
    corrupted = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, edges)
    add_metrics(out, metric, clean.logits, corrupted.logits, batch, clean_answer)
    delta = deltas(adapter, clean, corrupted, edges)
    e_corrupted = corrupted.embed.float()
    del corrupted, clean
    if last:
        clean_box.clear()
    grad_sums = _GradientSums(adapter, edges)
    for alpha, relative_weight in zip(rule.alphas, rule.relative_weights, strict=True):
        e_k = (e_corrupted + alpha * (e_clean - e_corrupted)).to(dtype)
        grad_sums.relative_weight = relative_weight
        _gradient_run(adapter, batch.clean_ids, batch.forward_mask, e_k, batch, metric, clean_answer, grad_sums)
    _batch_scores(adapter, graph, delta, grad_sums, rule.passes, out)


def _scores_of(out: dict, divisor: int, graph: Graph, n: int, algorithm: str, level: str, metric: str, rule,
               batch_size: int, per_example: bool) -> AttributionScores:
    host = to_host(out, divisor)  # the stage's one wait for the device; per-example rows are complete after it
    metric_clean, metric_corrupted = (host["metric"] / divisor).tolist()
    return AttributionScores(
        head=host["head"], mlp=host["mlp"], embed=host["embed"], graph=graph, edges=host.get("edges"),
        metric_clean=metric_clean, metric_corrupted=metric_corrupted, n_examples=n,
        info={"algorithm": algorithm, "level": level, "metric": metric,
              "ig_steps": rule.passes if algorithm == "eap-ig" else None,
              "ig_rule": rule.rule if algorithm == "eap-ig" else None, "passes": rule.passes,
              "batch_size": batch_size},
        per_example={k: torch.cat(v) for k, v in out["per_example"].items()} if per_example else None)
