"""The index's curvature: the shards' K-FAC factor sums added, their eigenbases, EK-FAC's eigenvalues
from the stored rows (factored rows rotated as their factors), ``curvature.safetensors`` written,
checked and read, and the damped preconditioner (`KroneckerCurvature`) the scores apply to queries.

Above `gradian.index.manifest` and the row formats (`gradian.index.formats`), whose readers it consumes; the sums themselves
(`FactorSums`) and the maths of the factors are `gradian.curvature.factors`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from gradian.curvature.factors import CURVATURE_FILE, FISHER_ROWS, KINDS, TOKENS, factor_names, factor_shapes

log = logging.getLogger(__name__)


def _read_shard_factors(reader) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The shards' factor sums added in float64 (shards in name order), and the position count.
    reader: a `gradian.index.reader.IndexReader` (its `read_tensors` reads only the named tensors)."""
    n_mod = len(factor_shapes(reader.manifest))
    a_tot: list[torch.Tensor | None] = [None] * n_mod
    s_tot: list[torch.Tensor | None] = [None] * n_mod
    tokens = 0
    keys = [TOKENS] + [key for m in range(n_mod) for key in factor_names(m)]
    for name in sorted(reader.manifest["shards"]):
        t = reader.read_tensors(name, keys, "grads.preconditioner=kfac")
        tokens += int(t[TOKENS][0])
        for m in range(n_mod):
            key_in, key_out = factor_names(m)
            a, s = t[key_in].double(), t[key_out].double()
            a_tot[m] = a if a_tot[m] is None else a_tot[m] + a
            s_tot[m] = s if s_tot[m] is None else s_tot[m] + s
    return a_tot, s_tot, tokens


def _basis(a_sum: torch.Tensor, s_sum: torch.Tensor, n_rows: int, tokens: int):
    """Eigenbases and eigenvalues of A = Σ a aᵀ / N and S = Σ s sᵀ / n (float64; eigenvalues
    clamped at 0: the factors are positive semi-definite, roundoff is not)."""
    e_a, q_a = torch.linalg.eigh(a_sum / max(tokens, 1))
    e_s, q_s = torch.linalg.eigh(s_sum / max(n_rows, 1))
    return q_a, e_a.clamp_min(0), q_s, e_s.clamp_min(0)


def _fisher_rows(reader):
    """The sampled-label rows of each shard (float32), in row order (grads.fisher=sampled)."""
    for name in sorted(reader.manifest["shards"]):
        yield reader.read_tensors(name, [FISHER_ROWS], "grads.fisher=sampled")[FISHER_ROWS].float()


