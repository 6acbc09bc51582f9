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
EK-FAC's F. The scores prepare the queries (preconditioned, unit rows for cosine); how they meet the
stored rows is the index's row format's (`gradian.index.formats`, `RowFormat.scorer`): dense rows by a
matmul, factored rows from their factors with the same dense queries, sign rows by n - 2 x the Hamming
distance to the signed queries (cosine and dot only: a format lists the scores it supports and says
why it refuses the others). ``aggregate`` turns the Q per-query scores of a row into one (``mean`` or
``max``) and ranks the rows by it as well.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from gradian.curvature.factors import CURVATURE_DAMPING, has_kfac
from gradian.curvature.moments import DAMPING, Preconditioner
from gradian.index.curvature import KroneckerCurvature
from gradian.index.formats.base import EPS, SCORES
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader

log = logging.getLogger(__name__)


PRECONDITIONED_SCORES = ("influence", "whitened")  # the module second moments (gradian.curvature.moments)
KRONECKER_SCORES = ("kfac", "ekfac")  # the K-FAC factors (gradian.curvature.factors)
CURVATURE_SCORES = PRECONDITIONED_SCORES + KRONECKER_SCORES
AGGREGATES = ("mean", "max")
QUERY_BATCH_SIZE = 8


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


def check_choice(name: str, value: str, valid: Sequence[str]) -> None:
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
    check_choice("score", score, SCORES)
    if damping is not None and score not in CURVATURE_SCORES:
        raise ValueError(f"damping={damping} with score {score!r}: only {', '.join(CURVATURE_SCORES)} use a damping.")
    check_choice("aggregate", aggregate, AGGREGATES)
    if top_k < 1:
        raise ValueError(f"top_k={top_k}; it must be >= 1.")
    reader = IndexReader(index_dir)
    fmt = reader.row_format  # how the rows are stored, and how queries meet them
    if score not in fmt.scores:
        raise IndexMismatchError(fmt.score_refusal(reader.index_dir, score))
    width = fmt.query_width
    q = query_grads.float()
    if q.ndim != 2 or q.shape[0] < 1:
        raise ValueError(f"query_grads must be (Q >= 1, width), got shape {tuple(q.shape)}.")
    if width is not None and q.shape[1] != width:
        raise IndexMismatchError(f"query gradients have width {q.shape[1]} but the index rows have width"
                                 f" {width}: they were not projected the same way.")
    if not reader.complete:
        log.warning("%s is incomplete (%s): ranking only the rows stored so far.", reader.index_dir,
                    "; ".join(reader.missing()) or "the manifest says so")
    precond = preconditioner_of(reader, damping) if score in PRECONDITIONED_SCORES else None
    if score in KRONECKER_SCORES:
        check_kronecker(reader)
        q = KroneckerCurvature.from_index(reader, score, CURVATURE_DAMPING if damping is None else damping).precondition(q)
    elif score == "influence":
        q = precond.precondition(q)  # (A q)ᵀ g = qᵀ A g: the rows need nothing more
    elif score == "whitened":
        q = precond.whiten(q)
    cosine = score in ("cosine", "whitened")
    if cosine:
        # Unit query vectors: then cosine = (q̂ · g) / |g| per row, one matmul per shard.
        q = q / q.norm(dim=1, keepdim=True).clamp_min(EPS)
    scorer = fmt.scorer(q, cosine=cosine, preconditioned=score in KRONECKER_SCORES)
    per_query, combined = _TopK(q.shape[0], top_k), _TopK(1, top_k)
    for rows, grads, norms in reader.shards(verify=verify, formats=(fmt.name,)):
        if score == "whitened":  # the rows whitened as the queries (dense rows: the format's only)
            grads = precond.whiten(grads)
            norms = grads.norm(dim=1)
        scores = scorer(grads, norms)  # (Q, n)
        per_query.push(scores, rows)
        agg = scores.mean(dim=0) if aggregate == "mean" else scores.amax(dim=0)
        combined.push(agg.unsqueeze(0), rows)
        del scores, grads  # release the shard before the next one is read
    return {"query_scores": per_query.values, "query_rows": per_query.rows,
            "aggregate_scores": combined.values[0], "aggregate_rows": combined.rows[0]}


def check_kronecker(reader: IndexReader) -> None:
    if not has_kfac(reader.manifest.get("preconditioner")):
        raise IndexMismatchError(f"{reader.index_dir} was built with grads.preconditioner="
                                 f"{reader.manifest.get('preconditioner', 'none')}: it holds no K-FAC factors for"
                                 " --score kfac or ekfac. Rank with another score, or rebuild the index with"
                                 " grads.preconditioner=kfac (or module+kfac).")


def preconditioner_of(reader: IndexReader, damping: float | None):
    if "influence" not in reader.row_format.scores:  # factored or sign rows hold no module second moments
        raise IndexMismatchError(reader.row_format.score_refusal(reader.index_dir, "influence"))
    if reader.second_moment_blocks is None:
        raise IndexMismatchError(f"{reader.index_dir} was built with grads.preconditioner="
                                 f"{reader.manifest.get('preconditioner', 'none')}: it holds no second moments for"
                                 " --score influence or whitened. Rank with cosine or dot, or rebuild the index with"
                                 " grads.preconditioner=module.")
    n_rows = sum(e["rows"][1] - e["rows"][0] for e in reader.manifest["shards"].values())
    return Preconditioner.from_sums(reader.second_moment_sums(), n_rows, DAMPING if damping is None else damping)


# ----------------------------------------------------------------------------- checks


