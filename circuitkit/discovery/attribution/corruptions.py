"""Scores under several corruptions of the same clean pairs, and the one ranking made of them.

Corruption c moves the metric by its gap g_c = m(clean) - m(corrupted_c), and its scores add up to
about g_c (IG completeness), so s_c(u) / g_c is the share of c's effect that component u carries,
comparable across corruptions whose gaps differ. `discovery.corruption_scores` combines the
shares, then multiplies by the mean gap ḡ to return to the metric's units:

    mean  s(u) = ḡ · mean_c s_c(u) / g_c
    min   s(u) = ḡ · the share of smallest |·| over c  (u counts only where every corruption needs it)
    max   s(u) = ḡ · the share of largest |·| over c   (u counts where any corruption needs it)

The per-corruption scores stay beside the combined ones (`AttributionScores.by_corruption`, and
`corruption.<name>.*` in scores.safetensors).
"""

from __future__ import annotations

import dataclasses

import torch

from circuitkit.discovery.attribution.eap import AttributionScores, attribute_corruptions
from circuitkit.discovery.config import DiscoveryConfig
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter

SHARED_CLEAN = ("eap", "eap-ig", "clean-corrupted")  # the algorithms that record the clean run once for all
MIN_GAP = 1e-6  # a corruption that moves the metric less than this has no share to speak of


def run_corruptions(adapter: ModelAdapter, datas: dict[str, TaskData], cfg: DiscoveryConfig,
                    progress: bool = True) -> AttributionScores:
    """`cfg.algorithm`'s scores under each corruption of `datas` ({name: N pairs}, primary first,
    same clean pairs), combined by `cfg.corruption_scores`; `by_corruption` keeps each one's."""
    from circuitkit.discovery.attribution import _per_example_in_data_order, run_attribution

    per_example = getattr(cfg, "per_example", False)
    if cfg.algorithm in SHARED_CLEAN:
        found = attribute_corruptions(adapter, list(datas.values()), cfg.algorithm, cfg.level, cfg.metric,
                                      cfg.ig_steps, cfg.batch_size, progress, ig_rule=cfg.ig_rule,
                                      per_example=per_example)
        found = [_per_example_in_data_order(s, d, cfg.batch_size) for s, d in zip(found, datas.values(), strict=True)]
    else:  # the others run their own clean passes per corruption
        found = [run_attribution(adapter, d, cfg, progress) for d in datas.values()]
    return combine(dict(zip(datas, found, strict=True)), cfg.corruption_scores)


def gap(scores: AttributionScores) -> float:
    """m(clean) - m(corrupted) of one corruption's scores, kept away from 0 with its sign."""
    g = scores.metric_clean - scores.metric_corrupted
    return g if abs(g) >= MIN_GAP else (MIN_GAP if g >= 0 else -MIN_GAP)


def combine_shares(shares: torch.Tensor, rule: str) -> torch.Tensor:
    """shares (C, ...) -> (...): `rule` (mean, min, max; module docstring) over the first axis."""
    if rule == "mean":
        return shares.mean(0)
    pick = shares.abs().argmin(0) if rule == "min" else shares.abs().argmax(0)
    return shares.gather(0, pick[None]).squeeze(0)


def combine(by: dict[str, AttributionScores], rule: str) -> AttributionScores:
    """One AttributionScores from several corruptions' (module docstring). Its metric figures are
    the primary's (the first), per-example rows are combined example by example with each
    corruption's own gap, and `info` records the rule and every corruption's metric figures."""
    names = list(by)
    first = by[names[0]]
    gaps = torch.tensor([gap(by[c]) for c in names])
    scale = float(gaps.mean())

    def combined(get) -> torch.Tensor | None:
        parts = [get(by[c]) for c in names]
        if parts[0] is None:
            return None
        shares = torch.stack([p.float() / g for p, g in zip(parts, gaps.tolist(), strict=True)])
        return combine_shares(shares, rule) * scale

    per_example = None
    if first.per_example:
        per_example = {k: combined(lambda s, k=k: (s.per_example or {}).get(k)) for k in first.per_example}
    info = {**first.info, "corruption_scores": rule, "corruptions": names,
            "corruption_metrics": {c: {"metric_clean": by[c].metric_clean, "metric_corrupted": by[c].metric_corrupted}
                                   for c in names}}
    return dataclasses.replace(first, head=combined(lambda s: s.head), mlp=combined(lambda s: s.mlp),
                               embed=combined(lambda s: s.embed), edges=combined(lambda s: s.edges), info=info,
                               per_example=per_example, by_corruption=by)
