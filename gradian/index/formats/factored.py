"""Factored rows (`grads.row_format: factored`): each module's projected gradient as rank-c factors.

For a linear module with Kronecker projection P_out (k_o, d_out), P_in (k_i, d_in) an example's
stored block is (`gradian.projection.projector`, `gradian.capture.gradients`)

    G = Σ_t s_t a_tᵀ = Sᵀ A       (k_o, k_i),   s_t = P_out δ_t (k_o,),  a_t = P_in x_t (k_i,),

S (T, k_o) and A (T, k_i) stacking the T positions where both are non-zero. T is not only the
supervised tokens: below the top of the model attention carries the loss's gradient back to every
earlier position, so T is the row's length up to its last supervised token (positions after it
have δ = 0). rank(G) ≤ min(T, k_o, k_i). A factored row stores per module

    U (k_o, c),  V (k_i, c)   with   G ≈ U Vᵀ,   c = grads.row_rank,

c (k_o + k_i) values instead of k_o k_i, laid out [U | V] row-major per module, modules in row
order. Raw rows (projection_dim null) factor the same way with (k_o, k_i) = (d_out, d_in).

* T ≤ c: the token factors themselves, U = [s_t ρ_t], V = [a_t / ρ_t], ρ_t = (|a_t| / |s_t|)^½
  (each pair rescaled to equal norms: δ is orders of magnitude smaller than x, and float16 must
  hold both), zero columns after the T-th. Exact.
* T > c: G's best rank-c approximation (Eckart-Young, Frobenius and spectral norm), without
  forming G: thin QRs Sᵀ = Q_S R_S, Aᵀ = Q_A R_A (Q_S (k_o, r_S), r_S = min(k_o, T)), the SVD
  of the small core R_S R_Aᵀ = W Σ Zᵀ (r_S, r_A), so that G = (Q_S W) Σ (Q_A Z)ᵀ is G's SVD;
  U = Q_S W_c Σ_c^½, V = Q_A Z_c Σ_c^½ (float64). Exact whenever c ≥ rank(G).

Scores never form a row's G. Two blocks' inner product is a sum over c × c Gram products,

    ⟨U_a V_aᵀ, U_b V_bᵀ⟩_F = trace(V_a U_aᵀ U_b V_bᵀ) = Σ_jl (U_aᵀ U_b)_jl (V_aᵀ V_b)_jl,

and a query is factored once, exactly (`FactoredScorer`: a randomized range finder with a residual
check, `_query_factors`), so a query of rank ≤ r costs r c (k_o + k_i) multiply-adds per row and
module, against k_o k_i for a dense row of the same projection. The norm stored with each row is |U Vᵀ|_F over its modules, so cosine is that of
the rows as represented. K-FAC's damped inverse (S ⊗ A + λI)⁻¹ is not a Kronecker product (λ is
added to the products e_S e_A of the factors' eigenvalues) and EK-FAC's corrected eigenvalues are
not separable either, so for kfac / ekfac the query is preconditioned dense as for dense rows
(`gradian.index.curvature.KroneckerCurvature`) and scored against the factors as
⟨Q̃, U Vᵀ⟩ = Σ U ⊙ (Q̃ V): k_o k_i c per row and module; the index rows stay factored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import UserError
from gradian.index.formats.base import RowFormat, Scorer, per_unit_norm
from gradian.settings.grads import GradsConfig

log = logging.getLogger(__name__)

# A query block is factored exactly up to this share of its norm (a block formed in float32 is exact
# to about 1e-7): the rest moves a cosine by at most 1e-5.
QUERY_RESIDUAL = 1e-5
# Scoring and EK-FAC intermediates are chunked over rows to about this many numbers.
CHUNK_ELEMENTS = 2**24


def block_factors(s: torch.Tensor, a: torch.Tensor, rank: int,
                  spans: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's block G = Sᵀ A as U (B, k_o, rank), V (B, k_i, rank) float32 (module docstring).

    s (B, T, k_o), a (B, T, k_i): the positions' projected output gradients and inputs; positions
    where either is zero (padding, after the last supervised token) add nothing to G and are dropped,
    so an example's factors do not depend on its batch (to round-off). `spans` (B,) host integers:
    per example, how many leading positions can be non-zero (its last supervised position + 1, known
    when the batch is collated); None reads them off the device (a wait). An example of span <= rank
    keeps its token factors in position order, each pair at equal norms (exact); the others go
    through one QR pair and one small SVD (`many_block_factors` does several modules' at once).
    Singular pairs are signed so that U's columns sum >= 0.
    """
    return many_block_factors([(s, a)], rank, spans)[0]


