"""EAP-GP: EAP-IG-inputs along a gradient-guided path instead of the straight line (GradPath).

EAP-IG averages the gradient at points e_k = ẽ + (k/m)(e − ẽ) of the straight line from the
corrupted input embeddings ẽ to the clean ones e. Where the metric saturates (flat for most of
the line, then a steep switch) most of those points see a gradient near zero. EAP-GP (Zhang et
al., "EAP-GP: Mitigating Saturation Effect in Gradient-based Automated Circuit Identification",
NeurIPS 2025) integrates along a path built step by step that follows the gradient of the
metric difference instead. Our construction keeps both ends fixed, so that the path runs from
ẽ to e whatever the gradients are (per example b, flattened over positions and d_model):

    r_k = e − p_k                 the rest of the way;  n = m − k steps left
    u_k = s_b ∇_e m(p_k) ⊙ M      s_b = sign(m(e) − m(p_k)): towards the clean metric;
                                  M: the positions where e and ẽ differ (the shared context stays put)
    p_{k+1} = p_k + r_k / n + λ (|r_k| / n) · ((n − 1) / n) · (û_k − (û_k · r̂_k) r̂_k),   λ = 1/2

Each step covers 1/n of the rest of the way and moves sideways along the part of the unit
gradient orthogonal to it (by at most λ times that length, tapered to zero on the last step,
which lands on e). Where the gradient already points along the line the path is straight.
λ = 1/2 is measured, not derived: on the trained induction fixture (12 pairs) λ = 1 sent the
path into the attention's cliffs (a point with |∇m| 25x the rest; one pair's path integral
2.4x off its metric difference at 40 steps, 1.5x at 160), while with λ = 1/2 the worst pair
is off by 17 % at 40 steps and 2.8 % at 160, as on the straight line (12 %, 3 %).

Scores, with the path's points p_k taken by `ig_rule` (m = ig_steps passes, one per point):

    right (default): p_1 .. p_m (p_m = e); the first step is straight (no gradient yet), so
                     m <= 2 is the straight line (m = 1 is EAP)
    left:            p_0 .. p_{m−1} (p_0 = ẽ; the reference's edge-level grid)

    node:  s(u)   = Σ_positions Δ_u · (1/m) Σ_k ∂m/∂a_u (p_k)       (heads, MLPs)
    edge:  s(u→v) = Σ_positions Δ_u · (1/m) Σ_k ∂m/∂in_v (p_k)
    input: s(embed) = Σ_k ∇_e m(p_k) · (p_k − p_{k−1})  (right; left: · (p_{k+1} − p_k))

The input node's score is the path integral of the gradient (a Riemann sum over the path's
segments), so it approaches m(e) − m(ẽ) as m grows along this path as along any other (IG
completeness). On the straight line the segments are all Δ/m and every score equals EAP-IG's
(`attribute_gradpath(..., path="straight")`, tested). The cost is EAP-IG's: m forward+backward
passes per batch; the steering adds a few (B, T, d_model) float32 buffers, no pass.
"""

from __future__ import annotations

import torch

from circuitkit.core.progress import Tasks as Progress
from circuitkit.discovery.attribution.accumulators import (
    add_metrics,
    score_accumulators,
    to_host,
    total_dtype,
)
from circuitkit.discovery.attribution.eap import (
    AttributionScores,
    _batch_scores,
    _gradient_run,
    _GradientSums,
    cached_run,
    deltas,
    graph_of,
)
from circuitkit.discovery.attribution.quadrature import resolved_steps
from circuitkit.discovery.config import GRADPATH_RULES
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device

PATHS = ("gradpath", "straight")
_TINY = torch.finfo(torch.float32).tiny
SIDEWAYS = 0.5  # λ: the sideways move's length relative to the step's (module docstring)


