"""K-FAC and EK-FAC curvature in the Kronecker-projected space (`grads.preconditioner: kfac`).

For a linear module with Kronecker projection P_out (k_o, d_out), P_in (k_i, d_in), a stored
block is g = vec(Σ_t s_t a_tᵀ) (row-major, index o · k_i + i) with the projected activations
a_t = P_in x_t (k_i,) and output gradients s_t = P_out δ_t (k_o,) of every position t. While the
rows are computed the indexer sums, per shard and module, in float64 (saved as float32),

    kfac_in.m  = Σ_{rows, t} a_t a_tᵀ        (k_i, k_i)       over every non-padding position
    kfac_out.m = Σ_{rows, t} s_t s_tᵀ        (k_o, k_o)
    kfac_tokens = number of those positions  (1,) int64

Sums add, like the second moments (`gradian.curvature.moments`): any sharding, worker count or resume
gives the same total. K-FAC's Fisher of a module, with n rows and N positions in all,

    F ≈ S ⊗ A,   S = Σ s sᵀ / n  (per row: summed over its positions),   A = Σ a aᵀ / N,

so F's eigenbasis is Q_S ⊗ Q_A (S = Q_S diag(e_S) Q_Sᵀ, A = Q_A diag(e_A) Q_Aᵀ) with eigenvalues
Λ[o, i] = e_S[o] e_A[i]. EK-FAC (George et al. 2018, as Kronfluence) keeps the basis and replaces
Λ by the rows' own second moment in it, Λ*[o, i] = Σ_rows (Q_Sᵀ G_row Q_A)[o, i]² / n, with
G_row the (k_o, k_i) stored block. Λ* needs the final basis, so it is computed once the index is
complete, from the stored rows (one pass), and saved in ``curvature.safetensors`` (listed in
the manifest with its sha256; `gradian inspect --verify` recomputes it). Scores:

    kfac(q, g)  = Σ_m q_mᵀ (F_m + λ_m I)⁻¹ g_m,   F_m = (Q_S ⊗ Q_A) diag(Λ_m) (Q_S ⊗ Q_A)ᵀ
    ekfac(q, g) = the same with Λ*_m;             λ_m = damping · mean(Λ_m)   (damping 0.01)

Applied to the queries only, in the eigenbasis (two (k_o, k_i) rotations and a division per
query and module: no inverse, no k x k matrix); the rows are streamed as for `dot`, so ranking
costs what cosine costs. Disk: (k_i² + k_o²) float32 per module and shard, against k² for the
module second moments (width 4096 = 64 x 64: 32 KiB against 64 MiB per module and shard).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

CURVATURE_FILE = "curvature.safetensors"
TOKENS = "kfac_tokens"
KINDS = ("kfac", "ekfac")
# λ_m = CURVATURE_DAMPING x the mean eigenvalue, unless `gradian rank --damping` says otherwise. Chosen
# on the yardsticks (docs/benchmarks.md, "Damping"): 0.01 beats 0.1 at widths 1024 and 4096 on fact
# sets A and B and on LDS, ties on the SmolLM2 set; raw rows prefer 0.03-0.1 on B.
CURVATURE_DAMPING = 0.01
# Above this many rows or columns per factor the (k, k) factors are not small any more (raw rows of
# a large model: d_in² floats per module and shard).
MAX_FACTOR_WIDTH = 4096


# With grads.fisher=sampled: the shard's rows of the sampled labels (n, width) in the storage dtype,
# from which the EK-FAC eigenvalues are computed (the stored rows keep the data's labels).
FISHER_ROWS = "kfac_rows"


def factor_names(m: int) -> tuple[str, str]:
    return f"kfac_in.{m}", f"kfac_out.{m}"


def is_factor_tensor(name: str) -> bool:
    return name in (TOKENS, FISHER_ROWS) or name.startswith(("kfac_in.", "kfac_out."))


def has_kfac(preconditioner: str | None) -> bool:
    return preconditioner in ("kfac", "module+kfac")


def has_module(preconditioner: str | None) -> bool:
    return preconditioner in ("module", "module+kfac")


def check_kfac(kind: str, factors: dict[str, tuple[int, int]]) -> None:
    """K-FAC needs Kronecker rows (or raw ones) with factors of at most MAX_FACTOR_WIDTH a side.

    kind: the projector's kind; factors: name -> (k_o, k_i) (raw rows: (d_out, d_in)).
    """
    if kind == "dense":
        raise ValueError("grads.preconditioner=kfac (the default) needs the Kronecker structure of the rows: set"
                         " grads.projection=kronecker or kronecker_orthogonal, or grads.preconditioner=none (or"
                         " module) with grads.projection=dense.")
    wide = [(n, f) for n, f in factors.items() if max(f) > MAX_FACTOR_WIDTH]
    if wide:
        name, (k_o, k_i) = wide[0]
        raise ValueError(f"grads.preconditioner=kfac stores ({k_o}, {k_o}) and ({k_i}, {k_i}) factors for {name};"
                         f" a side above {MAX_FACTOR_WIDTH} is too large. Set grads.projection_dim (kronecker rows),"
                         " or grads.preconditioner=none for raw rows without curvature.")


class FactorSums:
    """Per-module Σ a aᵀ and Σ s sᵀ (float64) and the position count of one shard's batches.

    `batch_dtype`: the dtype of each batch's products before they are added to the float64 totals:
    float64 for the index's stored factors; the whitening's factor pass over raw (d, d) factors uses
    float32 on the CPU (`gradian.curvature.whitening.factor_pass`: one batch's few thousand positions lose
    nothing a damped curvature estimate keeps, at about half the time of a float64 product); on an
    accelerator every product is float64."""

    def __init__(self, names: list[str], batch_dtype: torch.dtype = torch.float64) -> None:
        self.names = list(names)
        self.a: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        self.tokens = 0
        self.batch_dtype = batch_dtype
        self.projected = True  # sums of projected activations (the index's); the raw factor pass sets False
        self._stacks: dict[tuple[str, ...], list] = {}  # `add_group`'s (M, k, k) totals per side, by module names

    def add(self, name: str, xp: torch.Tensor, dp: torch.Tensor) -> None:
        """xp (B, T, k_i), dp (B, T, k_o): the projected inputs and output gradients of one batch,
        zero at padding (padding adds nothing). Projected sums ((k, k), small) stay on xp's device
        (float64): nothing is copied to the host until `tensors`; raw (d, d) sums go to the host per batch.
        One in-place product-and-add per side and batch; the sums are made exactly symmetric once, when
        read (`symmetric`), not per batch."""
        # float64 where it is cheap (CUDA); batch_dtype on the CPU; MPS has no float64: float32 products
        # into float64 totals on the host
        kind = xp.device.type
        dtype = self.batch_dtype if kind == "cpu" else torch.float32 if kind == "mps" else torch.float64
        for sums, values in ((self.a, xp), (self.s, dp)):
            flat = values.reshape(-1, values.shape[-1]).to(dtype)  # (positions, k)
            total = sums.get(name)
            if total is None:
                # raw (d, d) sums of a whole model would crowd the device: on the host (MPS: always)
                device = flat.device if self.projected and kind != "mps" else torch.device("cpu")
                total = sums[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64, device=device)
            if flat.dtype == torch.float64 and total.device == flat.device:
                total.addmm_(flat.T, flat)
            else:
                total += (flat.T @ flat).to(total.device, torch.float64)

    def add_group(self, names: Sequence[str], xps: Sequence[torch.Tensor], dps: Sequence[torch.Tensor]) -> None:
        """`add` for several modules of one batch whose x_p share a shape and whose d_p share a shape
        (consecutive modules of a backward): on the device, in float64, each side is one stacked
        product-and-add (`baddbmm_`) into the group's stacked totals, of which each module's total is
        a view, instead of a product per module (the same sums to float64 rounding: a batched product
        may block its sums otherwise). Anything else (another dtype or device, a module already summed
        in another group) goes through `add` one module at a time."""
        kind = xps[0].device.type
        dtype = self.batch_dtype if kind == "cpu" else torch.float32 if kind == "mps" else torch.float64
        key = tuple(names)
        fresh = all(name not in self.a for name in names)
        if len(names) < 2 or not self.projected or dtype != torch.float64 or not (fresh or key in self._stacks):
            for name, xp, dp in zip(names, xps, dps, strict=True):
                self.add(name, xp, dp)
            return
        for side, (sums, values) in enumerate(((self.a, xps), (self.s, dps))):
            flat = torch.stack(values).reshape(len(values), -1, values[0].shape[-1]).to(dtype)  # (M, positions, k)
            if fresh:
                stack = torch.zeros(len(values), flat.shape[2], flat.shape[2], dtype=torch.float64, device=flat.device)
                self._stacks.setdefault(key, [None, None])[side] = stack
                for m, name in enumerate(names):
                    sums[name] = stack[m]
            self._stacks[key][side].baddbmm_(flat.transpose(1, 2), flat)

    def add_tokens(self, n: int) -> None:
        """Count `n` more positions (a host integer: the batch's non-padding tokens, known at collate time)."""
        self.tokens += int(n)

    def symmetric(self) -> None:
        """Make every sum exactly symmetric (a blocked matmul may sum (i, j) and (j, i) in another
        order): (X + Xᵀ) / 2 of the totals, which is the sum of the batches' symmetrised products."""
        for sums in (self.a, self.s):
            for name, total in sums.items():
                sums[name] = (total + total.T) / 2
        self._stacks.clear()  # the totals are new tensors now: a later add goes module by module

    def check_finite(self, what: str) -> None:
        """UserError (exit 1) naming the first module whose factor sums hold NaN or infinity, before
        any decomposition reads them (`what`: the projection whose factor pass made them). One host
        wait for every module's flag."""
        from circuitkit.core.errors import UserError
        from circuitkit.core.syncs import all_finite

        named = [(name, side, total) for side, sums in (("input (A)", self.a), ("output-gradient (S)", self.s))
                 for name, total in sums.items()]
        if not named:
            return
        flags = all_finite([total for _, _, total in named])
        bad = [(name, side) for (name, side, _), ok in zip(named, flags, strict=True) if not ok]
        if bad:
            name, side = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise UserError(f"{what}: the factor pass's {side} sum of module {name}{more} holds NaN or infinity, so"
                            " it has no eigen decomposition: the model's activations or gradients overflow there"
                            " (a damaged weight, or float16 out of range). Check the model's weights, index in"
                            " model.precision=float32 or bfloat16, or leave that module out (grads.module_filter).")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Shard tensors: kfac_in.m, kfac_out.m (float32) in module order m, and kfac_tokens (1,)."""
        missing = [n for n in self.names if n not in self.a]
        if missing:
            raise RuntimeError(f"no K-FAC factors were collected for modules {missing[:3]}.")
        self.symmetric()
        out = {TOKENS: torch.tensor([self.tokens], dtype=torch.int64)}
        for m, name in enumerate(self.names):
            key_in, key_out = factor_names(m)
            out[key_in], out[key_out] = self.a[name].float().cpu(), self.s[name].float().cpu()
        return out


def factor_shapes(manifest: dict[str, Any]) -> list[tuple[int, int]]:
    """(k_o, k_i) per module, in row order, from the manifest's projection (raw rows: the shape)."""
    modules = (manifest.get("projection") or {}).get("modules") or {}
    return [tuple(e.get("factors") or e["shape"]) for e in modules.values()]


def shard_factor_problems(name: str, tensors: dict[str, torch.Tensor], shapes: list[tuple[int, int]],
                          n_rows: int, fisher_rows: tuple[int, torch.dtype] | None = None) -> list[str]:
    """What is wrong with a shard's K-FAC tensors: presence, shapes, dtypes, symmetry, a
    non-negative diagonal, and at least one position per row. fisher_rows: (row width, storage
    dtype) when the index's fisher is "sampled" (the shard then holds `FISHER_ROWS`), else None."""
    problems = []
    rows_t = tensors.get(FISHER_ROWS)
    if fisher_rows is None and rows_t is not None:
        problems.append(f"{name} holds {FISHER_ROWS}, but the manifest's fisher is 'empirical'")
    elif fisher_rows is not None:
        want = ((n_rows, fisher_rows[0]), fisher_rows[1])
        if rows_t is None or (tuple(rows_t.shape), rows_t.dtype) != want:
            problems.append(f"{name} {FISHER_ROWS} is {None if rows_t is None else (rows_t.dtype, tuple(rows_t.shape))},"
                            f" expected {want[1]} {want[0]} (the manifest's fisher is 'sampled')")
        elif not torch.isfinite(rows_t).all():
            problems.append(f"{name} {FISHER_ROWS} is not finite")
    tokens = tensors.get(TOKENS)
    if tokens is None or tokens.dtype != torch.int64 or tokens.shape != (1,) or int(tokens[0]) < n_rows:
        problems.append(f"{name} kfac_tokens is {None if tokens is None else tokens.tolist()}, expected one int64"
                        f" count >= its {n_rows} rows")
    for m, (k_o, k_i) in enumerate(shapes):
        for key, k in zip(factor_names(m), (k_i, k_o), strict=True):
            t = tensors.get(key)
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != (k, k):
                problems.append(f"{name} {key} is {None if t is None else (t.dtype, tuple(t.shape))}, expected"
                                f" float32 ({k}, {k})")
            elif not torch.isfinite(t).all() or not torch.equal(t, t.T) or (torch.diagonal(t) < 0).any():
                problems.append(f"{name} {key} is not a sum of outer products (not finite, not symmetric or a"
                                " negative diagonal)")
    extra = sorted(k for k in tensors if is_factor_tensor(k) and k not in (TOKENS, FISHER_ROWS)
                   and int(k.rsplit(".", 1)[1]) >= len(shapes))
    if extra:
        problems.append(f"{name} holds K-FAC factors {extra[:3]} for modules the manifest does not list")
    return problems


