"""Scores of training rows against query rows, streamed over an index's shards.

A query row (same JSONL format as training rows) gets its projected per-example gradient
computed exactly as the index's rows were (same model weights, tokenizer, modules, projection
and loss reduction; anything else is refused, naming what differs). The index is then streamed
shard by shard: per shard the scores Q x n are computed and merged into a running top-k, so
memory is bounded by one shard plus Q x k, never by the index size.

Scores: ``dot`` = <g_query, g_row>; ``cosine`` = dot / (|g_query| |g_row|), using the norms
stored in the index (norms of the stored values, so the cosine is exactly that of what is on
disk). ``influence`` and ``whitened`` use the per-module second moments an index built with
``grads.preconditioner: module`` holds (`gradian.curvature.moments`): qᵀ A g, and that divided by
‖q‖_A ‖g‖_A. ``kfac`` and ``ekfac`` use the K-FAC factors an index built with
``grads.preconditioner: kfac`` holds (`gradian.curvature.factors`): qᵀ (F + λI)⁻¹ g with K-FAC's or
EK-FAC's F. An index of factored rows (``grads.row_format: factored``) is scored from its factors
(`gradian.index.formats.factored.FactoredScorer`) with the same dense queries; an index of sign rows (``signs``) by
n - 2 x the Hamming distance to the signed queries (`gradian.index.formats.signs`; cosine and dot only). ``aggregate`` turns the Q
per-query scores of a row into one (``mean`` or ``max``) and ranks the rows by it as well.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from gradian.curvature.factors import CURVATURE_DAMPING, has_kfac
from gradian.curvature.moments import DAMPING, Preconditioner
from gradian.index.curvature import KroneckerCurvature
from gradian.index.formats.factored import FactoredScorer, layout_of
from gradian.index.formats.signs import SignScorer, coordinates, is_signs
from gradian.index.store import IndexMismatchError, IndexReader

log = logging.getLogger(__name__)


SCORES = ("cosine", "dot", "influence", "whitened", "kfac", "ekfac")
SIGN_SCORES = ("cosine", "dot")  # what sign rows (gradian.index.formats.signs) can be scored by
PRECONDITIONED_SCORES = ("influence", "whitened")  # the module second moments (gradian.curvature.moments)
KRONECKER_SCORES = ("kfac", "ekfac")  # the K-FAC factors (gradian.curvature.factors)
CURVATURE_SCORES = PRECONDITIONED_SCORES + KRONECKER_SCORES
AGGREGATES = ("mean", "max")
QUERY_BATCH_SIZE = 8
# Norms below this count as zero: a zero gradient has no direction, its cosine is defined as 0.
_EPS = 1e-12


class _TopK:
    """Running top-k of P score lists over a stream of chunks: (P, k) values and row ids.

    Memory: O(P x (k + chunk)); each `push` keeps the best k of (previous best ∪ chunk).
    """

    def __init__(self, n_lists: int, k: int) -> None:
        self.k = k
        self.values = torch.empty(n_lists, 0, dtype=torch.float32)
        self.rows = torch.empty(n_lists, 0, dtype=torch.long)

    def push(self, scores: torch.Tensor, rows: torch.Tensor) -> None:
        """scores (P, n) float32 for the rows (n,) long."""
        values = torch.cat([self.values, scores], dim=1)
        ids = torch.cat([self.rows, rows.long().unsqueeze(0).expand(scores.shape[0], -1)], dim=1)
        # Sort by row id first, then a stable sort by score: ties are broken by the lower row id,
        # so the result does not depend on the shard layout.
        by_row = ids.argsort(dim=1, stable=True)
        values, ids = values.gather(1, by_row), ids.gather(1, by_row)
        order = values.argsort(dim=1, descending=True, stable=True)[:, : self.k]
        self.values, self.rows = values.gather(1, order), ids.gather(1, order)


def _check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r}; use one of {', '.join(valid)}.")


def stream_topk(index_dir: str | Path, query_grads: torch.Tensor, top_k: int = 10, score: str = "cosine",
                aggregate: str = "mean", verify: bool = True, damping: float | None = None) -> dict[str, torch.Tensor]:
    """Top-k training rows per query and for the aggregate, streaming the index's shards.

    query_grads: (Q, width) float32, projected query gradients (width = the index's row width; for
    factored rows, `gradian.index.formats.factored`, the dense width of the blocks the factors stand for).
    Returns ``query_scores`` (Q, k') float32 and ``query_rows`` (Q, k') long: per query, the best
    rows in descending score (ties: lower row id first); ``aggregate_scores`` (k',) and
    ``aggregate_rows`` (k',): rows ranked by the mean or max over queries of their scores;
    k' = min(top_k, rows in the index). Peak memory is about one shard in float32 plus Q x
    shard rows of scores, whatever the number of rows. `verify`: check each shard's sha256
    against the manifest as it is read (IndexIntegrityError on a mismatch). `damping`: λ_m as a
    share of module m's mean eigenvalue for the curvature scores (None: 0.1 for influence /
    whitened, 0.01 for kfac / ekfac); refused with
    cosine and dot, which use none.
    """
    _check_choice("score", score, SCORES)
    if damping is not None and score not in CURVATURE_SCORES:
        raise ValueError(f"damping={damping} with score {score!r}: only {', '.join(CURVATURE_SCORES)} use a damping.")
    _check_choice("aggregate", aggregate, AGGREGATES)
    if top_k < 1:
        raise ValueError(f"top_k={top_k}; it must be >= 1.")
    reader = IndexReader(index_dir)
    layout = layout_of(reader.manifest)  # factored rows (gradian.index.formats.factored): the queries stay dense blocks
    signs = is_signs(reader.manifest)  # sign rows (gradian.index.formats.signs): the queries are signed the same way
    if signs and score not in SIGN_SCORES:
        raise IndexMismatchError(_signs_refusal(reader.index_dir, score))
    width = (coordinates(reader.manifest) if signs else reader.manifest.get("row_width") if layout is None
             else layout.dense_width)
    q = query_grads.float()
    if q.ndim != 2 or q.shape[0] < 1:
        raise ValueError(f"query_grads must be (Q >= 1, width), got shape {tuple(q.shape)}.")
    if width is not None and q.shape[1] != width:
        raise IndexMismatchError(f"query gradients have width {q.shape[1]} but the index rows have width"
                                 f" {width}: they were not projected the same way.")
    if not reader.complete:
        log.warning("%s is incomplete (%s): ranking only the rows stored so far.", reader.index_dir,
                    "; ".join(reader.missing()) or "the manifest says so")
    precond = _preconditioner(reader, damping) if score in PRECONDITIONED_SCORES else None
    if score in KRONECKER_SCORES:
        _kronecker_check(reader)
        q = KroneckerCurvature.from_index(reader, score, CURVATURE_DAMPING if damping is None else damping).precondition(q)
    elif score == "influence":
        q = precond.precondition(q)  # (A q)ᵀ g = qᵀ A g: the rows need nothing more
    elif score == "whitened":
        q = precond.whiten(q)
    if score in ("cosine", "whitened"):
        # Unit query vectors: then cosine = (q̂ · g) / |g| per row, one matmul per shard.
        q = q / q.norm(dim=1, keepdim=True).clamp_min(_EPS)
    # Factored rows: Gram products with the exactly factored queries, or Σ U ⊙ (q̃ V) for the
    # preconditioned (full-rank) ones of kfac / ekfac.
    factored = None if layout is None else FactoredScorer(layout, q, low_rank=score not in KRONECKER_SCORES)
    signed = SignScorer(q) if signs else None  # n - 2 x Hamming distance; cosine divides by n (|q̂| = 1 above)
    per_query, combined = _TopK(q.shape[0], top_k), _TopK(1, top_k)
    for rows, grads, norms in reader.shards(verify=verify, factored=factored is not None, signs=signs):
        if score == "whitened":
            grads = precond.whiten(grads)
            norms = grads.norm(dim=1)
        if signed is not None:
            scores = signed(grads) / (signed.n if score == "cosine" else 1.0)
        else:
            scores = q @ grads.T if factored is None else factored(grads)  # (Q, n)
        if score in ("cosine", "whitened") and signed is None:
            scores /= norms.float().clamp_min(_EPS)
        per_query.push(scores, rows)
        agg = scores.mean(dim=0) if aggregate == "mean" else scores.amax(dim=0)
        combined.push(agg.unsqueeze(0), rows)
        del scores, grads  # release the shard before the next one is read
    return {"query_scores": per_query.values, "query_rows": per_query.rows,
            "aggregate_scores": combined.values[0], "aggregate_rows": combined.rows[0]}


def _signs_refusal(index_dir, score: str) -> str:
    return (f"--score {score} on {index_dir}: it stores sign rows (grads.row_format=signs, one bit per coordinate), which"
            f" carry no magnitudes for {score}. Rank it with --score cosine or dot (n - 2 x Hamming distance; with"
            " grads.projection=eigen or whitened the signs are already of K-FAC-preconditioned coordinates), or rebuild"
            " it with grads.row_format=dense.")


def _kronecker_check(reader: IndexReader) -> None:
    if not has_kfac(reader.manifest.get("preconditioner")):
        raise IndexMismatchError(f"{reader.index_dir} was built with grads.preconditioner="
                                 f"{reader.manifest.get('preconditioner', 'none')}: it holds no K-FAC factors for"
                                 " --score kfac or ekfac. Rank with another score, or rebuild the index with"
                                 " grads.preconditioner=kfac (or module+kfac).")


def _preconditioner(reader: IndexReader, damping: float | None):
    if layout_of(reader.manifest) is not None:
        raise IndexMismatchError(f"{reader.index_dir} stores factored rows (grads.row_format=factored), which hold no"
                                 " module second moments: --score influence or whitened needs a dense index built with"
                                 " grads.preconditioner=module. Rank with cosine, dot, kfac or ekfac.")
    if reader.second_moment_blocks is None:
        raise IndexMismatchError(f"{reader.index_dir} was built with grads.preconditioner="
                                 f"{reader.manifest.get('preconditioner', 'none')}: it holds no second moments for"
                                 " --score influence or whitened. Rank with cosine or dot, or rebuild the index with"
                                 " grads.preconditioner=module.")
    n_rows = sum(e["rows"][1] - e["rows"][0] for e in reader.manifest["shards"].values())
    return Preconditioner.from_sums(reader.second_moment_sums(), n_rows, DAMPING if damping is None else damping)


# ----------------------------------------------------------------------------- checks


