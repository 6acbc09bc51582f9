"""The whitened and eigen projections' factor pass (`grads.projection: whitened | eigen`, `gradian.projection.projector`).

``eigen`` uses the same pass and file: its matrices are the seeded orthogonal factors rotated into
the eigenbasis of the projected factors, Q_Sᵀ P_out and Q_Aᵀ P_in (`eigen_tensors`; only k × k
matrices are decomposed, no damping).

Before any row is written, one forward+backward over every row of the corpus sums, per selected
module (d_out, d_in), the full (unprojected) K-FAC factors on the supervised rows' positions,

    A = Σ_{rows, t} x_t x_tᵀ / N        (d_in, d_in),   N = non-padding positions
    S = Σ_{rows, t} δ_t δ_tᵀ / n        (d_out, d_out), n = rows

(float64, `gradian.curvature.factors.FactorSums` on the raw x and δ; with grads.fisher=sampled δ comes
from the sampled labels, as the index's own factors do). Each factor is whitened with its damped
inverse square root, W = Q (e + λ)^-½ Qᵀ, λ = WHITEN_DAMPING · mean(e) (e, Q: its eigenvalues and
eigenvectors; λ = 1 for an all-zero factor), and composed with the seeded kronecker_orthogonal
factors of the same seed:

    P_out^w = P_out W_S  (k_o, d_out),        P_in^w = P_in W_A  (k_i, d_in)         float32

so a row is still Σ_t (P_out^w δ_t)(P_in^w x_t)ᵀ, the per-example gradient never formed, and
inner products of rows estimate Σ_m tr(W_S G_q W_A² G_gᵀ W_S), the full damped K-FAC inner
product (by Johnson-Lindenstrauss). The matrices go to ``projection.safetensors`` in the index
directory (``p_out.m``, ``p_in.m`` in module order, with the settings that decide them as
metadata), recorded in the manifest's projection entry (file, sha256, bytes, damping).

Sharded workers share it: the first to take the lock ``.projection.lock`` (`circuitkit.core.io.file_lock`)
computes and writes it atomically; the others wait for the lock and read it. A file left by a
run with other settings (its metadata differ) is recomputed. The pass visits the rows in the
same order and batches in every worker (all rows, not the worker's shards), so a worker that has
to compute it gets the same bytes as any other on the same device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.io import atomic_save_safetensors, file_lock, sha256_file
from circuitkit.core.recorded import confined_path, read_recorded
from gradian.curvature.factors import FactorSums
from gradian.projection.projector import WHITENING_FILE, Projector

log = logging.getLogger(__name__)

# λ = WHITEN_DAMPING x the factor's mean eigenvalue, on each factor (S and A) separately: the
# damping scripts/experiments/exp_projection_basis.py measured (its √0.01 per factor, docs/benchmarks.md).
WHITEN_DAMPING = 0.1
LOCK = ".projection.lock"


def factor_pass(shapes: Mapping[str, tuple[int, int]], batches, run_batch: Callable,
                projected: Projector | None = None) -> FactorSums:
    """The full K-FAC factor sums of `shapes`' modules over `batches`, or with `projected` (a
    kronecker_orthogonal projector) the sums of its projected inputs and output gradients: (k, k)
    per module instead of (d, d), all the eigen projection needs (`eigen_tensors`).

    batches: iterable of (batch, row_ids); run_batch(projector, batch, row_ids, sums) captures one
    batch with that projector, its pairs fed to the factor sums alone (`gradian.curvature.consumers`:
    no row is formed).
    """
    probe = (Projector(shapes, "kronecker", None, 0) if projected is None else
             Projector(shapes, "kronecker_orthogonal", projected.projection_dim, projected.seed,
                       widths=projected.widths, allocation=projected.allocation))
    sums = FactorSums(list(shapes), batch_dtype=torch.float32)
    sums.projected = projected is not None  # (k, k) sums of projected activations, not (d, d)
    for batch, row_ids in batches:
        run_batch(probe, batch, row_ids, sums)
    # the sums stayed on the device during the pass; the decompositions that read them run on the host
    sums.symmetric()
    sums.a = {name: total.cpu() for name, total in sums.a.items()}
    sums.s = {name: total.cpu() for name, total in sums.s.items()}
    return sums


def whitener(factor_sum: torch.Tensor, count: int, damping: float = WHITEN_DAMPING) -> torch.Tensor:
    """(F + λ I)^-½ of F = factor_sum / count (float64, symmetric), λ = damping · mean eigenvalue."""
    e, q = torch.linalg.eigh(factor_sum.double() / max(count, 1))
    e = e.clamp_min(0)
    lam = damping * e.mean() if e.mean() > 0 else torch.ones((), dtype=torch.float64)
    return (q * (e + lam).rsqrt()) @ q.T


def whitened_tensors(projector: Projector, sums: FactorSums, n_rows: int,
                     damping: float = WHITEN_DAMPING) -> dict[str, torch.Tensor]:
    """``p_out.m`` = P_out W_S (k_o, d_out), ``p_in.m`` = P_in W_A (k_i, d_in) float32 per module m,
    P the seeded orthogonal factors of `projector` (kind whitened)."""
    if sums.projected:
        raise ValueError("the whitened projection needs the raw (d, d) factor sums, not projected ones.")
    sums.check_finite("grads.projection=whitened")
    random = projector.random_part()
    out = {}
    for m, name in enumerate(projector.names):
        p_out, p_in = random.kronecker_matrices(name)
        out[f"p_out.{m}"] = (p_out.double() @ whitener(sums.s[name], n_rows, damping)).float().contiguous()
        out[f"p_in.{m}"] = (p_in.double() @ whitener(sums.a[name], sums.tokens, damping)).float().contiguous()
    return out


def eigen_tensors(projector: Projector, sums: FactorSums, n_rows: int) -> dict[str, torch.Tensor]:
    """``p_out.m`` = Q_S (k_o, k_o), ``p_in.m`` = Q_A (k_i, k_i) float32 per module m (kind eigen): the
    eigenvectors of the projected K-FAC factors P_out S P_outᵀ and P_in A P_inᵀ (S = Σ δ δᵀ / n,
    A = Σ x xᵀ / N; P the seeded orthogonal factors of `projector`), largest eigenvalue first, as
    columns. The projection is Qᵀ P (`gradian.projection.projector.compose_rotations`, on load): only (k, k)
    matrices are decomposed and stored, k² floats per side instead of k · d."""
    sums.check_finite("grads.projection=eigen")
    random = projector.random_part()
    out = {}
    for m, name in enumerate(projector.names):
        p_out, p_in = (p.double() for p in random.kronecker_matrices(name))
        for key, p, total, count in (("p_out", p_out, sums.s[name], n_rows), ("p_in", p_in, sums.a[name], sums.tokens)):
            factor = total.double() / max(count, 1)
            # sums of the projected pass are P F Pᵀ already (k, k); the raw pass's (d, d) are projected here
            projected = factor if sums.projected else p @ factor @ p.T
            _, q = torch.linalg.eigh((projected + projected.T) / 2)
            out[f"{key}.{m}"] = q.flip(1).float().contiguous()
    return out


def shared_file(index_dir: Path, filename: str, settings: str, read_settings: Callable[[Path], str | None],
                write: Callable[[Path], None], recorded: Mapping | None, what: str) -> dict[str, Any]:
    """A data-dependent file every worker of an index shares (the whitened projection's matrices,
    `gradian.curvature.allocation`'s widths): under the index's projection lock, `filename` in `index_dir` is
    reused when `read_settings(path)` equals `settings` (the facts that decide it), else (re)made by
    `write(path)` (atomically). Returns its record: file, sha256, bytes.

    recorded: the record an existing manifest holds for it, if any; a file that does not match it is
    refused (IndexIntegrityError, exit code 1: `circuitkit.core.recorded.read_recorded`), never silently
    replaced. A file no manifest records, made with other settings (a run killed after the factor
    pass), is recomputed. A link out of the index directory is refused either way.
    """
    index_dir = Path(index_dir)
    index_dir.mkdir(parents=True, exist_ok=True)
    path = confined_path(index_dir, filename, what=f"the file of the {what}")
    with file_lock(index_dir / LOCK):
        if path.is_file() and recorded is not None:
            read_recorded(index_dir, recorded, filename, f"the {what}")
        if path.is_file():
            found = read_settings(path)
            if found == settings:
                log.info("reusing the %s %s", what, path)
            elif recorded is not None:  # the file of an index: never replaced under it
                raise ValueError(f"{path} holds the {what} of the index in {index_dir}, made with other settings"
                                 f" than this run's ({_settings_diff(found, settings)}); nothing was changed. Use"
                                 f" another grads.index_dir, or delete {index_dir} to rebuild it.")
            else:
                log.warning("%s was made with other settings and no manifest records it: recomputing it.", path)
                path.unlink()
        if not path.is_file():
            write(path)
            log.info("wrote the %s %s", what, path)
        return {"file": filename, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def _settings_diff(found: str | None, wanted: str) -> str:
    """The keys two settings records (JSON objects) differ in, with both values, cut short."""
    try:
        old, new = json.loads(found or "{}"), json.loads(wanted)
    except (TypeError, ValueError):
        return "unreadable settings"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "; ".join(f"{k}: {str(old.get(k))[:60]!s} there, {str(new.get(k))[:60]!s} now" for k in keys[:4]) or "none"


def whitened_projector(projector: Projector, index_dir: Path, settings: dict[str, Any],
                       compute: Callable[[], tuple[FactorSums, int]], recorded: Mapping | None = None) -> Projector:
    """The whitened projector of `projector`'s modules, dims and seed, with its matrices from
    ``projection.safetensors`` in `index_dir` when that file was made with `settings` (the facts
    that decide it: model weights, data, loss, modules, ...), else computed (`compute()` -> the
    factor sums and the row count) and written there, under the index's projection lock
    (`shared_file`).

    recorded: the whitening entry of an existing manifest's projection, if any; a file that does
    not match it is refused (ValueError), never silently replaced.
    """
    eigen = projector.kind == "eigen"
    meta = {"settings": json.dumps({**settings, **({"basis": "eigen"} if eigen else {"damping": WHITEN_DAMPING})},
                                   sort_keys=True)}

    def read_settings(path: Path) -> str | None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return (fh.metadata() or {}).get("settings")

    def write(path: Path) -> None:
        sums, n_rows = compute()
        tensors = eigen_tensors(projector, sums, n_rows) if eigen else whitened_tensors(projector, sums, n_rows)
        atomic_save_safetensors(path, tensors, meta)

    record = shared_file(index_dir, WHITENING_FILE, meta["settings"], read_settings, write, recorded,
                         f"{projector.kind} projection")
    return Projector.from_description(projector.shapes, {**projector.describe(),
                                                          "whitening": {**record, "damping": None if eigen
                                                                        else WHITEN_DAMPING}},
                                      index_dir)
