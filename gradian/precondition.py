"""Preconditioned scores: each module's second moment of the indexed rows, applied at rank time.

A stored row is the modules' projected gradients side by side, g = [g_1, ..., g_M], each block
of width k (= grads.projection_dim). With ``grads.preconditioner: module`` the indexer stores,
in every shard, the blocks' sums of outer products over the shard's rows,

    S_m = Σ_rows g_m g_mᵀ                  (k, k) per module, tensor ``second_moment`` (M, k, k)

computed in float64 from the values as stored (so `gradian inspect --verify` can recompute it)
and saved as float32. Sums add: any sharding, worker count or resume gives the same total. At
rank time the shards' sums are added in float64 and, per module,

    F_m = S_m / n                          the empirical Fisher / Gauss-Newton matrix in the
                                           projected space (TRAK's ΦᵀΦ, LoGra's eFIM)
    λ_m = damping · tr(F_m) / k            damping 0.1: a tenth of the mean eigenvalue
    A_m = (F_m + λ_m I)⁻¹

Scores of a query q against a row g:

    influence(q, g) = Σ_m q_mᵀ A_m g_m                                  (influence-function style)
    whitened(q, g)  = influence(q, g) / (‖q‖_A ‖g‖_A),  ‖v‖_A² = Σ_m v_mᵀ A_m v_m

``whitened`` is the cosine after whitening each block with W_m = L_m⁻¹, where F_m + λ_m I =
L_m L_mᵀ (Cholesky), so W_mᵀ W_m = A_m and ‖W_m g_m‖ = ‖g_m‖_A: directions every row
shares (large eigenvalues of F_m) count less, directions that single rows out count more. The
damping keeps directions no row explored (eigenvalue ~0) from dominating: relative to the mean
eigenvalue it does not depend on the loss scale, the model or k.

Rank-time cost: `influence` is one (Q, W) x (W, n) matmul per shard, as `dot`; `whitened`
also whitens every shard row, M · n · k² more multiply-adds (docs/benchmarks.md measures both).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from circuitkit.config import GradsConfig, choices

PRECONDITIONERS = choices(GradsConfig, "preconditioner")
DAMPING = 0.1
# Above this width per module the (k, k) sums cost more disk than they are worth (k² floats per
# shard and module) and the rank-time whitening k² per row: refuse instead of surprising.
MAX_BLOCK_WIDTH = 4096
TENSOR = "second_moment"


def check_block_width(projection_dim: int | None, preconditioner: str) -> None:
    """grads.preconditioner=module needs projected rows of width <= MAX_BLOCK_WIDTH per module."""
    if preconditioner == "none":
        return
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(f"grads.preconditioner={preconditioner!r}; valid: {', '.join(PRECONDITIONERS)}.")
    if projection_dim is None or projection_dim > MAX_BLOCK_WIDTH:
        raise ValueError(f"grads.preconditioner={preconditioner} stores a (k, k) matrix per module and shard;"
                         f" with grads.projection_dim={projection_dim} that is too large. Set grads.projection_dim"
                         f" to at most {MAX_BLOCK_WIDTH}, or grads.preconditioner=none.")


def shard_second_moment(stored: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Σ_rows g_m g_mᵀ per block: stored (n, M·k) -> (M, k, k) float32 (summed in float64)."""
    n, width = stored.shape
    if width % n_blocks:
        raise ValueError(f"row width {width} is not {n_blocks} blocks of equal width.")
    k = width // n_blocks
    out = torch.empty(n_blocks, k, k, dtype=torch.float32)
    for m in range(n_blocks):  # one block at a time: float64 scratch of n x k, not n x M x k
        block = stored[:, m * k:(m + 1) * k].double()
        out[m] = (block.T @ block).float()
    return out


class Preconditioner:
    """Per-module damped inverse second moments A_m (M, k, k) float64 and whiteners W_m (WᵀW = A).

    Built from the total of the shards' ``second_moment`` sums and the row count (`from_sums`).
    """

    def __init__(self, inverse: torch.Tensor, whitener: torch.Tensor, damping: float, lambdas: torch.Tensor) -> None:
        self.inverse = inverse  # (M, k, k) A_m, float64
        self.whitener = whitener  # (M, k, k) W_m = L_m⁻¹, lower triangular, float64
        # Applied in float32: rows are stored in float16/bfloat16/float32, so float64 would only
        # slow the per-shard whitening down. Row vectors: A g -> g A (A symmetric), W g -> g Wᵀ.
        self._inverse32, self._whitener_t32 = inverse.float(), whitener.transpose(1, 2).contiguous().float()
        self.damping = damping
        self.lambdas = lambdas  # (M,) λ_m

    @classmethod
    def from_sums(cls, sums: Iterable[torch.Tensor], n_rows: int, damping: float = DAMPING) -> Preconditioner:
        """sums: each shard's (M, k, k) second moment; n_rows: the rows they cover."""
        if damping <= 0:
            raise ValueError(f"damping={damping}; it must be > 0 (a share of the mean eigenvalue).")
        total = None
        for s in sums:
            total = s.double() if total is None else total + s.double()
        if total is None or n_rows < 1:
            raise ValueError("no second-moment sums to build a preconditioner from.")
        fisher = total / n_rows  # (M, k, k)
        k = fisher.shape[-1]
        # The mean eigenvalue is the trace over k: no eigendecomposition (which is also far
        # slower than a Cholesky factorisation on some LAPACK builds: seconds for 8 x 256²).
        lambdas = damping * torch.diagonal(fisher, dim1=1, dim2=2).sum(dim=1) / k
        lambdas = torch.where(lambdas > 0, lambdas, torch.ones_like(lambdas))  # an all-zero block: identity
        eye = torch.eye(k, dtype=torch.float64)
        chol = torch.linalg.cholesky(fisher + lambdas[:, None, None] * eye)  # L, (M, k, k)
        whitener = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)  # L⁻¹
        inverse = whitener.transpose(1, 2) @ whitener  # L⁻ᵀ L⁻¹ = (F + λI)⁻¹
        return cls(inverse, whitener, damping, lambdas)

    @property
    def n_blocks(self) -> int:
        return self.inverse.shape[0]

    def _apply(self, mats: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, M·k) -> each block times its (k, k) matrix on the right, (n, M·k) float32."""
        n = rows.shape[0]
        blocks = rows.float().reshape(n, self.n_blocks, -1).transpose(0, 1)  # (M, n, k)
        return (blocks @ mats).transpose(0, 1).reshape(n, -1)

    def precondition(self, rows: torch.Tensor) -> torch.Tensor:
        """A g per block: (n, M·k) -> (n, M·k) float32 (for queries: influence = (A q)ᵀ g)."""
        return self._apply(self._inverse32, rows)

    def whiten(self, rows: torch.Tensor) -> torch.Tensor:
        """W g per block: (n, M·k) -> (n, M·k) float32; ‖W g‖ = ‖g‖_A and (W q)·(W g) = qᵀ A g."""
        return self._apply(self._whitener_t32, rows)
