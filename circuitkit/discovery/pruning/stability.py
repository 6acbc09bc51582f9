"""Stability of a circuit under resampling of the attribution examples (Meloux et al. 2025).

From the per-example scores (`attribute(per_example=True)`: no model pass), R bootstrap
resamples of the N examples (with replacement, `selection.bootstrap_weights`) each give mean
scores and a kept set of the same size as the circuit (the same selection rule: top n by
`rank_by`). Reported:

    jaccard_mean   mean over the R resamples of |K_r ∩ K| / |K_r ∪ K|, K the kept set of all N
    jaccard_p5     its 5th percentile (the bad tail)
    pairwise_mean  mean Jaccard over all pairs of resamples (K_r against K_s)

Meloux et al. propose jaccard >= 0.8 over >= 100 resamples as the bar for a stable circuit.
"""

from __future__ import annotations

import torch

from circuitkit.discovery.pruning.selection import bootstrap_weights, keep_top, resampled_scores

DEFAULT_RESAMPLES = 100


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a ∩ b| / |a ∪ b| of two bool masks (1.0 when both are empty)."""
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union


def stability(per_example: torch.Tensor, n_keep: int, rank_by: str = "abs", n_resamples: int = DEFAULT_RESAMPLES,
              seed: int = 0, valid: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> dict:
    """Jaccard of the kept set over `n_resamples` bootstrap resamples of the examples.

    per_example: (N, *shape) scores; `kept`: the circuit's kept mask (default: top `n_keep` of
    the mean over all N, by `rank_by`). Returns {jaccard_mean, jaccard_p5, pairwise_mean,
    n_resamples, n_examples, n_kept}.
    """
    if kept is None:
        kept = keep_top(per_example.float().mean(0), n_keep, rank_by, valid)
    weights = bootstrap_weights(per_example.shape[0], n_resamples, seed)
    masks = torch.stack([keep_top(row, n_keep, rank_by, valid).flatten()
                         for row in resampled_scores(per_example, weights)]).float()  # (R, n)
    ref = kept.flatten().float()
    inter = masks @ ref
    to_ref = inter / (masks.sum(1) + ref.sum() - inter).clamp(min=1)
    pair_inter = masks @ masks.T
    sizes = masks.sum(1)
    pair = pair_inter / (sizes[:, None] + sizes[None, :] - pair_inter).clamp(min=1)
    off = ~torch.eye(n_resamples, dtype=torch.bool)
    return {"jaccard_mean": float(to_ref.mean()), "jaccard_p5": float(torch.quantile(to_ref, 0.05)),
            "pairwise_mean": float(pair[off].mean()) if n_resamples > 1 else float("nan"),
            "n_resamples": n_resamples, "n_examples": int(per_example.shape[0]), "n_kept": int(n_keep)}


def kept_frequency(per_example: torch.Tensor, n_keep: int, rank_by: str = "abs",
                   n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """How often each entry is in the kept set over the bootstrap resamples `stability` draws
    (same weights for the same seed): float32 of shape per_example.shape[1:], in [0, 1]."""
    weights = bootstrap_weights(per_example.shape[0], n_resamples, seed)
    masks = torch.stack([keep_top(row, n_keep, rank_by, valid) for row in resampled_scores(per_example, weights)])
    return masks.float().mean(0)


def selector_stability(n_examples: int, select, kept, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0):
    """Jaccard of any selection rule's kept set over bootstrap resamples of the examples.

    `select(rows)`: the rule on the examples `rows` (int64 indices, drawn with replacement: the
    draws of `bootstrap_weights`) -> bool mask, or a list of masks (one per circuit size); it is
    compared with `kept` (a mask, or a list of them: the rule on all examples). For top_k this is
    `stability`'s jaccard_mean / jaccard_p5. Returns {jaccard_mean, jaccard_p5, n_resamples,
    n_examples} (a list of them for a list of masks).
    """
    weights = bootstrap_weights(n_examples, n_resamples, seed).long()  # (R, N) counts
    refs = kept if isinstance(kept, list | tuple) else [kept]
    scores = [[] for _ in refs]
    for counts in weights:
        got = select(torch.repeat_interleave(torch.arange(n_examples), counts))
        for out, ref, mask in zip(scores, refs, got if isinstance(got, list | tuple) else [got], strict=True):
            out.append(jaccard(mask, ref))
    res = [{"jaccard_mean": float(torch.tensor(s).mean()), "jaccard_p5": float(torch.quantile(torch.tensor(s), 0.05)),
            "n_resamples": n_resamples, "n_examples": n_examples} for s in scores]
    return res if isinstance(kept, list | tuple) else res[0]
