"""Dense rows (`grads.row_format: dense`, the default): each module's projected gradient G (k_o, k_i) itself.

A stored row is every module's block flattened row-major, modules in row order, in grads.storage_dtype,
width Σ_m k_o k_i; its norm is that of the stored values, so cosine reads back exactly what is stored:

    dot(q, g)    = qᵀ g
    cosine(q, g) = qᵀ g / (|q| |g|)

Every score applies: the module second moments (influence, whitened) and the K-FAC curvature (kfac,
ekfac) precondition the dense query, and EK-FAC's eigenvalues rotate each stored block,
Σ_rows (Q_outᵀ G Q_in)².
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradian.index.formats.base import RowFormat, Scorer, per_unit_norm


@dataclass(frozen=True)
class DenseFormat(RowFormat):
    """Rows stored as they are computed, (n, row_width) in the storage dtype."""

    name = "dense"
    float_rows = True
    moments = True

    storage_dtype: str
    row_width: int | None = None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> DenseFormat:
        return cls(manifest["storage_dtype"], manifest.get("row_width"))

    @classmethod
    def describe(cls, summary: Mapping[str, Any]) -> tuple[str, str]:
        return (f"{summary.get('row_width')} ({summary.get('storage_dtype')})",
                "dense (each module's k_o x k_i block)")

    @property
    def width(self) -> int | None:
        return self.row_width

    def norms(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.float().norm(dim=1)

    def scorer(self, queries: torch.Tensor, *, cosine: bool, preconditioned: bool) -> Scorer:
        def score(grads: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
            scores = queries @ grads.T  # (Q, n)
            return per_unit_norm(scores, norms) if cosine else scores

        return score

    def ekfac_squares(self, rows: torch.Tensor, shapes: list[tuple[int, int]], q_in: list[torch.Tensor],
                      q_out: list[torch.Tensor]) -> list[torch.Tensor]:
        out, start = [], 0
        for m, (k_o, k_i) in enumerate(shapes):
            block = rows[:, start:start + k_o * k_i].double().reshape(-1, k_o, k_i)
            start += k_o * k_i
            rotated = q_out[m].T @ block @ q_in[m]
            out.append((rotated * rotated).sum(0))
        return out
