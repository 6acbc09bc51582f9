"""The capture's consumer of the K-FAC factor sums (`gradian.capture.consumers`).

From each module's projected pair of one backward, x_p (B, T, k_i) and d_p (B, T, k_o), zero at
padding, a `gradian.curvature.factors.FactorSums` adds

    A += Σ_{b, t} x_p x_pᵀ   (k_i, k_i),      S += Σ_{b, t} d_p d_pᵀ   (k_o, k_o),

and the batch's non-padding positions to its count. Which backward: the data's labels (the
empirical Fisher) or labels sampled from the model (the true Fisher, `grads.fisher=sampled`).
"""

from __future__ import annotations

import torch

from gradian.capture.consumers import DATA, SAMPLED, BatchFacts
from gradian.curvature.factors import FactorSums

FISHERS = {"empirical": DATA, "sampled": SAMPLED}  # grads.fisher -> the backward its factors are summed from


class FactorSumsConsumer:
    """Feeds `sums` with the pairs of the backward `fisher` names: "empirical" (DATA labels) or
    "sampled" (SAMPLED labels)."""

    def __init__(self, sums: FactorSums, fisher: str = "empirical") -> None:
        if fisher not in FISHERS:
            raise ValueError(f"grads.fisher={fisher!r}; valid: {', '.join(FISHERS)}.")
        self.sums = sums
        self.labels = FISHERS[fisher]

    def take(self, name: str, xp: torch.Tensor, dp: torch.Tensor, batch: BatchFacts) -> None:
        self.sums.add(name, xp, dp)

    def finish(self, batch: BatchFacts) -> None:
        self.sums.add_tokens(batch.real_tokens)
