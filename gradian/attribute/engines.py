"""Scoring engines: every training row's influence on the regressed items, and which rows are accused.

An engine turns the Q query gradients (`gradian.attribute.queries`) into one aggregate query and
scores every stored row g with it, streaming the index's shards as `gradian rank` does:

    dot        s(g) = mean_i q_iᵀ g                              (curvature-free)
    cosine     s(g) = mean_i (q_i / |q_i|)ᵀ g / |g|              (|g| the stored norm)
    influence  s(g) = mean_i q_iᵀ (F + λI)⁻¹ g                   (the index's module second moments)
    kfac/ekfac s(g) = mean_i q_iᵀ (F + λI)⁻¹ g                   (the index's K-FAC / EK-FAC factors)
    tracin     s(g) = Σ_c η_c mean_i q_i(θ_c)ᵀ (F_c + λI)⁻¹ g(θ_c)  (TracIn over the fine-tune's checkpoints
                      c, one index each, `gradian.attribute.checkpoints`; tracin-dot with F_c + λI = I)
    datainf    s(g) = Σ_l v_lᵀ (G_l + λ_l I)⁻¹ g_l, v = mean_i q_i (DataInf's swapped-average inverse per
                      module, `gradian.attribute.datainf`: two passes over the shards transform v)

which, but for datainf, is `gradian rank`'s score with `--aggregate mean` (each preconditioner is applied to the
queries with `gradian rank`'s damping defaults; `auto` is `gradian rank --score auto`: ekfac where
the index holds K-FAC factors, else cosine). A test compares the top rows with `stream_topk`'s.

Sign convention. A training step on row z moves the parameters by -η (F + λI)⁻¹ g_z (plain
gradient descent for dot), which changes the query's function f (for the contrastive query
f = ℓ(correct) - ℓ(what the tuned model says)) by about -η s(g_z). So

    s > 0   training on the row lowered f: it helped the correct answer
    s < 0   training on the row raised f: it pushed the model off the correct answer -> accused

and the accused rows are the `top_k` rows of most negative score (a row with s >= 0 is never
accused). Memory: one shard in float32 plus one float32 score per row and engine (n_rows x E x
4 bytes), so that engines can be compared over every row (Spearman), not only their top rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from circuitkit.core.config import choices
from circuitkit.core.errors import UserError
from gradian.attribute import datainf
from gradian.curvature.factors import CURVATURE_DAMPING, has_kfac
from gradian.curvature.moments import DAMPING, Preconditioner
from gradian.index.curvature import KroneckerCurvature
from gradian.index.reader import IndexReader
from gradian.rank.ranking import default_score
from gradian.settings.attribute import AttributeConfig

# The schema's list (attribute.engines), but for "auto", which resolve_engines picks.
ENGINES = tuple(e for e in choices(AttributeConfig, "engines") if e != "auto")
# Of them, those scored across the fine-tune's checkpoints, one index each (`gradian.attribute.checkpoints`):
# they need --checkpoints (attribute.checkpoints).
TRACIN_ENGINES = ("tracin", "tracin-dot")
LOW_AGREEMENT = 0.5  # top-k overlap below this between engines: the accusation is low-confidence
_EPS = 1e-12


@dataclass
class Engine:
    """One engine: how it prepares query gradients, and the running sum of the prepared queries.

    Queries arrive in chunks (`add`), so that thousands of regressed items never hold more than one
    chunk of full-width gradients; `query` is their mean, the aggregate query that scores the rows,
    after `transform` where the engine has one (datainf: a query transform that reads the index).
    """

    name: str
    prepare: Callable[[torch.Tensor], torch.Tensor]  # (Q, width) -> (Q, width), preconditioned or unit
    unit_rows: bool  # cosine: each row's score is divided by its stored norm
    damping: float | None
    total: torch.Tensor | None = None
    count: int = 0
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # (width,) -> (width,), once per query
    note: str | None = None  # what the engine computed, where the index decides it (datainf: exact or projected)
    _query: torch.Tensor | None = None

    def add(self, queries: torch.Tensor) -> None:
        """Take (Q, width) query gradients into the aggregate."""
        prepared = self.prepare(queries.float()).sum(dim=0)
        self.total = prepared if self.total is None else self.total + prepared
        self.count += len(queries)
        self._query = None

    @property
    def query(self) -> torch.Tensor:
        """The aggregate query, (width,) float32: the mean of the prepared queries, transformed
        (computed once until the next `add`)."""
        if self.total is None:
            raise ValueError(f"engine {self.name}: no query gradient was added.")
        if self._query is None:
            mean = self.total / self.count
            self._query = mean if self.transform is None else self.transform(mean)
        return self._query


def resolve_engines(names: list[str], manifest: dict[str, Any]) -> list[str]:
    """The engine names asked (`auto` resolved for this index, duplicates dropped, order kept),
    checked against what the index holds: UserError (exit code 2) naming the fix otherwise."""
    out: list[str] = []
    for raw in names:
        name = default_score(manifest) if raw == "auto" else raw
        if name not in ENGINES:
            raise UserError(f"--engines: {raw!r} is not an engine; valid: auto, {', '.join(ENGINES)}"
                            " (comma-separated, the first one accuses).", exit_code=2)
        if name not in out:
            out.append(name)
    if not out:
        raise UserError("--engines names no engine; give e.g. --engines auto or --engines ekfac,dot.", exit_code=2)
    precond = manifest.get("preconditioner", "none")
    for name in out:
        if name == "datainf" and manifest.get("row_format", "dense") != "dense":
            raise UserError(f"--engines datainf: the index stores {manifest.get('row_format')} rows, and DataInf needs"
                            " each module's gradient values (dense rows); use dot or cosine, or rebuild the index"
                            " with grads.row_format=dense.", exit_code=2)
        if name in ("kfac", "ekfac") and not has_kfac(precond):
            raise UserError(f"--engines {name}: the index was built with grads.preconditioner={precond} and holds no"
                            " K-FAC factors; use dot or cosine, or rebuild the index with grads.preconditioner=kfac.",
                            exit_code=2)
        if name == "influence" and precond not in ("module", "module+kfac"):
            raise UserError(f"--engines influence: the index was built with grads.preconditioner={precond} and holds"
                            " no module second moments; use dot or cosine, or rebuild with"
                            " grads.preconditioner=module.", exit_code=2)
    return out


def build_engine(reader: IndexReader, name: str, queries: torch.Tensor | None = None) -> Engine:
    """The engine `name` for this index: each query preconditioned (or normalised, for cosine) as
    `gradian rank` does, the preconditioner read once. `queries` (Q, width) float32, when given,
    are added at once."""
    if name == "dot":
        engine = Engine(name, lambda q: q, False, None)
    elif name == "cosine":
        engine = Engine(name, lambda q: q / q.norm(dim=1, keepdim=True).clamp_min(_EPS), True, None)
    elif name == "influence":
        n_rows = sum(e["rows"][1] - e["rows"][0] for e in reader.manifest["shards"].values())
        pre = Preconditioner.from_sums(reader.second_moment_sums(), n_rows, DAMPING)
        engine = Engine(name, pre.precondition, False, DAMPING)
    elif name in ("kfac", "ekfac"):
        curvature = KroneckerCurvature.from_index(reader, name, CURVATURE_DAMPING)
        engine = Engine(name, curvature.precondition, False, CURVATURE_DAMPING)
    elif name == "datainf":
        widths = datainf.module_widths(reader.manifest)

        def rows():  # the sha256 is checked by the scoring pass (stream_scores)
            return (grads for _rows, grads, _norms in reader.shards(verify=False))

        engine = Engine(name, lambda q: q, False, datainf.DATAINF_DAMPING,
                        transform=lambda v: datainf.datainf_query(v, rows, widths)[0],
                        note=datainf.describe(reader.manifest))
    elif name in TRACIN_ENGINES:
        raise ValueError(f"engine {name!r} reads the checkpoints' indexes: gradian.attribute.checkpoints.tracin_scores.")
    else:
        raise ValueError(f"engine {name!r}; valid: {', '.join(ENGINES)}.")
    if queries is not None:
        engine.add(queries)
    return engine


def stream_scores(reader: IndexReader, engines: list[Engine], verify: bool = True, bar=None) -> torch.Tensor:
    """(E, n_rows) float32: every engine's score of every stored row (row id = column), one pass
    over the shards (each shard's sha256 checked as it is read when `verify`); `bar`
    (`circuitkit.core.progress.Progress`, optional) advances by each shard's rows."""
    n_rows = int(reader.manifest["n_rows"])
    queries = torch.stack([e.query for e in engines])  # (E, width)
    unit = torch.tensor([e.unit_rows for e in engines])
    out = torch.zeros(len(engines), n_rows, dtype=torch.float32)
    for rows, grads, norms in reader.shards(verify=verify):
        s = queries @ grads.T  # (E, n)
        s[unit] /= norms.float().clamp_min(_EPS)
        out[:, rows.long()] = s
        del grads
        if bar is not None:
            bar.advance(len(rows))
    return out


def most_negative(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Row ids of the k lowest scores, lowest first (ties: lower row id first)."""
    order = torch.sort(scores, stable=True).indices
    return order[: min(k, len(order))]


def accused_rows(scores: torch.Tensor, k: int) -> list[int]:
    """The accused rows: of the k lowest-scoring rows, those with a negative score, lowest first."""
    return [int(r) for r in most_negative(scores, k) if scores[r] < 0]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two score vectors (n,) (ties broken by position); nan for n < 2
    or a constant vector."""
    if len(a) < 2:
        return float("nan")
    ra = torch.empty(len(a), dtype=torch.float64)
    rb = torch.empty(len(b), dtype=torch.float64)
    ra[torch.sort(a, stable=True).indices] = torch.arange(len(a), dtype=torch.float64)
    rb[torch.sort(b, stable=True).indices] = torch.arange(len(b), dtype=torch.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float((ra @ rb) / denom) if denom > 0 else float("nan")


def agreement(names: list[str], scores: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """How each other engine agrees with the first (the one that accuses): Spearman over all rows
    and the overlap of their k most negative rows (share of k); below `LOW_AGREEMENT` it is flagged."""
    out = []
    k_eff = min(k, scores.shape[1])
    ours = set(most_negative(scores[0], k_eff).tolist())
    for e in range(1, len(names)):
        theirs = set(most_negative(scores[e], k_eff).tolist())
        overlap = len(ours & theirs) / max(1, k_eff)
        rho = spearman(scores[0], scores[e])
        out.append({"engine": names[e], "against": names[0], "spearman": None if math.isnan(rho) else rho,
                    "top_k_overlap": overlap, "k": k_eff, "low_confidence": overlap < LOW_AGREEMENT})
    return out
