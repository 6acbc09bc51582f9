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
    A_m = (F_m + λ_m I)⁻¹                  never formed: F_m + λ_m I = L_m L_mᵀ is factored once
                                           (Cholesky) and each use is a triangular solve

Scores of a query q against a row g:

    influence(q, g) = Σ_m q_mᵀ A_m g_m                                  (influence-function style)
    whitened(q, g)  = influence(q, g) / (‖q‖_A ‖g‖_A),  ‖v‖_A² = Σ_m v_mᵀ A_m v_m

``whitened`` is the cosine after whitening each block with W_m = L_m⁻¹, where F_m + λ_m I =
L_m L_mᵀ (Cholesky), so W_mᵀ W_m = A_m and ‖W_m g_m‖ = ‖g_m‖_A: directions every row
shares (large eigenvalues of F_m) count less, directions that single rows out count more. The
damping keeps directions no row explored (eigenvalue ~0) from dominating: relative to the mean
eigenvalue it does not depend on the loss scale, the model or k.

Rank-time cost: one Cholesky factorisation per module (M k³ / 3 in float64, once), then
`influence` is two triangular solves for the Q queries and one (Q, W) x (W, n) matmul per
shard, as `dot`; `whitened` also solves for every shard row, M · n · k² more multiply-adds
(docs/benchmarks.md measures both). Disk: k² float32 per module and shard (width 4096: 64 MiB
per module and shard); `gradian.curvature.factors`'s K-FAC factors are the small alternative.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from circuitkit.core.config import choices
from gradian.settings.grads import GradsConfig

PRECONDITIONERS = choices(GradsConfig, "preconditioner")
DAMPING = 0.1
# Above this width per module the (k, k) sums cost more disk than they are worth (k² floats per
# shard and module) and the rank-time whitening k² per row: refuse instead of surprising.
MAX_BLOCK_WIDTH = 4096
TENSOR = "second_moment"


def check_block_width(projection_dim: int | None, preconditioner: str) -> None:
    """grads.preconditioner=module needs projected rows of width <= MAX_BLOCK_WIDTH per module
    (kfac's factors are checked on the projector, `gradian.curvature.factors.check_kfac`)."""
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(f"grads.preconditioner={preconditioner!r}; valid: {', '.join(PRECONDITIONERS)}.")
    if preconditioner in ("none", "kfac"):
        return
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
    """Per-module damped second moments F_m + λ_m I (M, k, k), kept as their Cholesky factors L_m.

    Built from the total of the shards' ``second_moment`` sums and the row count (`from_sums`).
    Nothing is inverted: `precondition` solves with L_m (queries only), `whiten` solves L_m y = g
    for the rows. `inverse` and `whitener` form the matrices, for tests.
    """

    def __init__(self, chol: torch.Tensor, damping: float, lambdas: torch.Tensor) -> None:
        self.chol = chol  # (M, k, k) L_m, lower triangular, float64
        # The rows' whitening runs in float32: rows are stored in float16/bfloat16/float32, so
        # float64 would only slow the per-shard solve down. Row vectors: W g = L⁻¹ g -> g L⁻ᵀ,
        # i.e. y Lᵀ = g solved from the right with the upper triangular Lᵀ.
        self._chol_t32 = chol.transpose(1, 2).contiguous().float()
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
        fisher.diagonal(dim1=1, dim2=2).add_(lambdas[:, None])
        return cls(torch.linalg.cholesky(fisher), damping, lambdas)  # factor once, in place of an inverse

    @property
    def n_blocks(self) -> int:
        return self.chol.shape[0]

    @property
    def whitener(self) -> torch.Tensor:
        """W_m = L_m⁻¹ (M, k, k) float64 (formed for tests; ranking solves instead)."""
        eye = torch.eye(self.chol.shape[-1], dtype=torch.float64).expand_as(self.chol)
        return torch.linalg.solve_triangular(self.chol, eye, upper=False)

    @property
    def inverse(self) -> torch.Tensor:
        """A_m = (F_m + λ_m I)⁻¹ (M, k, k) float64 (formed for tests; ranking solves instead)."""
        w = self.whitener
        return w.transpose(1, 2) @ w

    def _blocks(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        return rows.reshape(n, self.n_blocks, -1).transpose(0, 1)  # (M, n, k)

    def precondition(self, rows: torch.Tensor) -> torch.Tensor:
        """A g per block: (n, M·k) -> (n, M·k) float32, by two triangular solves in float64 (for
        queries: influence = (A q)ᵀ g)."""
        n = rows.shape[0]
        blocks = self._blocks(rows.double()).transpose(1, 2)  # (M, k, n)
        return torch.cholesky_solve(blocks, self.chol).transpose(1, 2).transpose(0, 1).reshape(n, -1).float()

    def whiten(self, rows: torch.Tensor) -> torch.Tensor:
        """W g = L⁻¹ g per block: (n, M·k) -> (n, M·k) float32; ‖W g‖ = ‖g‖_A, (W q)·(W g) = qᵀ A g."""
        n = rows.shape[0]
        solved = torch.linalg.solve_triangular(self._chol_t32, self._blocks(rows.float()), upper=True, left=False)
        return solved.transpose(0, 1).reshape(n, -1)
