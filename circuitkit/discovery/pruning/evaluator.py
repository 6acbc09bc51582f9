"""Evaluating head circuits: the metric with only the kept heads live, faithfulness, and the curve.

`Evaluator` measures circuits on held-out pairs (many in one batched forward,
`circuitkit.discovery.pruning.circuit_forward`); `faithfulness` is
f = (m(circuit) - m(empty)) / (m(full) - m(empty)); the curve is faithfulness at MIB's grid of
kept shares, with its areas CPR and CMD (`curve_areas`). `circuitkit.discovery.pruning.heads`
selects circuits with these; `circuitkit.discovery.pruning.corruptions` folds them over several
corruptions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from rich.console import Console

from circuitkit.core.progress import Progress
from circuitkit.discovery.attribution.eap import record_head_runs
from circuitkit.discovery.attribution.metrics import compute_metric
from circuitkit.discovery.pruning.circuit_forward import (
    CIRCUIT_FORWARD_TOKENS,
    PrefixCache,
    circuit_answer_logits,
    shared_prefix,
)
from circuitkit.discovery.pruning.selection import keep_top
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device

CURVE_PERCENTS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)


class Evaluator:
    """Mean metric on held-out examples with only the kept heads live (the others ablated).

    `evaluate(kept)` measures one circuit, `evaluate.many(kept)` several: per held-out batch, one
    forward runs up to `circuits_per_forward` circuits side by side (`circuit_answer_logits`).
    The held-out pairs are batched in order of their shared prefix and length (under corrupted
    ablation the positions before the first corrupted token run once per batch, not per circuit;
    each batch is cut to its longest pair), and a circuit's figure does not depend on which
    others share its forward, up to float round-off.
    """

    def __init__(self, adapter: ModelAdapter, data: TaskData, metric: str, ablation: str,
                 mean_values: torch.Tensor | None, batch_size: int,
                 circuit_forward_tokens: int = CIRCUIT_FORWARD_TOKENS) -> None:
        self.adapter, self.metric, self.ablation, self.batch_size = adapter, metric, ablation, batch_size
        self.circuit_forward_tokens = circuit_forward_tokens
        self.device = input_device(adapter.model)
        corrupted = ablation == "corrupted"
        prefix = shared_prefix(data) if corrupted else torch.zeros(len(data), dtype=torch.long)
        lengths = data.attention_mask.sum(dim=1)
        # per batch: (pairs on the device, clean answer logits, corrupted z per layer or None),
        # the shared prefix, and the answer positions on the host (collate-time bookkeeping)
        self.batches, self.prefixes, self.answer_pos = [], [], []
        for idx in _prefix_batches(prefix.tolist(), lengths.tolist(), batch_size):
            part = _trim(data[idx], int(lengths[idx].max()))
            [(batch, clean, z, _)] = record_head_runs(adapter, part, len(part), corrupted=corrupted)
            self.batches.append((batch, clean, z))
            self.prefixes.append(int(prefix[idx].min()))
            self.answer_pos.append(part.answer_pos)
        self.m_clean = sum(compute_metric(metric, c, b, c).sum().item() for b, c, _ in self.batches) / len(data)
        self.mean_values = None if mean_values is None else [v.to(self.device)[None] for v in mean_values]
        self.n = len(data)

    def _values(self, corrupted_z):
        if self.ablation == "zero":
            return [None] * self.adapter.n_layers
        if self.ablation == "corrupted":
            return corrupted_z
        return self.mean_values

    def circuits_per_forward(self, batch: TaskData) -> int:
        """How many circuits one forward runs side by side on `batch` (B pairs of T tokens)."""
        return max(1, self.circuit_forward_tokens // batch.clean_ids.numel())

    @torch.no_grad()
    def __call__(self, kept: torch.Tensor | None) -> float:
        """kept: (n_layers, n_heads) bool, or None for the full model."""
        if kept is None:
            return self.m_clean
        return self.many(kept[None])[0]

    @torch.no_grad()
    def many(self, kept: torch.Tensor, what: str | None = None) -> list[float]:
        """Each circuit's mean metric: kept (C, n_layers, n_heads) bool -> C floats, in order.

        Identical masks are run once; the full model's figure is the clean run recorded at
        setup. The per-batch sums stay on the device and are copied once, at the end. `what`:
        progress is shown (`circuitkit.core.progress`, counted in forwards), first saying `what`.
        """
        kept = kept.bool().cpu()
        unique, inverse = torch.unique(kept.flatten(1), dim=0, return_inverse=True)  # (U, L·H), (C,)
        todo = (~unique.all(dim=1)).nonzero().flatten()
        sums = torch.zeros(len(self.batches), len(unique), device=self.device)  # float32, per batch and circuit
        if len(todo):
            removed = ~unique.view(-1, *kept.shape[1:])  # (U, L, H)
            forwards = sum(-(-len(todo) // self.circuits_per_forward(b)) for b, _, _ in self.batches)
            with Progress(Console(stderr=True), what or "", forwards, "forwards", announce=True,
                          enabled=what is not None) as bar:
                for i, (batch, clean_answer, corrupted_z) in enumerate(self.batches):
                    B, step = len(batch), self.circuits_per_forward(batch)
                    prefix = (PrefixCache(self.adapter.model, batch, self.prefixes[i]) if self.prefixes[i] > 0
                              else None)
                    for first in range(0, len(todo), step):
                        chunk = todo[first:first + step]
                        c = len(chunk)
                        logits = circuit_answer_logits(self.adapter, batch, self.answer_pos[i], removed[chunk],
                                                       self._values(corrupted_z), prefix)  # (B·c, V)
                        rows = batch[torch.arange(B, device=batch.clean_ids.device).repeat_interleave(c)]
                        clean = clean_answer.repeat_interleave(c, dim=0) if self.metric == "kl" else None
                        metric = compute_metric(self.metric, logits, rows, clean).view(B, c)
                        sums[i, chunk.to(self.device)] = metric.sum(dim=0).to(sums.device)
                        bar.advance(1)  # counted on the host: no device sync
        totals = (sums.cpu().double().sum(dim=0) / self.n).tolist()  # the one copy to the host
        full = unique.all(dim=1).tolist()
        return [self.m_clean if full[u] else totals[u] for u in inverse.tolist()]


def _prefix_batches(prefix: list[int], lengths: list[int], batch_size: int) -> list[torch.Tensor]:
    """Indices of the batches: pairs of one shared prefix together, by length, at most batch_size
    each (a batch then runs its circuits from its prefix on, for every pair of it)."""
    order = sorted(range(len(prefix)), key=lambda i: (prefix[i], lengths[i]))
    out, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or end - start == batch_size or prefix[order[end]] != prefix[order[start]]:
            out.append(torch.tensor(order[start:end]))
            start = end
    return out


def _trim(batch: TaskData, width: int) -> TaskData:
    """The batch cut to `width` positions (padding after every pair's last token: no metric reads it)."""
    for name in ("clean_ids", "corrupted_ids", "attention_mask"):
        setattr(batch, name, getattr(batch, name)[:, :width])
    return batch


def evaluate_each(evaluate: Callable[[torch.Tensor], float], masks: list[torch.Tensor]) -> list[float]:
    """`evaluate` of each mask: in batched forwards when `evaluate` is a head `Evaluator` (its
    `many`), else one by one (`circuitkit.discovery.pruning.edges.EdgeEvaluator`, a plain function)."""
    if not masks:
        return []
    what = f"evaluating {len(masks)} circuits on the held-out set"
    if isinstance(evaluate, Evaluator):
        return evaluate.many(torch.stack(masks), what)
    out = []
    with Progress(Console(stderr=True), what, len(masks), "circuits", announce=True) as bar:
        for m in masks:
            out.append(evaluate(m))
            bar.advance(1)
    return out


def faithfulness(m_circuit: float, m_full: float, m_empty: float) -> float:
    """(m(circuit) - m(empty)) / (m(full) - m(empty)); nan when full and empty coincide."""
    denom = m_full - m_empty
    return (m_circuit - m_empty) / denom if abs(denom) > 1e-12 else float("nan")


def curve_count(percent: float, n_total: int) -> int:
    """Entries kept at `percent` of `n_total`: int(share * n), as MIB's evaluation counts them."""
    return int(percent / 100 * n_total + 1e-9)


def curve_masks(scores: torch.Tensor, rank_by: str, valid: torch.Tensor | None = None,
                choose: Callable[[int], torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """{n_kept: kept mask shaped like `scores`} at each distinct count of CURVE_PERCENTS (MIB's grid of
    shares). `valid` marks which entries exist (edges), default all; `choose(n)` picks the kept mask
    of size n (default: the top n by `rank_by`, `keep_top`). Counts are whole entries, int(share * n)."""
    n_total = int(valid.sum()) if valid is not None else scores.numel()
    if choose is None:
        def choose(n: int) -> torch.Tensor:
            return keep_top(scores, n, rank_by, valid)
    return {n_keep: choose(n_keep) for n_keep in dict.fromkeys(curve_count(pct, n_total) for pct in CURVE_PERCENTS)}


def sparsity_curve(evaluate_kept: Callable[[torch.Tensor], float], scores: torch.Tensor, rank_by: str,
                   m_full: float, m_empty: float, valid: torch.Tensor | None = None,
                   choose: Callable[[int], torch.Tensor] | None = None,
                   measured: dict[int, float] | None = None) -> list[dict]:
    """Faithfulness when keeping CURVE_PERCENTS (MIB's grid of shares) of the heads or edges.

    evaluate_kept(mask) -> metric, with mask shaped like `scores` (True = kept); a head `Evaluator`
    runs every point in batched forwards (`evaluate_each`). `valid`, `choose`: as `curve_masks`.
    `measured`: {n_kept: metric} of points already evaluated (`curve_masks`' counts).
    """
    n_total = int(valid.sum()) if valid is not None else scores.numel()
    metrics = dict(measured or {})
    if not metrics:
        masks = curve_masks(scores, rank_by, valid, choose)
        metrics = dict(zip(masks, evaluate_each(evaluate_kept, list(masks.values())), strict=True))
    rows = []
    for pct in CURVE_PERCENTS:
        n_keep = curve_count(pct, n_total)
        rows.append({"percent_kept": pct, "n_kept": n_keep, "metric": metrics[n_keep],
                     "faithfulness": faithfulness(metrics[n_keep], m_full, m_empty)})
    return rows


def curve_areas(rows: list[dict]) -> tuple[float, float]:
    """(CPR, CMD): trapezoid areas of f and of |1 - f| over the fraction kept (0.001..1).

    MIB's definitions (its evaluate_area_under_curve): CPR = Σ_i (x_{i+1} - x_i)(f_i + f_{i+1})/2
    and CMD = Σ_i (x_{i+1} - x_i)(|1 - f_i| + |1 - f_{i+1}|)/2 over the shares x of the grid,
    on a linear axis; a circuit as faithful as the model at every share has CPR 0.999, CMD 0.
    MIB takes its CPR from the curve of the signed ranking and its CMD from the |score| one
    (`mib_pair`); on one curve both areas are that ranking's.
    """
    xs = [r["percent_kept"] / 100 for r in rows]
    fs = [r["faithfulness"] for r in rows]
    cpr = cmd = 0.0
    for i in range(1, len(xs)):
        dx = xs[i] - xs[i - 1]
        cpr += dx * (fs[i] + fs[i - 1]) / 2
        cmd += dx * (abs(1 - fs[i]) + abs(1 - fs[i - 1])) / 2
    return cpr, cmd
