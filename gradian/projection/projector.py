"""How Gradian projects per-example weight gradients of linear modules (which modules: `grads.module_filter`,
`circuitkit.models.linear_modules`, or a circuit, `gradian.capture.sites`).

For a linear layer y = W x (+ b), W of shape (d_out, d_in), and one example with positions t,
the weight gradient of that example's loss L is

    G = dL/dW = Σ_t δ_t x_tᵀ                      (d_out, d_in),   δ_t = dL/dy_t, x_t the input.

Stored rows are a random projection of G, computed without ever forming G:

* ``kronecker``: P_out (k_o, d_out), P_in (k_i, d_in), seeded Rademacher entries ±1/sqrt(k);
  P_out G P_inᵀ = Σ_t (P_out δ_t)(P_in x_t)ᵀ  (k_o, k_i), flattened to k_o * k_i = projection_dim.
  E[P_outᵀ P_out] = I and E[P_inᵀ P_in] = I, so inner products between rows estimate inner
  products between the gradients (Johnson-Lindenstrauss in Kronecker form).
* ``kronecker_orthogonal``: the same contraction, but each factor has orthonormal rows: the Q of
  a seeded Gaussian's QR (signs fixed by R's diagonal, so it is unique), scaled by sqrt(d / k)
  so that E[Pᵀ P] = I still holds. Orthogonal rows never project two directions onto one, which
  lowers the variance of the inner-product estimate at the same width (docs/benchmarks.md).
* ``whitened``: ``kronecker_orthogonal``'s seeded factors applied after each module's damped
  K-FAC whitening, P_out (S + λ_S I)^-½ and P_in (A + λ_A I)^-½, with the full (unprojected)
  factors A = Σ x xᵀ / N and S = Σ δ δᵀ / n of the indexed corpus (`gradian.curvature.whitening`: a factor
  pass before any row is written). The composed (k_o, d_out) and (k_i, d_in) matrices depend on
  the data, so they are stored with the index (``projection.safetensors``, its sha256 in the
  manifest's projection entry) and read back from there by every worker, resume and query;
  the contraction is the same, so inner products of rows estimate the full K-FAC inner product.
* ``eigen``: ``kronecker_orthogonal``'s seeded factors rotated into the eigenbasis of the module's
  K-FAC factors as projected, Q_Sᵀ P_out and Q_Aᵀ P_in with P_out S P_outᵀ = Q_S diag(e_S) Q_Sᵀ and
  P_in A P_inᵀ = Q_A diag(e_A) Q_Aᵀ (the same factor pass; eigenvalues descending): a rotation of
  each block, so dense rows score exactly as ``kronecker_orthogonal``'s (every inner product is
  kept), and each stored coordinate is one direction of K-FAC's eigenbasis (Q_S ⊗ Q_A): what sign
  rows (`gradian.index.formats.signs`, EOGP-style) keep one bit of. Stored in the same file as ``whitened``'s
  matrices, as the rotations Q (k × k per side) only (`compose_rotations` applies them on load).
* ``dense``: one Gaussian matrix P (projection_dim, d_out * d_in) / sqrt(projection_dim) applied
  to vec(G); the fidelity reference (it needs G and a projection_dim × d_out·d_in matrix).
* ``projection_dim=None``: vec(G) itself, row-major in nn.Linear orientation (d_out, d_in).

Every module gets ``projection_dim`` columns (``grads.width_allocation: uniform``), or, with
``spectrum`` (`gradian.curvature.allocation`), its own width from a split of the same total
n_modules x projection_dim by each module's curvature spectrum: `Projector(widths=...)`, the
widths recorded per module in the manifest's projection entry with an ``allocation`` record.
A manifest without that record is uniform.

The random matrices depend only on (seed, module name, module shape, projection_dim), so two processes
(or two workers of a sharded index) build bit-identical matrices. They are drawn on the CPU
with a `torch.Generator` seeded from a sha256 of those facts, never from Python's `hash()`
(salted per process).

The projector is applied in two halves so the capture code can keep only projected
activations alive: `project_input` right after the forward (x -> P_in x), `project_output` in
the backward (δ -> P_out δ), then `combine` contracts over positions.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from circuitkit.core.config import choices
from circuitkit.core.recorded import REBUILD, IndexIntegrityError, read_recorded
from gradian.settings.grads import GradsConfig

log = logging.getLogger(__name__)

PROJECTION_KINDS = choices(GradsConfig, "projection")
KRONECKER_KINDS = ("kronecker", "kronecker_orthogonal", "whitened", "eigen")
# Kinds whose matrices depend on the data and are stored with the index (`gradian.curvature.whitening`).
STORED_KINDS = ("whitened", "eigen")
# The whitened projection's matrices, stored in the index directory (`gradian.curvature.whitening` writes it).
WHITENING_FILE = "projection.safetensors"
# Columns of the dense matrix generated per seeded chunk. A constant, so the matrix does not
# depend on how much memory a run has (chunks are regenerated when the matrix is not cached).
_DENSE_CHUNK_COLS = 4096
# Dense matrices up to this many bytes are kept after first use; larger ones are regenerated
# chunk by chunk on every call (slow but bounded memory; dense is a reference, not the default).
_DENSE_CACHE_BYTES = 256 * 2**20
# k_o / k_i beyond this ratio projects one side through very few directions: warn.
_MAX_FACTOR_RATIO = 16


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from sha256 of the parts' reprs: identical in every process and platform."""
    digest = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generator(*parts: object) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(stable_seed(*parts))
    return g


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    """All (a, b) with a * b == n."""
    out = []
    for a in range(1, math.isqrt(n) + 1):
        if n % a == 0:
            out.append((a, n // a))
            if a != n // a:
                out.append((n // a, a))
    return out


def _usable(n: int, d_out: int, d_in: int) -> tuple[int, int] | None:
    """The factor pair (k_o, k_i) of n with k_o <= d_out, k_i <= d_in closest to sqrt(n), or None.

    Closest means the smallest |log k_o - log k_i|; on a tie the larger factor goes to the
    larger dimension (it has more directions to keep).
    """
    pairs = [(a, b) for a, b in _factor_pairs(n) if a <= d_out and b <= d_in]
    if not pairs:
        return None
    return min(pairs, key=lambda ab: (abs(math.log(ab[0] / ab[1])), -(ab[0] if d_out >= d_in else ab[1])))


def balanced_width(n: int, d_out: int, d_in: int) -> bool:
    """Whether width n has a Kronecker factorisation k_o * k_i for a (d_out, d_in) module that
    `kronecker_factors` accepts without its imbalance warning."""
    pair = _usable(n, d_out, d_in)
    return pair is not None and max(pair) <= _MAX_FACTOR_RATIO * min(pair)


def _suggest(n: int, d_out: int, d_in: int, count: int = 3) -> list[int]:
    """Nearby projection dims with a balanced usable factorisation (squares and near-squares)."""
    limit = d_out * d_in
    found: list[int] = []
    for delta in range(0, n + limit):
        for cand in (n - delta, n + delta):
            if 1 <= cand <= limit and cand not in found and balanced_width(cand, d_out, d_in):
                found.append(cand)
        if len(found) >= count:
            break
    return sorted(found[:count])


@functools.lru_cache(maxsize=4096)
def kronecker_factors(projection_dim: int, d_out: int, d_in: int, name: str = "") -> tuple[int, int]:
    """(k_o, k_i) with k_o * k_i == projection_dim, k_o <= d_out, k_i <= d_in, closest to sqrt.

    Raises ValueError with suggested projection dims when no such pair exists; logs a warning
    when the only pairs are very unbalanced (e.g. a prime: 1 x p keeps one direction of δ).
    Memoised: the preflight's estimate and the index's Projector ask for the same modules, and
    a run computes (and warns about) each factorisation once.
    """
    pair = _usable(projection_dim, d_out, d_in)
    where = f" for module {name}" if name else ""
    if pair is None:
        hint = _suggest(projection_dim, d_out, d_in)
        raise ValueError(
            f"grads.projection_dim={projection_dim} has no factorisation k_out * k_in with k_out <= {d_out}"
            f" and k_in <= {d_in}{where} (kronecker projection of a ({d_out}, {d_in}) weight; at most"
            f" {d_out * d_in}). Try {', '.join(map(str, hint))}, grads.projection=dense, or"
            f" grads.projection_dim=null for raw gradients.")
    if max(pair) > _MAX_FACTOR_RATIO * min(pair):
        log.warning("grads.projection_dim=%d factors as %d x %d%s: very unbalanced, ranking fidelity"
                    " suffers; consider %s.", projection_dim, pair[0], pair[1], where,
                    ", ".join(map(str, _suggest(projection_dim, d_out, d_in))))
    return pair


class Projector:
    """Seeded random projections of per-example weight gradients, one per module.

    Parameters
    ----------
    shapes: name -> (d_out, d_in), in row order (the stored row is the modules' projections
        concatenated in this order).
    kind: "kronecker", "kronecker_orthogonal", "whitened" or "dense" (ignored when projection_dim is None).
    projection_dim: width per module; None stores raw gradients (width d_out * d_in).
    seed: projection seed (grads.projection_seed).
    widths, allocation: kronecker kinds only: name -> this module's own width (instead of
        projection_dim for every module; `gradian.curvature.allocation`), and the manifest's record of how
        they were chosen (``allocation``). None: uniform, projection_dim each.
    matrices, whitening: kind "whitened" only: name -> (P_out (k_o, d_out), P_in (k_i, d_in))
        float32, the stored whitened matrices, and their record in the manifest (file, sha256,
        damping). Without them a whitened projector knows its widths (memory estimates) but
        cannot project.

    Use: ``xp = project_input(name, x)`` with x (B, T, d_in), ``dp = project_output(name, δ)``
    with δ (B, T, d_out), then ``combine(name, xp, dp)`` -> (B, width(name)) float32.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, int]], kind: str = "kronecker",
                 projection_dim: int | None = None, seed: int = 0,
                 matrices: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 whitening: Mapping[str, object] | None = None, widths: Mapping[str, int] | None = None,
                 allocation: Mapping[str, object] | None = None) -> None:
        if kind not in PROJECTION_KINDS:
            raise ValueError(f"grads.projection={kind!r}; valid: {', '.join(PROJECTION_KINDS)}.")
        if projection_dim is not None and projection_dim < 1:
            raise ValueError(f"grads.projection_dim={projection_dim} must be >= 1 (or null for raw gradients).")
        self.shapes = {n: (int(o), int(i)) for n, (o, i) in shapes.items()}
        self.kind = kind if projection_dim is not None else "raw"
        self.projection_dim = projection_dim
        self.seed = seed
        self.widths: dict[str, int] | None = None
        self.allocation = dict(allocation) if allocation is not None else None
        if widths is not None:
            if self.kind not in KRONECKER_KINDS:
                raise ValueError(f"per-module widths (grads.width_allocation) need a kronecker projection, not {self.kind!r}.")
            missing = [n for n in self.shapes if n not in widths]
            if missing or any(int(widths[n]) < 1 for n in self.shapes):
                raise ValueError(f"per-module widths must give every module a width >= 1: missing {missing[:3]},"
                                 f" given {dict(widths)}.")
            self.widths = {n: int(widths[n]) for n in self.shapes}
            self.allocation = self.allocation or {"kind": "spectrum"}
        self.factors: dict[str, tuple[int, int]] = {}
        if self.kind in KRONECKER_KINDS:
            for name, (d_out, d_in) in self.shapes.items():
                self.factors[name] = kronecker_factors(self.module_dim(name), d_out, d_in, name)
        elif self.kind == "dense":
            for name, (d_out, d_in) in self.shapes.items():
                if projection_dim > d_out * d_in:
                    log.warning("grads.projection_dim=%d exceeds the %d weights of %s: the dense"
                                " projection adds no information.", projection_dim, d_out * d_in, name)
        self._cache: dict[tuple[str, str, str], torch.Tensor] = {}
        self._stacked: dict[tuple, torch.Tensor] = {}  # P_in of modules sharing an input, stacked (project_inputs)
        self.whitening = dict(whitening) if whitening is not None and self.kind in STORED_KINDS else None
        self._whitened: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.kind in STORED_KINDS and matrices is not None:
            for name, (d_out, d_in) in self.shapes.items():
                p_out, p_in = matrices[name]
                k_o, k_i = self.factors[name]
                if tuple(p_out.shape) != (k_o, d_out) or tuple(p_in.shape) != (k_i, d_in):
                    raise ValueError(f"{self.kind} projection of {name}: matrices {tuple(p_out.shape)} and"
                                     f" {tuple(p_in.shape)}, expected ({k_o}, {d_out}) and ({k_i}, {d_in}).")
                self._whitened[name] = (p_out.float().contiguous(), p_in.float().contiguous())

    def random_part(self) -> Projector:
        """A whitened projector's seeded orthogonal factors: the kronecker_orthogonal projector of the
        same shapes, dim and seed (the whitening is applied before it)."""
        return Projector(self.shapes, "kronecker_orthogonal", self.projection_dim, self.seed, widths=self.widths,
                         allocation=self.allocation)

    @classmethod
    def from_description(cls, shapes: Mapping[str, tuple[int, int]], described: Mapping,
                         index_dir: str | Path | None = None) -> Projector:
        """The projector an index manifest's `projection` entry (`describe()`) records, for `shapes`.

        `projection_dim` null is the one meaning of "raw": a projector without a dim describes
        itself as kind "raw" whatever kind it was given, so "raw" reads back as the default kind.
        A whitened projection's matrices are read from `index_dir` (ValueError when it is not
        given, or when the file is missing or not the one the record's sha256 names).
        """
        kind = described.get("kind")
        allocation = described.get("allocation")
        widths = None
        if allocation is not None:  # per-module widths (gradian.curvature.allocation); no record: uniform
            entries = described.get("modules")
            if not isinstance(allocation, Mapping) or not isinstance(entries, Mapping):
                raise ValueError("the projection's allocation record or its modules are not mappings.")
            widths = {n: (entries.get(n) or {}).get("width") for n in shapes}
            if any(not isinstance(w, int) or isinstance(w, bool) for w in widths.values()):
                raise ValueError(f"the projection's allocation needs an integer width per module, got {widths}.")
        if kind not in STORED_KINDS:
            return cls(shapes, "kronecker" if kind == "raw" else kind, described.get("projection_dim"),
                       described.get("seed", 0), widths=widths, allocation=allocation)
        record = described.get("whitening")
        if not isinstance(record, Mapping):
            raise ValueError("the whitened projection records no whitening entry (file, sha256, damping).")
        if index_dir is None:
            raise ValueError("a whitened projection's matrices are stored in its index directory; give index_dir.")
        matrices = load_whitened(Path(index_dir), record, list(shapes))
        if kind == "eigen":  # the file holds each module's rotations Q (k, k): P = Qᵀ times the seeded factors
            seeded = cls(shapes, "kronecker_orthogonal", described.get("projection_dim"), described.get("seed", 0),
                         widths=widths, allocation=allocation)
            matrices = {n: compose_rotations(q_out, q_in, *seeded.kronecker_matrices(n), n,
                                             described.get("projection_dim"))
                        for n, (q_out, q_in) in matrices.items()}
        return cls(shapes, kind, described.get("projection_dim"), described.get("seed", 0), matrices, record,
                   widths=widths, allocation=allocation)

    # -- widths -----------------------------------------------------------------------------
    def module_dim(self, name: str) -> int | None:
        """This module's projected width: its allocated width, else projection_dim (None: raw)."""
        return self.widths[name] if self.widths is not None else self.projection_dim

    def width(self, name: str) -> int:
        """Columns this module contributes to a row."""
        d_out, d_in = self.shapes[name]
        return d_out * d_in if self.projection_dim is None else self.module_dim(name)

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    @property
    def total_width(self) -> int:
        """Row width: Σ over modules of width(name) (n_modules x projection_dim when projected uniformly)."""
        return sum(self.width(n) for n in self.shapes)

    def describe(self) -> dict[str, object]:
        """Plain facts for a manifest: kind, dim, seed, per-module shapes and kronecker factors."""
        out = {"kind": self.kind, "projection_dim": self.projection_dim, "seed": self.seed,
               "modules": {n: {"shape": list(s), "width": self.width(n),
                               **({"factors": list(self.factors[n])} if n in self.factors else {})}
                           for n, s in self.shapes.items()}}
        if self.whitening is not None:
            out["whitening"] = dict(self.whitening)
        if self.allocation is not None:
            out["allocation"] = dict(self.allocation)
        return out

    # -- matrices ---------------------------------------------------------------------------
    def _rademacher(self, name: str, side: str, rows: int, cols: int) -> torch.Tensor:
        """(rows, cols) of ±1/sqrt(rows), float32 on the CPU, from (seed, name, shape, side)."""
        g = _generator("gradian-kronecker", self.seed, name, self.shapes[name], self.module_dim(name), side)
        signs = torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.int8)
        return (signs.float() * 2 - 1) / math.sqrt(rows)

    def _orthogonal(self, name: str, side: str, rows: int, cols: int) -> torch.Tensor:
        """(rows, cols), rows <= cols, orthonormal rows scaled by sqrt(cols / rows), float32 on the CPU.

        Q of the QR of a seeded (cols, rows) Gaussian, in float64, with Q's columns multiplied by
        the signs of R's diagonal: the QR is then unique, so every process gets the same matrix.
        """
        g = _generator("gradian-kronecker-orthogonal", self.seed, name, self.shapes[name], self.module_dim(name),
                       side)
        gauss = torch.randn((cols, rows), generator=g, dtype=torch.float64)
        q, r = torch.linalg.qr(gauss)  # q (cols, rows), orthonormal columns
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
        return (q.T * math.sqrt(cols / rows)).float()

    def kronecker_matrices(self, name: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """P_out (k_o, d_out) and P_in (k_i, d_in), float32 on `device` (cached per device)."""
        if self.kind not in KRONECKER_KINDS:
            raise ValueError(f"kronecker_matrices on a {self.kind} projector.")
        dev = str(torch.device(device))
        key_out, key_in = (name, "out", dev), (name, "in", dev)
        if key_out not in self._cache and self.kind in STORED_KINDS:
            if name not in self._whitened:
                raise ValueError(f"the {self.kind} projection of {name} has no matrices: they come from the index's"
                                 f" factor pass ({WHITENING_FILE} in the index directory).")
            self._cache[key_out], self._cache[key_in] = (m.to(dev) for m in self._whitened[name])
        if key_out not in self._cache:
            (d_out, d_in), (k_o, k_i) = self.shapes[name], self.factors[name]
            draw = self._rademacher if self.kind == "kronecker" else self._orthogonal
            self._cache[key_out] = draw(name, "out", k_o, d_out).to(dev)
            self._cache[key_in] = draw(name, "in", k_i, d_in).to(dev)
        return self._cache[key_out], self._cache[key_in]

    def _dense_chunk(self, name: str, chunk: int) -> torch.Tensor:
        """Columns [chunk*C, (chunk+1)*C) of the dense matrix, (projection_dim, <=C), CPU float32."""
        d_out, d_in = self.shapes[name]
        n = d_out * d_in
        lo, hi = chunk * _DENSE_CHUNK_COLS, min(n, (chunk + 1) * _DENSE_CHUNK_COLS)
        g = _generator("gradian-dense", self.seed, name, self.shapes[name], self.projection_dim, chunk)
        return torch.randn((self.projection_dim, hi - lo), generator=g) / math.sqrt(self.projection_dim)

    def dense_matrix(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The full (projection_dim, d_out * d_in) dense matrix (for tests; large for big modules)."""
        d_out, d_in = self.shapes[name]
        n_chunks = -(-d_out * d_in // _DENSE_CHUNK_COLS)
        return torch.cat([self._dense_chunk(name, c) for c in range(n_chunks)], 1).to(device)

    def _apply_dense(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """flat (B, d_out * d_in) -> flat @ Pᵀ (B, projection_dim), chunked over P's columns."""
        dev = str(flat.device)
        d_out, d_in = self.shapes[name]
        if self.projection_dim * d_out * d_in * 4 <= _DENSE_CACHE_BYTES:
            key = (name, "dense", dev)
            if key not in self._cache:
                self._cache[key] = self.dense_matrix(name, dev)
            return flat @ self._cache[key].T
        out = flat.new_zeros(flat.shape[0], self.projection_dim)
        n_chunks = -(-d_out * d_in // _DENSE_CHUNK_COLS)
        for c in range(n_chunks):
            lo = c * _DENSE_CHUNK_COLS
            p = self._dense_chunk(name, c).to(dev)
            out += flat[:, lo:lo + p.shape[1]] @ p.T
        return out

    # -- application ------------------------------------------------------------------------
    def project_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d_in) -> (B, T, k_i) = x P_inᵀ for kronecker kinds, else x itself; float32."""
        x = x.float()
        if self.kind in KRONECKER_KINDS:
            return x @ self.kronecker_matrices(name, x.device)[1].T
        return x

    def project_inputs(self, names: Sequence[str], x: torch.Tensor) -> list[torch.Tensor]:
        """`project_input` of several modules that read the same x (q, k and v; gate and up): one
        matmul with their P_in stacked (cached per device), each module's (B, T, k_i) a view of it."""
        if len(names) == 1 or self.kind not in KRONECKER_KINDS:
            return [self.project_input(name, x) for name in names]
        key = (tuple(names), "in-stacked", str(x.device))
        if key not in self._stacked:
            self._stacked[key] = torch.cat([self.kronecker_matrices(name, x.device)[1] for name in names]).T.contiguous()
        widths = [self.factors[name][1] for name in names]
        return list((x.float() @ self._stacked[key]).split(widths, dim=-1))

    def project_output(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """δ (B, T, d_out) -> (B, T, k_o) = δ P_outᵀ for kronecker kinds, else δ itself; float32."""
        delta = delta.float()
        if self.kind in KRONECKER_KINDS:
            return delta @ self.kronecker_matrices(name, delta.device)[0].T
        return delta

    def combine(self, name: str, xp: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
        """Σ_t dp_t xp_tᵀ per example, flattened row-major: (B, width(name)) float32.

        kronecker: Σ_t (P_out δ_t)(P_in x_t)ᵀ = P_out G P_inᵀ (k_o, k_i); G is never formed.
        dense: P vec(G); raw: vec(G), G = Σ_t δ_t x_tᵀ (d_out, d_in).
        """
        # (B, T, o) x (B, T, i) -> (B, o, i): a batched matmul over positions.
        g = torch.bmm(dp.transpose(1, 2), xp).flatten(1)
        if self.kind == "dense":
            return self._apply_dense(name, g)
        return g

    def project(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Both halves and the contraction: x (B, T, d_in), δ (B, T, d_out) -> (B, width(name))."""
        return self.combine(name, self.project_input(name, x), self.project_output(name, delta))

    def project_gradient(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Project already-formed gradients G (B, d_out, d_in) -> (B, width(name)) (tests, references)."""
        grad = grad.float()
        if self.kind in KRONECKER_KINDS:
            p_out, p_in = self.kronecker_matrices(name, grad.device)
            return (p_out @ grad @ p_in.T).flatten(1)
        if self.kind == "dense":
            return self._apply_dense(name, grad.flatten(1))
        return grad.flatten(1)


def projection_fingerprint(projector: Projector) -> str:
    """sha256 of the projection matrices `projector` generates (not of its settings).

    Two projectors that would project a gradient differently have different fingerprints,
    whatever the reason (seed, kind, dim, module shapes, or a torch whose generator draws
    other numbers). kronecker: every P_out and P_in, in module order. dense: the first column
    chunk of each module's matrix (the whole matrix can be gigabytes; every chunk comes from
    the same seeded generator, so the first one already differs when anything does). raw:
    no matrix; the module names and shapes.
    """
    h = hashlib.sha256(f"{projector.kind}:{projector.projection_dim}".encode())
    for name, shape in projector.shapes.items():
        h.update(f"|{name}:{shape}".encode())
        if projector.widths is not None:  # allocated widths (uniform indexes keep their old fingerprint)
            h.update(f":{projector.widths[name]}".encode())
        if projector.kind in KRONECKER_KINDS:
            mats = projector.kronecker_matrices(name)
        elif projector.kind == "dense":
            mats = (projector._dense_chunk(name, 0),)
        else:
            mats = ()
        for m in mats:
            h.update(m.contiguous().numpy().tobytes())
    return h.hexdigest()


def compose_rotations(q_out: torch.Tensor, q_in: torch.Tensor, p_out: torch.Tensor, p_in: torch.Tensor,
                      name: str, width: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eigen projection's matrices Q_outᵀ P_out (k_o, d_out) and Q_inᵀ P_in (k_i, d_in), float32 (computed
    in float64), from its stored rotations and the seeded orthogonal factors; IndexIntegrityError when
    the rotations do not fit the factors. The rotations' file was read with its recorded sha256, so a
    misfit means the manifest's width (`width`: its projection_dim) is not the one they were made for."""
    if q_out.shape != (p_out.shape[0],) * 2 or q_in.shape != (p_in.shape[0],) * 2:
        raise IndexIntegrityError(f"manifest.json: the projection width it records (projection_dim {width}: factors"
                                  f" {p_out.shape[0]} x {p_in.shape[0]} for {name}) does not match the recorded"
                                  f" projection in {WHITENING_FILE} (rotations {tuple(q_out.shape)} and"
                                  f" {tuple(q_in.shape)}, the bytes whose sha256 the manifest records): the manifest"
                                  f" was changed after the index was built; restore it, or {REBUILD}.")
    return ((q_out.double().T @ p_out.double()).float().contiguous(),
            (q_in.double().T @ p_in.double()).float().contiguous())


def load_whitened(index_dir: Path, record: Mapping, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (P_out, P_in) float32 of a whitened projection, from ``record["file"]`` in `index_dir`
    (``p_out.m``, ``p_in.m`` in module order m), read through `circuitkit.core.recorded.read_recorded` (inside
    the index directory, with the sha256 of ``record["sha256"]``). IndexIntegrityError (exit code 1)
    naming the file when it is missing, linked outside the index, changed or lacks a module."""
    from safetensors.torch import load

    data = read_recorded(Path(index_dir), record, WHITENING_FILE, "the whitened projection's matrices")
    try:
        tensors = load(data)
    except Exception as err:  # noqa: BLE001 - bytes of the recorded sha256 that safetensors cannot parse
        raise IndexIntegrityError(f"{Path(index_dir) / WHITENING_FILE} is not a safetensors file ({err});"
                                  f" {REBUILD}.") from None
    missing = [k for m in range(len(names)) for k in (f"p_out.{m}", f"p_in.{m}") if k not in tensors]
    if missing:
        raise IndexIntegrityError(f"{Path(index_dir) / WHITENING_FILE} holds no {missing[0]} ({len(names)} modules"
                                  f" expected); {REBUILD}.")
    return {n: (tensors[f"p_out.{m}"], tensors[f"p_in.{m}"]) for m, n in enumerate(names)}