def ekfac_eigenvalues(reader, q_in: list[torch.Tensor], q_out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Λ*_m = Σ_rows (Q_outᵀ G Q_in)² / n per module (k_o, k_i) float64, from the stored rows, or,
    for an index with fisher "sampled", from the shards' rows of the sampled labels; each shard's part
    comes from the index's row format (`RowFormat.ekfac_squares`: dense blocks rotated, factored rows
    rotated as their factors, Q_outᵀ U and Q_inᵀ V)."""
    shapes, fmt = factor_shapes(reader.manifest), reader.row_format
    sums = [torch.zeros(k_o, k_i, dtype=torch.float64) for k_o, k_i in shapes]
    n = 0
    if reader.manifest.get("fisher", "empirical") == "sampled":
        blocks = _fisher_rows(reader)
    else:
        blocks = (grads for _rows, grads, _norms in reader.shards(verify=False, formats=(fmt.name,)))
    for grads in blocks:
        n += grads.shape[0]
        for m, part in enumerate(fmt.ekfac_squares(grads, shapes, q_in, q_out)):
            sums[m] += part
    return [s / max(n, 1) for s in sums]


def n_rows_of(manifest: dict[str, Any]) -> int:
    return sum(e["rows"][1] - e["rows"][0] for e in manifest["shards"].values())


def compute_curvature(reader) -> dict[str, torch.Tensor]:
    """The tensors of ``curvature.safetensors`` for an index: per module m the eigenbases
    ``q_in.m`` (k_i, k_i), ``q_out.m`` (k_o, k_o), K-FAC eigenvalues ``e_in.m``, ``e_out.m`` and the
    EK-FAC ones ``ekfac.m`` (k_o, k_i), float32; Λ* computed with the float32 bases as stored, so
    a verifier gets the same numbers; ``n_rows`` and ``kfac_tokens`` (1,) int64."""
    manifest = reader.manifest
    a_tot, s_tot, tokens = _read_shard_factors(reader)
    n_rows = n_rows_of(manifest)
    out: dict[str, torch.Tensor] = {"n_rows": torch.tensor([n_rows], dtype=torch.int64),
                                    TOKENS: torch.tensor([tokens], dtype=torch.int64)}
    q_in, q_out = [], []
    for m in range(len(a_tot)):
        qa, ea, qs, es = _basis(a_tot[m], s_tot[m], n_rows, tokens)
        out[f"q_in.{m}"], out[f"q_out.{m}"] = qa.float(), qs.float()
        out[f"e_in.{m}"], out[f"e_out.{m}"] = ea.float(), es.float()
        q_in.append(qa.float().double())
        q_out.append(qs.float().double())
    for m, lam in enumerate(ekfac_eigenvalues(reader, q_in, q_out)):
        out[f"ekfac.{m}"] = lam.float()
    return out


def shards_digest(manifest: dict[str, Any]) -> str:
    import hashlib

    items = sorted((n, e["sha256"]) for n, e in manifest["shards"].items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def current_record(index_dir: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's ``curvature`` entry if its file is there with that sha256 and it was made
    from the shards the manifest lists now; else None. A file linked outside the index directory
    is refused (IndexIntegrityError, `circuitkit.core.recorded.confined_path`)."""
    from circuitkit.core.io import sha256_file
    from circuitkit.core.recorded import confined_path

    record = manifest.get("curvature")
    path = confined_path(index_dir, CURVATURE_FILE, what="the file of the curvature")
    if (not isinstance(record, dict) or record.get("file") != CURVATURE_FILE or not path.is_file()
            or record.get("shards_sha256") != shards_digest(manifest) or sha256_file(path) != record.get("sha256")):
        return None
    return record


def verify_curvature(reader) -> list[str]:
    """`inspect --verify`'s checks of ``curvature.safetensors``: recorded, its sha256, made from the
    listed shards, bases orthonormal and diagonalising the shards' summed factors, and the EK-FAC
    eigenvalues recomputed from the stored rows."""
    from safetensors.torch import load_file

    manifest, index_dir = reader.manifest, reader.index_dir
    if not reader.complete:
        return []
    record = manifest.get("curvature")
    if record is None:
        return [f"no {CURVATURE_FILE} recorded although the index is complete and holds K-FAC factors: resume the"
                " index with the same command to write it"]
    from circuitkit.core.recorded import REBUILD, IndexIntegrityError

    try:
        current = current_record(index_dir, manifest)
    except IndexIntegrityError as err:  # linked outside the index directory
        return [str(err).split(f"; {REBUILD}")[0]]
    if current is None:
        return [f"{CURVATURE_FILE} is missing, changed after it was written, or was made from other shards than"
                " the manifest lists: resume the index with the same command to rewrite it"]
    try:
        stored = load_file(str(Path(index_dir) / CURVATURE_FILE))
    except Exception as err:  # noqa: BLE001 - any unreadable file is one problem line
        return [f"{CURVATURE_FILE} is not readable ({err})"]
    problems = []
    a_tot, s_tot, tokens = _read_shard_factors(reader)
    n_rows = n_rows_of(manifest)
    if int(stored["n_rows"][0]) != n_rows or int(stored[TOKENS][0]) != tokens:
        problems.append(f"{CURVATURE_FILE} counts {int(stored['n_rows'][0])} rows and {int(stored[TOKENS][0])}"
                        f" positions, the shards {n_rows} and {tokens}")
    q_in, q_out = [], []
    for m in range(len(a_tot)):
        for side, total, count in (("in", a_tot[m], tokens), ("out", s_tot[m], n_rows)):
            q, e = stored[f"q_{side}.{m}"].double(), stored[f"e_{side}.{m}"].double()
            k = q.shape[0]
            want = total / max(count, 1)
            scale = want.diagonal().abs().max().clamp_min(1e-30)
            if (not torch.allclose(q.T @ q, torch.eye(k, dtype=torch.float64), atol=1e-4)
                    or (q @ torch.diag(e) @ q.T - want).abs().max() > 1e-4 * scale):
                problems.append(f"{CURVATURE_FILE} q_{side}.{m} / e_{side}.{m} are not the eigendecomposition of the"
                                f" shards' summed kfac_{side}.{m}")
        q_in.append(stored[f"q_in.{m}"].double())
        q_out.append(stored[f"q_out.{m}"].double())
    if not problems:
        for m, lam in enumerate(ekfac_eigenvalues(reader, q_in, q_out)):
            if not torch.allclose(stored[f"ekfac.{m}"].double(), lam, rtol=1e-4, atol=1e-6 * lam.max().item()):
                problems.append(f"{CURVATURE_FILE} ekfac.{m} is not the stored rows' second moment in the K-FAC"
                                " eigenbasis")
    return problems


