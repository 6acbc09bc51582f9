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


# Modules whose pairs are summed in one stacked product (`FactorSums.add_group`): a layer's worth.
# Their x_p and d_p live that much longer (GROUP x N x (k_i + k_o) floats, a few MiB).
GROUP = 8


class FactorSumsConsumer:
    """Feeds `sums` with the pairs of the backward `fisher` names: "empirical" (DATA labels) or
    "sampled" (SAMPLED labels). Consecutive modules with pairs of one shape are summed together,
    up to GROUP at a time (the backward meets a layer's modules one after another): a few stacked
    kernels per layer instead of a few per module."""

    def __init__(self, sums: FactorSums, fisher: str = "empirical") -> None:
        if fisher not in FISHERS:
            raise ValueError(f"grads.fisher={fisher!r}; valid: {', '.join(FISHERS)}.")
        self.sums = sums
        self.labels = FISHERS[fisher]
        self.waiting: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def take(self, name: str, xp: torch.Tensor, dp: torch.Tensor, batch: BatchFacts) -> None:
        if self.waiting and (len(self.waiting) == GROUP or self.waiting[0][1].shape != xp.shape
                             or self.waiting[0][2].shape != dp.shape):
            self.flush()
        self.waiting.append((name, xp, dp))

    def flush(self) -> None:
        """Sum the waiting modules' pairs."""
        if self.waiting:
            names, xps, dps = zip(*self.waiting, strict=True)
            self.waiting = []
            self.sums.add_group(names, xps, dps)

    def finish(self, batch: BatchFacts) -> None:
        self.flush()
        self.sums.add_tokens(batch.real_tokens)
