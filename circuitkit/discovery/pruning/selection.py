"""Which heads or edges a circuit keeps, beyond plain top-k (`pruning.selection`).

    top_k      the n best by the attribution score (`pruning.rank_by`), as `keep_top` does
    bootstrap  bootstrapped selection (a winning idea of the BlackboxNLP 2025 MIB shared task):
               draw R resamples of the attribution examples (with replacement), take each
               resample's top n, and keep the n entries selected most often (ties: the higher
               full-data score). Entries whose rank depends on a few examples drop out in
               favour of ones that are in the top n on nearly every resample. Needs the
               per-example scores (`attribute(per_example=True)`), so it costs no model pass.
    ip         the connected edge set with the largest total score, by integer programming, and
    positive   the best n among the positive scores only (the signed rule): `circuitkit.discovery.pruning.selection_ip`.

`greedy_heads` is the oracle for small budgets: it adds, one at a time, the head whose addition
raises the metric most, by real forward passes (`Evaluator`); it says how faithful a circuit of
that size can be, and costs (number of candidates) forward passes per head added.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def keep_top(scores: torch.Tensor, n_keep: int, rank_by: str = "abs", valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask (shape of `scores`) keeping the `n_keep` best entries among `valid` ones."""
    key = (scores.abs() if rank_by == "abs" else scores).float().flatten().clone()
    if valid is not None:
        key[~valid.flatten()] = -math.inf
    mask = torch.zeros(key.numel(), dtype=torch.bool)
    if n_keep > 0:
        mask[key.argsort(descending=True, stable=True)[:n_keep]] = True
    if valid is not None:
        mask &= valid.flatten()
    return mask.view(scores.shape)



def bootstrap_weights(n_examples: int, n_resamples: int, seed: int = 0) -> torch.Tensor:
    """(n_resamples, n_examples) float32 counts of each example in each resample (multinomial, sum n)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_examples, (n_resamples, n_examples), generator=gen)
    return torch.zeros(n_resamples, n_examples).scatter_add_(1, idx, torch.ones(n_resamples, n_examples))


def resampled_scores(per_example: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean scores under each resample: per_example (N, *shape), weights (R, N) -> (R, *shape)."""
    flat = per_example.reshape(per_example.shape[0], -1).float()
    return (weights @ flat / weights.sum(1, keepdim=True)).reshape(weights.shape[0], *per_example.shape[1:])


class BootstrapSelector:
    """Bootstrapped selection at any size n, from one set of R resamples (ranks computed once).

    `selector(n)` is the bool mask (shape per_example.shape[1:]) of the n entries most often in a
    resample's top n (ties in frequency: the higher full-data score by `rank_by`).
    """

    def __init__(self, per_example: torch.Tensor, rank_by: str = "abs", n_resamples: int = 100, seed: int = 0,
                 valid: torch.Tensor | None = None) -> None:
        self.shape, self.valid = per_example.shape[1:], valid
        weights = bootstrap_weights(per_example.shape[0], n_resamples, seed)
        key = resampled_scores(per_example, weights).flatten(1)  # (R, n)
        key = key.abs() if rank_by == "abs" else key
        if valid is not None:
            key[:, ~valid.flatten()] = -math.inf
        order = key.argsort(dim=1, descending=True, stable=True)
        self.ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
        full = per_example.float().mean(0).flatten()
        full = full.abs() if rank_by == "abs" else full
        span = full.abs().max().clamp(min=1e-30)
        self.tie = 0.25 * (full / span + 1)  # in [0, 0.5): below one step of frequency

    def __call__(self, n_keep: int) -> torch.Tensor:
        counts = (self.ranks < n_keep).sum(0).float()
        return keep_top((counts + self.tie).view(self.shape), n_keep, "signed", self.valid)