class KroneckerCurvature:
    """Damped K-FAC or EK-FAC preconditioner per module, in the eigenbasis Q_out ⊗ Q_in.

    `precondition(q)` returns (F + λI)⁻¹ q per block for query rows; nothing is inverted.
    """

    def __init__(self, shapes: list[tuple[int, int]], q_in: list[torch.Tensor], q_out: list[torch.Tensor],
                 eigenvalues: list[torch.Tensor], damping: float) -> None:
        if damping <= 0:
            raise ValueError(f"damping={damping}; it must be > 0 (a share of the mean eigenvalue).")
        self.shapes, self.q_in, self.q_out, self.damping = shapes, q_in, q_out, damping
        self.eigenvalues = eigenvalues
        means = [lam.mean() for lam in eigenvalues]
        self.lambdas = torch.stack([damping * mu if mu > 0 else torch.ones((), dtype=torch.float64) for mu in means])

    @classmethod
    def from_index(cls, reader, kind: str, damping: float) -> KroneckerCurvature:
        """From ``curvature.safetensors`` when it is current; else (an incomplete index, or one
        whose file is missing) computed now from the shards (EK-FAC: one extra pass over the rows)."""
        from safetensors.torch import load_file

        if kind not in KINDS:
            raise ValueError(f"curvature {kind!r}; valid: {', '.join(KINDS)}.")
        shapes = factor_shapes(reader.manifest)
        if current_record(reader.index_dir, reader.manifest) is not None:
            t = load_file(str(Path(reader.index_dir) / CURVATURE_FILE))
        else:
            if kind == "ekfac":
                log.warning("%s has no current %s: computing the EK-FAC eigenvalues now (one pass over the rows).",
                            reader.index_dir, CURVATURE_FILE)
            a_tot, s_tot, tokens = _read_shard_factors(reader)
            n_rows = n_rows_of(reader.manifest)
            t = {}
            for m in range(len(shapes)):
                qa, ea, qs, es = _basis(a_tot[m], s_tot[m], n_rows, tokens)
                t[f"q_in.{m}"], t[f"q_out.{m}"], t[f"e_in.{m}"], t[f"e_out.{m}"] = qa, qs, ea, es
            if kind == "ekfac":
                lams = ekfac_eigenvalues(reader, [t[f"q_in.{m}"] for m in range(len(shapes))],
                                         [t[f"q_out.{m}"] for m in range(len(shapes))])
                t.update({f"ekfac.{m}": lam for m, lam in enumerate(lams)})
        q_in = [t[f"q_in.{m}"].double() for m in range(len(shapes))]
        q_out = [t[f"q_out.{m}"].double() for m in range(len(shapes))]
        if kind == "kfac":
            eig = [torch.outer(t[f"e_out.{m}"].double(), t[f"e_in.{m}"].double()) for m in range(len(shapes))]
        else:
            eig = [t[f"ekfac.{m}"].double() for m in range(len(shapes))]
        return cls(shapes, q_in, q_out, eig, damping)

    def precondition(self, rows: torch.Tensor) -> torch.Tensor:
        """(F + λI)⁻¹ g per block, rows (n, Σ k) -> (n, Σ k) float32 (computed in float64)."""
        out = torch.empty(rows.shape, dtype=torch.float32)
        start = 0
        for m, (k_o, k_i) in enumerate(self.shapes):
            block = rows[:, start:start + k_o * k_i].double().reshape(-1, k_o, k_i)
            rotated = self.q_out[m].T @ block @ self.q_in[m]
            rotated = rotated / (self.eigenvalues[m] + self.lambdas[m])
            out[:, start:start + k_o * k_i] = (self.q_out[m] @ rotated @ self.q_in[m].T).reshape(-1, k_o * k_i).float()
            start += k_o * k_i
        if start != rows.shape[1]:
            raise ValueError(f"rows have width {rows.shape[1]}, the curvature's blocks {start}.")
        return out
