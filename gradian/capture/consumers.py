"""What the capture hands each module's projected pair to: small consumers, one per purpose.

For every selected module and batch the capture (`gradian.capture.gradients.capture_batch`) computes

    x_p = P_in x    (B, T, k_i)   the projected module input, zero at padding
    d_p = P_out δ   (B, T, k_o)   the projected gradient at the module output, δ = dL_b/dy

and calls `take(name, x_p, d_p, batch)` on each consumer of that backward, in backward order, then
`finish(batch)` once the batch is done. A consumer says which backward it reads (`labels`): DATA,
the loss of the data's own labels, or SAMPLED, the cross-entropy of labels drawn from the model
(the true Fisher, `grads.fisher=sampled`: a second backward of the same forward). The rows here:

    RowsConsumer            G_b = Σ_t d_p[b, t] x_p[b, t]ᵀ  (k_o, k_i) per example, the stored row
    SampledFisherConsumer   the same of the sampled labels' backward (the EK-FAC eigenvalues' rows)

The K-FAC factor sums Σ x_p x_pᵀ and Σ d_p d_pᵀ are `gradian.curvature.consumers.FactorSumsConsumer`
(a room above: consumers may come from any room that imports this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gradian.projection.projector import Projector

DATA, SAMPLED = "data", "sampled"  # the backward a consumer reads: the data's labels, or sampled ones


@dataclass(frozen=True)
class BatchFacts:
    """What a consumer may need of a batch besides its pairs, host values known at collate time.

    `spans` (B,): per example its last supervised hidden position + 1 (the positions that can carry
    a gradient); `real_tokens`: the batch's non-padding positions."""

    spans: list[int]
    real_tokens: int


class Consumer(Protocol):
    """One purpose fed with every module's pair of one backward (`labels`: DATA or SAMPLED)."""

    labels: str

    def take(self, name: str, xp: torch.Tensor, dp: torch.Tensor, batch: BatchFacts) -> None:
        """xp (B, T, k_i), dp (B, T, k_o) of module `name`, on the device; nothing here may wait for it."""

    def finish(self, batch: BatchFacts) -> None:
        """The batch's last module has been taken."""


class RowsConsumer:
    """Each example's projected gradient per module, name -> (B, width) float32 in `blocks`:
    Σ_t d_p x_pᵀ flattened (`Projector.combine`), or with `factored` (a row format with
    `combine_all(pairs, spans)`, `gradian.index.formats.factored.FactoredRows`) its rank-c factors
    [U | V], every module of the batch factored together in `finish` (one SVD call per batch).
    `names`: the modules in row order (`row`)."""

    labels = DATA

    def __init__(self, projector: Projector, names: Sequence[str], factored=None) -> None:
        self.projector, self.names, self.factored = projector, list(names), factored
        self.blocks: dict[str, torch.Tensor] = {}
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, name: str, xp: torch.Tensor, dp: torch.Tensor, batch: BatchFacts) -> None:
        if self.factored is None:
            self.blocks[name] = self.projector.combine(name, xp, dp)
        else:
            self._pairs[name] = (xp, dp)

    def finish(self, batch: BatchFacts) -> None:
        if self._pairs:
            self.blocks = self.factored.combine_all(self._pairs, batch.spans)
            self._pairs = {}

    def row(self) -> torch.Tensor:
        """The stored rows: the modules' blocks side by side in row order, (B, Σ widths) float32."""
        return torch.cat([self.blocks[name] for name in self.names], dim=1)


class SampledFisherConsumer(RowsConsumer):
    """`RowsConsumer` of the sampled labels' backward: the rows of the true Fisher, from which the
    EK-FAC eigenvalues are computed (the stored rows keep the data's labels)."""

    labels = SAMPLED