class _SteeringSums(_GradientSums):
    """The gradient sums of EAP-IG, also keeping the last pass's input gradient (B, T, d_model)."""

    last_embed: torch.Tensor | None = None

    def add(self, name: str, g: torch.Tensor, layer: int | None = None) -> None:
        if name == "embed":
            self.last_embed = g.detach().float()
        super().add(name, g, layer)


def next_point(point: torch.Tensor, start: torch.Tensor, end: torch.Tensor, index: int, m: int,
               steer: torch.Tensor | None, straight: bool = False) -> torch.Tensor:
    """p_{index+1} from p_index = `point` on the m-step path from `start` (ẽ) to `end` (e), float32
    (B, T, d_model). `steer` is the direction to follow (None: a straight step); `straight=True`
    gives EAP-IG's points ẽ + ((index+1)/m)(e − ẽ) exactly."""
    if straight:
        return start + ((index + 1) / m) * (end - start)
    steps_left = m - index
    if steps_left <= 1:
        return end.clone()
    remaining = end - point
    step = remaining / steps_left
    if steer is None:
        return point + step
    r = remaining.flatten(1)  # (B, T*d)
    r_norm = r.norm(dim=1, keepdim=True)
    r_hat = r / r_norm.clamp_min(_TINY)
    u = steer.flatten(1)
    u_hat = u / u.norm(dim=1, keepdim=True).clamp_min(_TINY)
    sideways = u_hat - (u_hat * r_hat).sum(1, keepdim=True) * r_hat  # orthogonal to the rest of the way
    taper = (steps_left - 1) / steps_left
    return point + step + (SIDEWAYS * (r_norm / steps_left) * taper * sideways).view_as(point)


def _deviation(point: torch.Tensor, start: torch.Tensor, end: torch.Tensor, alpha: float) -> torch.Tensor:
    """Distance of `point` from the straight line's point at α, over |e − ẽ|, per example (B,)."""
    span = (end - start).flatten(1).norm(dim=1)
    off = (point - start - alpha * (end - start)).flatten(1).norm(dim=1)
    return torch.where(span > 0, off / span.clamp_min(_TINY), torch.zeros_like(span))


def _walk(adapter: ModelAdapter, batch: TaskData, start: torch.Tensor, end: torch.Tensor, clean_values: torch.Tensor,
          clean_answer: torch.Tensor, metric: str, m: int, ig_rule: str, straight: bool, dtype: torch.dtype,
          grad_sums: _SteeringSums, advance) -> tuple[torch.Tensor, torch.Tensor]:
    """Build one batch's path from `start` (ẽ) to `end` (e), one gradient pass per point, adding
    the gradients to `grad_sums`. Returns the path integral of ∇_e m and the path's largest
    relative distance from the straight line, per example (B,) each."""
    differs = (end != start).any(-1, keepdim=True)  # (B, T, 1): where the prompts differ
    path_integral = torch.zeros(start.shape[0], device=start.device)
    worst = torch.zeros(start.shape[0], device=start.device)
    right, steer, point = ig_rule == "right", None, start
    # right: pass j at p_{j+1}, the segment before it; left: pass j at p_j, the segment after it
    for j in range(m):
        if right:
            previous, point = point, next_point(point, start, end, j, m, steer, straight)
        values = _gradient_run(adapter, batch.clean_ids, batch.forward_mask, point.to(dtype), batch, metric,
                               clean_answer, grad_sums)
        g = grad_sums.last_embed.to(start.device)  # ∇_e m(p) (B, T, d_model)
        worst = torch.maximum(worst, _deviation(point, start, end, (j + 1) / m if right else j / m))
        steer = g * torch.sign(clean_values - values).to(g.device).view(-1, 1, 1) * differs  # towards m(e)
        if right:
            path_integral += (g * (point - previous)).flatten(1).sum(1)
        else:
            following = next_point(point, start, end, j, m, steer, straight)
            path_integral += (g * (following - point)).flatten(1).sum(1)
            point = following
        advance()
    return path_integral, worst