def many_block_factors(pairs: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                       spans: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`block_factors` of several modules' (s, a) pairs of one batch, with one batched SVD for all of
    them: an SVD checks its convergence on the host, so one call per batch waits for the device once,
    not once per module. Each module's small core R_S R_Aᵀ is zero-padded to the largest core's shape
    (padding adds only zero singular values; the top pairs are the unpadded core's)."""
    out: list[list[torch.Tensor]] = []
    cores: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (module, index, q_s, q_a, core)
    for m, (s, a) in enumerate(pairs):
        live = (s != 0).any(dim=2) & (a != 0).any(dim=2)  # (B, T)
        s, a = s.double() * live[..., None], a.double() * live[..., None]
        n_b, n_t, k_o, k_i = s.shape[0], s.shape[1], s.shape[2], a.shape[2]
        if spans is None:
            positions = torch.arange(1, n_t + 1, device=s.device)
            spans = (live * positions).amax(dim=1).tolist() if n_t else [0] * n_b
        u, v = s.new_zeros(n_b, k_o, rank), a.new_zeros(n_b, k_i, rank)
        out.append([u, v])
        few = [b for b, span in enumerate(spans) if span <= rank]
        many = [b for b, span in enumerate(spans) if span > rank]
        if few:  # the token factors in position order, each pair at equal norms: exact
            index = torch.tensor(few).to(s.device, non_blocking=True)
            width = min(rank, n_t)
            s_few, a_few = s[index, :width], a[index, :width]  # (F, width, k)
            s_norm, a_norm = s_few.norm(dim=2), a_few.norm(dim=2)
            token = (s_norm > 0) & (a_norm > 0)  # a position that adds to G
            rho = torch.where(token, a_norm / torch.where(token, s_norm, 1.0), 1.0).sqrt()[..., None]
            u[index, :, :width] = (s_few * rho).mT
            v[index, :, :width] = (a_few / rho * token[..., None]).mT
        if many:  # G's SVD from the QRs of its token-factor matrices and the SVD of their small core
            index = torch.tensor(many).to(s.device, non_blocking=True)
            q_s, r_s = torch.linalg.qr(s[index].mT)  # (B', k_o, r_S), (B', r_S, T)
            q_a, r_a = torch.linalg.qr(a[index].mT)  # (B', k_i, r_A), (B', r_A, T)
            cores.append((m, index, q_s, q_a, r_s @ r_a.mT))  # (B', r_S, r_A)
    if not cores:
        return [(u.float(), v.float()) for u, v in out]
    rows_max = max(core.shape[1] for *_, core in cores)
    cols_max = max(core.shape[2] for *_, core in cores)
    padded = torch.cat([torch.nn.functional.pad(core, (0, cols_max - core.shape[2], 0, rows_max - core.shape[1]))
                        for *_, core in cores])
    w_all, sigma_all, z_t_all = torch.linalg.svd(padded, full_matrices=False)
    first = 0
    for m, index, q_s, q_a, core in cores:
        part = slice(first, first + core.shape[0])
        first += core.shape[0]
        r_s, r_a = core.shape[1], core.shape[2]
        w, sigma, z_t = w_all[part, :r_s], sigma_all[part], z_t_all[part, :, :r_a]
        r = min(rank, r_s, r_a)
        root = sigma[:, None, :r].sqrt()
        u_many, v_many = (q_s @ w[:, :, :r]) * root, (q_a @ z_t[:, :r].mT) * root
        sign = torch.where(u_many.sum(dim=1, keepdim=True) < 0, -1.0, 1.0).to(u_many.dtype)
        u, v = out[m]
        u[index, :, :r], v[index, :, :r] = u_many * sign, v_many * sign
    return [(u.float(), v.float()) for u, v in out]


class FactoredRows:
    """The capture side of `grads.row_format: factored` (`gradian.capture.gradients.per_example_gradients`):
    `combine` stands in for `Projector.combine`."""

    def __init__(self, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"grads.row_rank={rank}; it must be >= 1.")
        self.rank = rank

    def layout(self, projector) -> FactoredLayout:
        """Where `projector`'s modules' factors sit in a row (`projector_layout`)."""
        return projector_layout(projector, self.rank)

    def combine(self, name: str, xp: torch.Tensor, dp: torch.Tensor, spans: list[int] | None = None) -> torch.Tensor:
        """xp (B, T, k_i), dp (B, T, k_o) -> each example's [U | V] flattened, (B, rank (k_o + k_i)) float32
        (`block_factors`; `spans` its host-side spans)."""
        return self.combine_all({name: (xp, dp)}, spans)[name]

    def combine_all(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    spans: list[int] | None = None) -> dict[str, torch.Tensor]:
        """`combine` of every module of a batch at once, name -> (xp, dp): one SVD call for all of them
        (`many_block_factors`)."""
        factors = many_block_factors([(dp, xp) for xp, dp in pairs.values()], self.rank, spans)
        return {name: torch.cat([u.flatten(1), v.flatten(1)], dim=1) for name, (u, v) in zip(pairs, factors, strict=True)}


@dataclass(frozen=True)
class FactoredLayout:
    """Where each module's U (k_o, c) and V (k_i, c) sit in a factored row."""

    sides: tuple[tuple[int, int], ...]  # (k_o, k_i) per module, in row order
    rank: int

    @property
    def width(self) -> int:
        """Stored values per row: Σ_m c (k_o + k_i)."""
        return sum(self.rank * (k_o + k_i) for k_o, k_i in self.sides)

    @property
    def dense_width(self) -> int:
        """Values per row of the same projection stored dense: Σ_m k_o k_i (a query's width)."""
        return sum(k_o * k_i for k_o, k_i in self.sides)

    def split(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """rows (n, width) -> per module (U (n, k_o, c), V (n, k_i, c)), views of `rows`."""
        n, c, start, out = rows.shape[0], self.rank, 0, []
        for k_o, k_i in self.sides:
            u = rows[:, start:start + k_o * c].reshape(n, k_o, c)
            v = rows[:, start + k_o * c:start + (k_o + k_i) * c].reshape(n, k_i, c)
            out.append((u, v))
            start += (k_o + k_i) * c
        if start != rows.shape[1]:
            raise ValueError(f"factored rows of width {rows.shape[1]}, the layout's is {start}.")
        return out

    def norms(self, rows: torch.Tensor) -> torch.Tensor:
        """|U Vᵀ|_F over the modules, (n,) float32: Σ_m Σ_jl (UᵀU)_jl (VᵀV)_jl, in float64."""
        total = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
        for u, v in self.split(rows):
            u, v = u.double(), v.double()
            total += ((u.mT @ u) * (v.mT @ v)).sum(dim=(1, 2))
        return total.clamp_min(0).sqrt().float()

    def densify(self, rows: torch.Tensor) -> torch.Tensor:
        """The dense rows U Vᵀ the factors stand for, (n, dense_width) float32 (tests, references)."""
        return torch.cat([(u @ v.mT).flatten(1) for u, v in self.split(rows.float())], dim=1)


def projector_layout(projector, rank: int) -> FactoredLayout:
    """The layout of `projector`'s rows factored at `rank` (raw rows: each module's shape)."""
    return FactoredLayout(tuple(projector.factors.get(n, s) for n, s in projector.shapes.items()), rank)


def layout_of(manifest: Mapping[str, Any]) -> FactoredLayout | None:
    """The factored layout an index manifest records, or None for dense rows."""
    if manifest.get("row_format", "dense") != "factored":
        return None
    modules = (manifest.get("projection") or {}).get("modules") or {}
    sides = tuple(tuple(e.get("factors") or e["shape"]) for e in modules.values())
    return FactoredLayout(sides, int(manifest["row_rank"]))


def factored_rows(grads: GradsConfig, projector) -> FactoredRows | None:
    """What the indexer stores per module for `projector`'s rows: None (dense) or FactoredRows.
    UserError (exit code 2) naming grads.row_rank when it exceeds a module's min(k_o, k_i): U Vᵀ is
    already exact there. Warns when the factors take no less room than the dense blocks."""
    if grads.row_format != "factored":
        return None
    layout = projector_layout(projector, grads.row_rank)
    for name, (k_o, k_i) in zip(projector.shapes, layout.sides, strict=True):
        if grads.row_rank > min(k_o, k_i):
            raise UserError(f"grads.row_rank={grads.row_rank} exceeds min(k_o, k_i) = {min(k_o, k_i)} of {name}"
                            f" ({k_o} x {k_i}): its gradient has rank at most {min(k_o, k_i)}, so factors of that"
                            f" rank are already exact. Set grads.row_rank <= {min(min(s) for s in layout.sides)}.",
                            exit_code=2)
    if layout.width >= layout.dense_width:
        log.warning("grads.row_rank=%d: factored rows hold %d values, the dense blocks %d; grads.row_format=dense"
                    " is smaller and exact.", grads.row_rank, layout.width, layout.dense_width)
    return FactoredRows(grads.row_rank)


def _query_factors(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """block (Q, k_o, k_i) -> (Uq (Q r, k_o), Vq (Q r, k_i), r) with Uq Vqᵀ = each query's block to
    round-off; None when the dense form is cheaper (r (k_o + k_i) >= k_o k_i).

    A seeded randomized range finder, widened until it holds: U = an orthonormal basis of B Ω
    (Ω (k_i, r) Gaussian), V = Bᵀ U, accepted when |B - U Vᵀ|_F <= QUERY_RESIDUAL |B|_F for every
    query. Exact for a block of rank <= r (a query's rank is at most its positions), in about
    k_o k_i r multiply-adds per try instead of an SVD's k_o k_i min(k_o, k_i).
    """
    n_q, k_o, k_i = block.shape
    b = block.double()
    scale = b.flatten(1).norm(dim=1)  # (Q,)
    g = torch.Generator().manual_seed(0)
    r = 1
    while r * (k_o + k_i) < k_o * k_i:
        omega = torch.randn(k_i, min(r, k_i), generator=g, dtype=torch.float64).to(b.device)
        u, _ = torch.linalg.qr(b @ omega)  # (Q, k_o, r): orthonormal columns spanning B Ω
        v = b.mT @ u  # (Q, k_i, r)
        residual = (b - u @ v.mT).flatten(1).norm(dim=1)
        if bool((residual <= QUERY_RESIDUAL * scale).all()):
            r = u.shape[2]
            return u.mT.reshape(n_q * r, k_o).float(), v.mT.reshape(n_q * r, k_i).float(), r
        r *= 2
    return None


class FactoredScorer:
    """Σ_m ⟨q_m, U_m V_mᵀ⟩_F of Q dense query rows against factored index rows, per shard.

    `low_rank`: factor each query block once (`_query_factors`) and score a module by Gram
    products, (Uqᵀ U) ⊙ (Vqᵀ V) summed, where r (k_o + k_i) < k_o k_i; else, and for
    preconditioned queries (full rank: `low_rank=False`), Σ U ⊙ (q V).
    """

    def __init__(self, layout: FactoredLayout, queries: torch.Tensor, low_rank: bool = True) -> None:
        if queries.ndim != 2 or queries.shape[1] != layout.dense_width:
            raise ValueError(f"queries of shape {tuple(queries.shape)}; the factored layout's dense width is"
                             f" {layout.dense_width}.")
        self.layout, self.n_queries = layout, queries.shape[0]
        self.parts: list[tuple] = []  # per module: ("gram", Uq, Vq, r) or ("dense", q (Q k_o, k_i))
        start = 0
        for k_o, k_i in layout.sides:
            block = queries[:, start:start + k_o * k_i].reshape(-1, k_o, k_i)
            start += k_o * k_i
            factors = _query_factors(block) if low_rank else None
            self.parts.append(("gram", *factors) if factors is not None else
                              ("dense", block.float().reshape(-1, k_i)))
        inner = max(p[3] if p[0] == "gram" else p[1].shape[0] // self.n_queries for p in self.parts)
        self.chunk = max(1, CHUNK_ELEMENTS // (self.n_queries * inner * layout.rank))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, layout.width) float32 -> scores (Q, n) float32."""
        out = torch.empty(self.n_queries, rows.shape[0], dtype=torch.float32)
        for lo in range(0, rows.shape[0], self.chunk):
            out[:, lo:lo + self.chunk] = self._scores(rows[lo:lo + self.chunk].float())
        return out

    def _scores(self, rows: torch.Tensor) -> torch.Tensor:
        n, c, n_q = rows.shape[0], self.layout.rank, self.n_queries
        out = torch.zeros(n_q, n, dtype=torch.float32)
        for part, (u, v) in zip(self.parts, self.layout.split(rows), strict=True):
            k_o, k_i = u.shape[1], v.shape[1]
            u_t = u.permute(1, 0, 2).reshape(k_o, n * c)  # (k_o, n c): every row's columns side by side
            v_t = v.permute(1, 0, 2).reshape(k_i, n * c)
            if part[0] == "gram":
                _, uq, vq, r = part  # (Uqᵀ U) ⊙ (Vqᵀ V), summed over the r x c pairs
                out += ((uq @ u_t) * (vq @ v_t)).reshape(n_q, r, n, c).sum(dim=(1, 3))
            else:
                q = part[1]  # (Q k_o, k_i): Σ U ⊙ (q V)
                out += ((q @ v_t).reshape(n_q, k_o, n, c) * u_t.reshape(1, k_o, n, c)).sum(dim=(1, 3))
        return out


def rotated_squares(u: torch.Tensor, v: torch.Tensor, q_out: torch.Tensor, q_in: torch.Tensor) -> torch.Tensor:
    """Σ_rows (Q_outᵀ U Vᵀ Q_in)², (k_o, k_i) float64: the EK-FAC eigenvalue sums (`gradian.curvature.factors`)
    of factored rows U (n, k_o, c), V (n, k_i, c), rotated as factors and squared a chunk of rows at a time."""
    u_r, v_r = q_out.T @ u.double(), q_in.T @ v.double()  # (n, k_o, c), (n, k_i, c)
    k_o, k_i = u_r.shape[1], v_r.shape[1]
    total = torch.zeros(k_o, k_i, dtype=torch.float64)
    step = max(1, CHUNK_ELEMENTS // (k_o * k_i))
    for lo in range(0, u_r.shape[0], step):
        g = u_r[lo:lo + step] @ v_r[lo:lo + step].mT  # (chunk, k_o, k_i)
        total += (g * g).sum(dim=0)
    return total


@dataclass(frozen=True)
class FactoredFormat(RowFormat):
    """Rows of each module's [U | V] (module docstring), (n, layout.width) in the storage dtype; the norm of
    a row is |U Vᵀ|_F over its modules. Scored from the factors by cosine, dot, kfac and ekfac."""

    name = "factored"
    scores = ("cosine", "dot", "kfac", "ekfac")

    storage_dtype: str
    layout: FactoredLayout

    @classmethod
    def config_problem(cls, grads: GradsConfig) -> str | None:
        if grads.projection == "dense" and grads.projection_dim is not None:
            return ("grads.row_format=factored stores each module's projected gradient as factors of its (k_o, k_i)"
                    " matrix; grads.projection=dense projects vec(G) to a vector with no matrix left to factor. Set"
                    " grads.projection=kronecker_orthogonal (or kronecker, whitened), or grads.row_format=dense.")
        if grads.preconditioner in ("module", "module+kfac"):
            return (f"grads.row_format=factored with grads.preconditioner={grads.preconditioner}: the module"
                    " preconditioner stores each module's second moment of dense rows (k x k per shard) for"
                    " --score influence / whitened. Set grads.preconditioner=kfac (or none), or"
                    " grads.row_format=dense.")
        return None

    @classmethod
    def capture(cls, grads: GradsConfig, projector) -> FactoredRows:
        return factored_rows(grads, projector)

    @classmethod
    def computed_width(cls, grads: GradsConfig, projector) -> int:
        if grads.projection == "dense" and grads.projection_dim is not None:  # refused (`config_problem`)
            return projector.total_width
        return projector_layout(projector, grads.row_rank).width

    @classmethod
    def computed_text(cls, grads: GradsConfig) -> str:
        return f"rank-{grads.row_rank} factors"

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> FactoredFormat:
        return cls(manifest["storage_dtype"], layout_of(manifest))

    @classmethod
    def manifest_problems(cls, manifest: Mapping[str, Any], where: str) -> list[str]:
        rank = manifest.get("row_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            return [f"{where}: row_rank {rank!r} of factored rows is not an integer >= 1; rebuild the index"]
        if (manifest.get("projection") or {}).get("kind") == "dense":
            return [f"{where}: factored rows of a dense projection (no matrix to factor); rebuild the index"]
        return []

    @classmethod
    def describe(cls, summary: Mapping[str, Any]) -> tuple[str, str]:
        return (f"{summary.get('row_width')} ({summary.get('storage_dtype')})",
                f"factored, rank {summary.get('row_rank')}: U (k_o x c), V (k_i x c) per module, G ~ U Vᵀ")

    @property
    def width(self) -> int:
        return self.layout.width

    @property
    def query_width(self) -> int:
        return self.layout.dense_width  # the queries stay dense blocks

    def norms(self, stored: torch.Tensor) -> torch.Tensor:
        return self.layout.norms(stored)

    def projection_width(self, projector) -> tuple[int, str]:
        return projector_layout(projector, self.layout.rank).width, f" factored at rank {self.layout.rank}"

    def reader_refusal(self, index_dir: Path) -> str:
        return (f"{index_dir} stores factored rows (grads.row_format=factored, row_rank {self.layout.rank}: each"
                " module's U and V, not its dense block), which this reader cannot multiply as dense rows. Rank it"
                " with `gradian rank` (cosine, dot, kfac, ekfac), or rebuild it with grads.row_format=dense.")

    def score_refusal(self, index_dir: Path, score: str) -> str:
        return (f"{index_dir} stores factored rows (grads.row_format=factored), which hold no module second moments:"
                " --score influence or whitened needs a dense index built with grads.preconditioner=module. Rank"
                " with cosine, dot, kfac or ekfac.")

    def scorer(self, queries: torch.Tensor, *, cosine: bool, preconditioned: bool) -> Scorer:
        # Gram products with the exactly factored queries, or Σ U ⊙ (q̃ V) for the preconditioned (full-rank) ones.
        factored = FactoredScorer(self.layout, queries, low_rank=not preconditioned)

        def score(grads: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
            scores = factored(grads)  # (Q, n)
            return per_unit_norm(scores, norms) if cosine else scores

        return score

    def ekfac_squares(self, rows: torch.Tensor, shapes: list[tuple[int, int]], q_in: list[torch.Tensor],
                      q_out: list[torch.Tensor]) -> list[torch.Tensor]:
        return [rotated_squares(u, v, q_out[m], q_in[m]) for m, (u, v) in enumerate(self.layout.split(rows))]