def bootstrap_select(per_example: torch.Tensor, n_keep: int, rank_by: str = "abs", n_resamples: int = 100,
                     seed: int = 0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask (shape per_example.shape[1:]) of the `n_keep` entries most often in a resample's top n_keep.

    Ties in frequency go to the higher full-data score (by `rank_by`).
    """
    return BootstrapSelector(per_example, rank_by, n_resamples, seed, valid)(n_keep)


def example_ranks(per_example: torch.Tensor, rank_by: str = "abs", valid: torch.Tensor | None = None) -> torch.Tensor:
    """(N, n) int64: each entry's rank within its example by `rank_by` (0 = best; invalid entries last)."""
    key = per_example.reshape(per_example.shape[0], -1).float()
    key = key.abs() if rank_by == "abs" else key.clone()
    if valid is not None:
        key[:, ~valid.flatten()] = -math.inf
    order = key.argsort(dim=1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))


class RankSelector:
    """Kept sets by aggregating per-example ranks instead of mean scores (`pruning.selection`
    mean_rank / vote); per-example ranks computed once, any size n and any subset of the examples.

    mean_rank  the n entries with the lowest mean over examples of their rank in that example
    vote       the n entries in the most examples' own top n (ties: the higher mean score)

    An example with one huge score moves that entry's mean score, not its mean rank, so the kept
    set depends less on which examples were drawn. `selector(n, rows)`: bool mask (shape
    per_example.shape[1:]) from the examples `rows` (indices, repeats allowed; default all).
    """

    def __init__(self, per_example: torch.Tensor, rule: str = "mean_rank", rank_by: str = "abs",
                 valid: torch.Tensor | None = None) -> None:
        if rule not in ("mean_rank", "vote"):
            raise ValueError(f"RankSelector rule={rule!r}; allowed: mean_rank, vote")
        self.per_example, self.rule, self.rank_by, self.valid = per_example, rule, rank_by, valid
        self.ranks = example_ranks(per_example, rank_by, valid)  # (N, n)

    def __call__(self, n_keep: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        ranks = self.ranks if rows is None else self.ranks[rows]
        if self.rule == "mean_rank":
            key = -ranks.float().mean(0)
        else:
            scores = self.per_example if rows is None else self.per_example[rows]
            full = scores.float().mean(0).flatten()
            full = full.abs() if self.rank_by == "abs" else full
            key = (ranks < n_keep).float().sum(0) + 0.25 * (full / full.abs().max().clamp(min=1e-30) + 1)
        return keep_top(key.view(self.per_example.shape[1:]), n_keep, "signed", self.valid)


def rank_select(per_example: torch.Tensor, n_keep: int, rule: str = "mean_rank", rank_by: str = "abs",
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask (shape per_example.shape[1:]) of `RankSelector(per_example, rule, ...)` at n_keep."""
    return RankSelector(per_example, rule, rank_by, valid)(n_keep)


def greedy_heads(evaluate: Callable[[torch.Tensor], float], shape: tuple[int, int], budget: int,
                 candidates: torch.Tensor | None = None,
                 progress: Callable[[int, tuple[int, int], float], None] | None = None) -> list[dict]:
    """Exact greedy forward selection of heads by real forward passes.

    evaluate(kept (L, H) bool) -> metric. Starts from no head kept and adds, `budget` times, the
    candidate head (default: every head) whose addition gives the highest metric. Returns one
    row per step: {"n_kept", "head": [layer, head], "metric"}.
    """
    kept = torch.zeros(shape, dtype=torch.bool)
    pool = candidates.clone() if candidates is not None else torch.ones(shape, dtype=torch.bool)
    rows = []
    for step in range(min(budget, int(pool.sum()))):
        best, best_m = None, -math.inf
        for layer, head in pool.nonzero().tolist():
            trial = kept.clone()
            trial[layer, head] = True
            m = evaluate(trial)
            if m > best_m:
                best, best_m = (layer, head), m
        kept[best] = True
        pool[best] = False
        rows.append({"n_kept": step + 1, "head": list(best), "metric": best_m})
        if progress is not None:
            progress(step + 1, best, best_m)
    return rows


def greedy_mask(rows: list[dict], shape: tuple[int, int], n_keep: int) -> torch.Tensor:
    """The first `n_keep` heads of a greedy run as a (L, H) bool mask."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for row in rows[:n_keep]:
        mask[tuple(row["head"])] = True
    return mask