def attribute_gradpath(adapter: ModelAdapter, data: TaskData, level: str = "node", metric: str = "logit_diff",
                       ig_steps: int | None = 5, batch_size: int = 4, progress: bool = True,
                       ig_rule: str = "right", path: str = "gradpath", group_by_length: bool = True,
                       sums: bool = False, per_example: bool = False) -> AttributionScores:
    """EAP-GP scores in the layout of `attribute`: head (L, H), mlp (L,), embed () and, at edge
    level, edges (n_upstream, n_downstream); means over the examples (sums with `sums=True`;
    `per_example=True` keeps each example's head and edge scores, in batch order).

    `path="straight"` replaces the gradient-guided path by the straight line: the scores are then
    EAP-IG's with the same `ig_rule` and `ig_steps` (to float32 round-off for the input node).
    `info["path_deviation"]` is the mean over examples of the path's largest distance from the
    straight line, relative to |e − ẽ| (0 for the straight line).
    """
    if ig_rule not in GRADPATH_RULES:
        raise ValueError(f"eap-gp builds its path one point after the other: discovery.ig_rule={ig_rule!r} is not"
                         f" one of its rules ({', '.join(GRADPATH_RULES)}); use ig_rule=right (the default)")
    if path not in PATHS:
        raise ValueError(f"path={path!r} must be one of {', '.join(PATHS)}")
    m = resolved_steps(ig_steps)
    if m < 1:
        raise ValueError(f"discovery.ig_steps={m} must be >= 1 (1 is EAP)")
    straight = path == "straight"
    edges = level == "edge"
    graph = graph_of(adapter)
    device = input_device(adapter.model)
    dtype = adapter.embed.weight.dtype
    out = score_accumulators(graph, edges, device)
    out["deviation"] = torch.zeros((), dtype=total_dtype(device), device=device)  # Σ examples' largest deviation
    if per_example:
        out["per_example"] = {}
    planned = data.length_batches(batch_size, group_by_length)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"scoring every {level} with eap-gp", total=len(planned) * m)
        for batch in planned:
            batch = batch.to(device, non_blocking=True)
            clean = cached_run(adapter, batch.clean_ids, batch.forward_mask, batch.answers, edges)
            corrupted = cached_run(adapter, batch.corrupted_ids, batch.forward_mask, batch.answers, edges)
            clean_answer = clean.logits.float()
            clean_values = add_metrics(out, metric, clean.logits, corrupted.logits, batch, clean_answer)  # (B,)
            delta = deltas(adapter, clean, corrupted, edges)
            start, end = corrupted.embed.float(), clean.embed.float()  # ẽ, e: (B, T, d_model)
            del clean, corrupted
            grad_sums = _SteeringSums(adapter, edges)
            path_integral, worst = _walk(adapter, batch, start, end, clean_values, clean_answer, metric, m, ig_rule,
                                         straight, dtype, grad_sums, lambda: bar.advance(task))
            embed_before = out["embed"].clone()
            _batch_scores(adapter, graph, delta, grad_sums, m, out)
            out["embed"] = embed_before + path_integral.sum().to(out["embed"].device)
            out["deviation"] += worst.sum().to(out["deviation"])
            del delta, grad_sums, start, end  # freed before the next batch's runs
    n = 1 if sums else len(data)
    host = to_host(out, n)  # the stage's one wait for the device; per-example rows are complete after it
    metric_clean, metric_corrupted = (host["metric"] / n).tolist()
    deviation = host["deviation"].tolist()
    return AttributionScores(
        head=host["head"], mlp=host["mlp"], embed=host["embed"], graph=graph, edges=host.get("edges"),
        metric_clean=metric_clean, metric_corrupted=metric_corrupted, n_examples=len(data),
        info={"algorithm": "eap-gp", "level": level, "metric": metric, "ig_steps": m, "ig_rule": ig_rule,
              "passes": m, "batch_size": batch_size, "path": path, "path_deviation": deviation / max(len(data), 1)},
        per_example={k: torch.cat(v) for k, v in out["per_example"].items()} if per_example else None)
