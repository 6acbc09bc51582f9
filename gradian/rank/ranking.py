"""Rank training rows of a gradient index against query rows.

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

import json
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.batching import batch_overhead_tokens, plan_batches
from circuitkit.core.circuit_file import circuit_sha256
from circuitkit.core.config import ModelConfig
from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_write_bytes, check_writable
from circuitkit.core.recorded import read_recorded
from circuitkit.models.loading import context_length, load_model, weights_hash
from circuitkit.models.lora import AdapterError, read_adapter
from gradian.build.indexer import check_input_file, tokenizer_hash
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import site_shapes, sites_from_names
from gradian.curvature.allocation import check_allocation
from gradian.curvature.factors import CURVATURE_DAMPING, has_kfac
from gradian.curvature.moments import DAMPING, Preconditioner
from gradian.data.rows import _preview, collate, load_rows, policy_of, to_device
from gradian.data.sources import DataError, Source, SourceSpec
from gradian.index.curvature import KroneckerCurvature
from gradian.index.formats.factored import FactoredScorer, layout_of
from gradian.index.formats.signs import SignScorer, coordinates, is_signs
from gradian.index.store import IndexIntegrityError, IndexMismatchError, IndexReader
from gradian.projection.projector import STORED_KINDS, WHITENING_FILE, Projector, projection_fingerprint

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


def check_compatible(manifest: dict[str, Any], loaded, index_dir: str | Path | None = None) -> Projector:
    """Refuse a model that is not the one the index was built with; returns the index's Projector.

    Compares the weights sha256, the tokenizer hash, and the projection (kind, dim, seed,
    modules with their shapes) recomputed on `loaded.model` for the modules the manifest lists,
    and the sha256 of the matrices that projection generates with the manifest's
    `projection_sha256` (so an edited seed or kind cannot pass). `index_dir`: where a whitened
    projection's stored matrices and a spectrum allocation's ``allocation.json`` are read
    (`gradian.curvature.whitening`, `gradian.curvature.allocation`; required for the whitened kind).
    Raises IndexMismatchError naming every differing key; IndexIntegrityError (exit code 1) when a
    stored file is missing, linked outside the index or not the one the manifest records.
    """
    problems: list[str] = []
    ours = weights_hash(loaded.model)
    if ours != manifest.get("weights_sha256"):
        problems.append(f"weights_sha256: index has {str(manifest.get('weights_sha256'))[:12]}…, the loaded model"
                        f" {manifest.get('model')!r} ({manifest.get('precision')}) has {ours[:12]}…")
    ours = tokenizer_hash(loaded.tokenizer)
    if ours != manifest.get("tokenizer_sha256"):
        problems.append(f"tokenizer_sha256: index has {str(manifest.get('tokenizer_sha256'))[:12]}…, the loaded"
                        f" tokenizer has {ours[:12]}…")
    proj = manifest.get("projection")
    if not isinstance(proj, dict) or "modules" not in proj:
        raise IndexMismatchError(f"the index manifest has no projection description (got {proj!r}); it cannot"
                                 " be ranked against.")
    if index_dir is not None:
        check_allocation(index_dir, proj)  # allocation.json, through its sha256 (IndexIntegrityError)
    names = list(proj["modules"])
    projector = None
    try:  # names are modules, or "module:head{h}" sites of a circuit-restricted index
        sites = sites_from_names(loaded.model, loaded.adapter, names)
    except ValueError as err:
        problems.append(f"projection.modules: {err}")
    else:
        try:
            projector = Projector.from_description(site_shapes(sites), proj, index_dir)
        except IndexIntegrityError:  # the stored projection file is bad content, not a mismatch (exit code 1)
            raise
        except ValueError as err:
            problems.append(f"projection: {err}")
        else:
            mine = projector.describe()
            recorded = manifest.get("projection_sha256")
            if recorded is None:
                raise IndexMismatchError(
                    f"the index manifest has no projection_sha256 (format_version {manifest.get('format_version')},"
                    " from an older Gradian), so the projection its rows were made with cannot be checked;"
                    " rebuild it into a new grads.index_dir.")
            generated = projection_fingerprint(projector)
            if generated != recorded:
                problems.append(f"projection_sha256: the rows were projected with matrices of sha256 {str(recorded)[:12]}…,"
                                f" but the manifest's projection (kind {proj.get('kind')}, dim"
                                f" {proj.get('projection_dim')}, seed {proj.get('seed')}) generates {generated[:12]}…"
                                " (the manifest's projection settings were edited)")
            for key in ("kind", "projection_dim", "seed", "modules", "allocation"):
                if mine.get(key) != proj.get(key):
                    if key == "modules":
                        diff = [n for n in names if mine["modules"].get(n) != proj["modules"].get(n)]
                        problems.append(f"projection.modules: {', '.join(diff[:5])} differ (index has"
                                        f" {proj['modules'][diff[0]]}, the loaded model gives"
                                        f" {mine['modules'].get(diff[0])})")
                    else:
                        problems.append(f"projection.{key}: index has {proj.get(key)!r}, recomputed"
                                        f" {mine.get(key)!r}")
    if problems:
        model_differs = any(p.startswith(("weights_sha256", "tokenizer_sha256", "projection.modules"))
                            for p in problems)
        fix = ("Rank with the model the index was built with." if model_differs else
               "Restore the manifest's projection settings, or rebuild the index.")
        raise IndexMismatchError("the index was made with another model or projection than the one loaded: "
                                 + "; ".join(problems) + ". " + fix)
    return projector


# What decides an adapter's weights: a difference in any of them makes its gradients another model's.
ADAPTER_KEYS = ("weights_sha256", "r", "lora_alpha", "target_modules", "base_model_name_or_path")


def _adapter_line(record: dict[str, Any]) -> str:
    return (f"LoRA adapter {record.get('name')!r} ({record.get('path')}, weights sha256"
            f" {str(record.get('weights_sha256'))[:12]}…, r {record.get('r')})")


def compare_adapter(recorded: dict[str, Any] | None, ours: dict[str, Any] | None, what: str) -> None:
    """Refuse queries with another adapter than the index's (another file, none, or one where the
    index has none): IndexMismatchError naming both sides and each differing field. `ours`: the
    adapter record of the queries' model (`AdapterSpec.record`), None for none; `what` names it."""
    if recorded is None and ours is None:
        return
    if recorded is None:
        raise IndexMismatchError(f"{what} is {_adapter_line(ours)}, but the index was built on the model without an"
                                 " adapter: rank without one (--adapter none), or build an index with model.adapter set.")
    if ours is None:
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)} and {what} has no adapter: rank"
                                 " with that adapter (--adapter DIR, or leave --adapter out to use the index's).")
    diffs = []
    for key in ADAPTER_KEYS:
        if recorded.get(key) != ours.get(key):
            theirs, mine = recorded.get(key), ours.get(key)
            if key == "weights_sha256":
                theirs, mine = f"{str(theirs)[:12]}…", f"{str(mine)[:12]}…"
            diffs.append(f"{key}: index has {theirs}, {what} has {mine}")
    if diffs:
        changed = " (the adapter's weights changed since the index was built)" if (
            recorded.get("path") == ours.get("path") and len(diffs) == 1 and diffs[0].startswith("weights_sha256")) else ""
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)}, {what} is {ours.get('path')}"
                                 f"{changed}: {'; '.join(diffs)}. Rank with the adapter the index was built with, or"
                                 " rebuild the index with this one.")


def asked_adapter(manifest: dict[str, Any], adapter: str | None = "index") -> str | None:
    """The adapter directory the queries' model is loaded with, checked against the index's before
    anything loads: "index" = the one the manifest records (refused if it is gone or its weights
    changed), None = none, else that directory. IndexMismatchError naming the difference."""
    recorded = manifest.get("adapter")
    if adapter is None:
        compare_adapter(recorded, None, "--adapter none")
        return None
    where = "the index's adapter" if adapter == "index" else "--adapter"
    if adapter == "index":
        if recorded is None:
            return None
        adapter = str(recorded.get("path"))
    try:
        spec = read_adapter(adapter, where)
    except AdapterError as err:
        if where == "--adapter":
            raise
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)}, which cannot be read now ({err})"
                                 " Give its directory with --adapter DIR.") from None
    compare_adapter(recorded, spec.record(), where)
    return str(spec.directory)


def check_token_policy(manifest: dict[str, Any], append_eos: bool | None = None,
                       prepend_bos: bool | None | str = "index") -> None:
    """Refuse queries asked to be tokenized under another policy than the index's rows.

    `append_eos` None and `prepend_bos` "index" mean "as the index": the queries then follow the
    manifest's ``token_policy``. IndexMismatchError names both sides otherwise.
    """
    ours = policy_of(manifest)
    problems = []
    if append_eos is not None and append_eos != ours.append_eos:
        problems.append(f"append_eos: index has {str(ours.append_eos).lower()}, asked {str(append_eos).lower()}")
    if prepend_bos != "index" and prepend_bos != ours.prepend_bos:
        problems.append(f"prepend_bos: index has {ours.prepend_bos}, asked {prepend_bos}")
    if problems:
        raise IndexMismatchError("the queries would be tokenized under another token policy than the index's rows ("
                                 + "; ".join(problems) + "): their gradients would not be comparable. Leave the"
                                 " option out (queries follow the index's policy), or rebuild the index with"
                                 " grads.append_eos / grads.prepend_bos set as asked.")


def check_circuit(manifest: dict[str, Any], circuit: str | Path | None) -> None:
    """Refuse queries restricted to another circuit than the index's (or to one, against an
    unrestricted index); IndexMismatchError says which circuit each side has."""
    if circuit is None:
        return

    if not Path(circuit).is_file():
        raise FileNotFoundError(f"circuit {str(circuit)!r} does not exist.")
    ours, theirs = circuit_sha256(circuit), (manifest.get("circuit") or {}).get("sha256")
    if theirs is None:
        raise IndexMismatchError(f"the queries are restricted to circuit {circuit} (sha256 {ours[:12]}…) but the"
                                 " index is unrestricted (built with grads.circuit=null): rank without --circuit,"
                                 " or build the index with grads.circuit set to this file.")
    if ours != theirs:
        raise IndexMismatchError(f"the queries are restricted to circuit {circuit} (sha256 {ours[:12]}…) but the"
                                 f" index was built for another circuit (sha256 {theirs[:12]}…, heads"
                                 f" {manifest['circuit'].get('heads')}): rank with that circuit, or rebuild the index.")


# ----------------------------------------------------------------------------- queries


def query_gradients(manifest: dict[str, Any], loaded, projector: Projector, queries_path: str | Path,
                    batch_size: int = QUERY_BATCH_SIZE) -> tuple[torch.Tensor, list]:
    """Projected gradients of the query rows, as the index's rows were made.

    Returns (grads (Q, width) float32 on the CPU, the query Rows from gradian.data.rows.load_rows with
    the manifest's max_seq_length / truncation settings and token policy: a query's tokens are
    made exactly as a training row's, EOS / BOS and chat supervision included). Its activations
    run as the index's did (the manifest's `activations`; "model" for indexes made before 4).
    """
    queries_path = Path(queries_path)
    check_input_file(queries_path, "--queries")
    rows, report = load_rows(queries_path, loaded.tokenizer, manifest.get("max_seq_length", 512),
                             manifest.get("on_truncation", "warn"), manifest.get("truncation_side", "right"),
                             context_length=context_length(loaded.model.config), policy=policy_of(manifest))
    if not rows:
        raise ValueError(f"{queries_path}: no query row has a supervised token ({report.summary()}).")
    model, tokenizer = loaded.model, loaded.tokenizer
    modules = sites_from_names(model, loaded.adapter, projector.names)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lengths = [len(r.input_ids) for r in rows]
    out = torch.empty(len(rows), projector.total_width, dtype=torch.float32)
    budget = batch_size * max(lengths)
    for plan in plan_batches(lengths, batch_size, budget, overhead_tokens=batch_overhead_tokens(loaded.device)):
        batch = to_device(collate([rows[i] for i in plan], pad_id), loaded.device)
        out[plan] = per_example_gradients(model, loaded.adapter, modules, projector, batch,
                                          manifest.get("loss_reduction", "sum"),
                                          manifest.get("loss", "ce"),
                                          manifest.get("activations", "model")).row().float().cpu()
    return out, rows


# ----------------------------------------------------------------------------- output


def check_output_file(path: Path, what: str) -> None:
    """`path` can be written as a file (UserError, exit code 2, if not): checked before any work."""
    if path.is_dir():
        raise UserError(f"{what} {str(path)!r} is a directory; give a file name (e.g. {path / 'ranked.jsonl'}).",
                        exit_code=2)
    check_writable(path, what)  # written atomically (a new file renamed over it): the directory decides


def _positions(index_dir: Path, manifest: dict[str, Any], row_ids: set[int]) -> dict[int, int]:
    """row id -> its position in the training data (JSONL line, or table row index).

    From the shards' `sources` tensors; for indexes written before shards carried them, from
    the manifest's data_report.kept_lines, or rebuilt from the JSONL file (the kept rows are the
    non-blank lines minus the dropped ones, in file order).
    """
    found = IndexReader(index_dir).source_positions(sorted(row_ids))
    missing = row_ids - set(found)
    if not missing:
        return found
    report = manifest.get("data_report") or {}
    kept = report.get("kept_lines")
    if kept is None:
        source = training_source(manifest)
        if source is None or source.format != "jsonl":
            return found
        dropped = set(report.get("dropped_truncated_lines", [])) | set(report.get("dropped_unsupervised_lines", []))
        with open(source.name, encoding="utf-8-sig") as fh:
            kept = [n for n, line in enumerate(fh, start=1) if line.strip() and n not in dropped]
    found.update({r: kept[r] for r in missing if r < len(kept)})
    return found


def training_source(manifest: dict[str, Any]) -> Source | None:
    """The training data if it is still where the index says and unchanged (else no previews)."""
    described = manifest.get("data_source")
    try:
        if described:
            cols = described.get("columns") or {}
            rng = described.get("row_range")
            # data_file says where the data is now (a test or a user may point it elsewhere).
            spec = SourceSpec(path=manifest.get("data_file") or described["path"], format=described.get("format", "auto"),
                              split=described.get("split"), prompt_column=cols.get("prompt", "prompt"),
                              completion_column=cols.get("completion", "completion"),
                              messages_column=cols.get("messages", "messages"),
                              row_range=tuple(rng) if rng else None)
        elif manifest.get("data_file"):
            spec = SourceSpec(path=manifest["data_file"])
        else:
            return None
        source = Source(spec)
        if manifest.get("data_sha256") and source.fingerprint() != manifest["data_sha256"]:
            log.warning("training data %s changed since the index was built: previews are left empty.", spec.path)
            return None
        return source
    except (DataError, OSError) as err:
        log.warning("training data %s cannot be read any more (%s): previews are left empty.",
                    manifest.get("data_file"), err)
        return None


def _read_previews(source: Source, positions: Iterable[int]) -> dict[int, str]:
    """Preview text of the records at the given positions; reads the source once, in order, up
    to the last position asked."""
    wanted = set(positions)
    out: dict[int, str] = {}
    if not wanted:
        return out
    last = max(wanted)
    try:
        for position, _where, obj in source.records():
            if position in wanted and isinstance(obj, dict):
                if isinstance(obj.get("messages"), list):
                    text = " / ".join(f"{m.get('role')}: {m.get('content')}" for m in obj["messages"]
                                      if isinstance(m, dict))
                else:
                    text = f"{obj.get('prompt', '')}{obj.get('completion', '')}"
                out[position] = _preview(text)
            if position >= last:
                break
    except DataError as err:  # a record that does not parse any more: previews stop there
        log.warning("previews stop at %s", err)
    return out


def format_results(manifest: dict[str, Any], top: dict[str, torch.Tensor], query_ids: Sequence[Any],
                   index_dir: str | Path) -> list[dict[str, Any]]:
    """Result rows: per query then the aggregate, ranks 1..k, with source line and preview."""
    lists: list[tuple[Any, torch.Tensor, torch.Tensor]] = [
        (qid, top["query_rows"][i], top["query_scores"][i]) for i, qid in enumerate(query_ids)]
    lists.append(("aggregate", top["aggregate_rows"], top["aggregate_scores"]))
    positions = _positions(Path(index_dir), manifest, {int(r) for _, rows, _ in lists for r in rows})

    def line_of(row: int) -> int | None:
        return positions.get(row)

    source = training_source(manifest)
    previews = _read_previews(source, set(positions.values())) if source is not None else {}
    out = []
    for qid, rows, scores in lists:
        for position, (row, value) in enumerate(zip(rows.tolist(), scores.tolist(), strict=True), start=1):
            line = line_of(row)
            out.append({"query": qid, "rank": position, "row_id": row, "score": value, "source_line": line,
                        "text_preview": previews.get(line) if line is not None else None})
    return out


def default_score(manifest: dict[str, Any]) -> str:
    """What `score="auto"` ranks with: ekfac where the index holds K-FAC factors (the best score on
    most yardsticks, docs/benchmarks.md "Yardsticks"), else cosine."""
    return "ekfac" if has_kfac(manifest.get("preconditioner")) else "cosine"


def rank(index_dir: str | Path, queries_path: str | Path, top_k: int = 10, score: str = "auto",
         aggregate: str = "mean", out_path: str | Path | None = None,
         model_cfg: ModelConfig | None = None, loaded=None, verify: bool = True,
         circuit: str | Path | None = None, append_eos: bool | None = None,
         damping: float | None = None, adapter: str | None = "index") -> list[dict[str, Any]]:
    """Rank the index's training rows against the rows of `queries_path` (JSONL).

    Loads the model the manifest names (or `model_cfg`; or an already loaded `loaded`), refuses
    it if the weights, tokenizer or projection differ from the index's (IndexMismatchError naming
    the key), computes the query gradients, streams the index (`stream_topk`) and returns dicts
    {"query": query row id or "aggregate", "rank", "row_id", "score", "source_line",
    "text_preview"}, per query then the aggregate. Writes them as JSONL to `out_path` if given.
    `verify`: check every shard's sha256 as it is streamed (default; IndexIntegrityError on a
    mismatch). Everything that can fail without computing (arguments, the queries file, the
    manifest, where `out_path` goes) is checked before the model is loaded.

    `circuit`: the circuit.pt the queries are meant for. It must be the one a restricted index
    was built with (same sha256); against an unrestricted index it is refused. Without it,
    a restricted index's queries use the heads and MLPs its manifest records.

    `score`: cosine, dot, or (an index built with grads.preconditioner=module) influence or
    whitened, or (grads.preconditioner=kfac) kfac or ekfac, with `damping` (share of the mean
    eigenvalue, default 0.1 for influence / whitened, 0.01 for kfac / ekfac; `gradian.curvature.moments`,
    `gradian.curvature.factors`; refused with cosine / dot).
    "auto" (the default): ekfac on an index with K-FAC factors, else cosine (`default_score`).
    Query rows are tokenized with the index's token policy (manifest ``token_policy``);
    `append_eos`, when given, must be that policy's (IndexMismatchError otherwise).

    `adapter`: the LoRA adapter the queries' model carries: "index" (the default) = the one the
    manifest records, None = none, else a directory; with `model_cfg` its `adapter`, with `loaded`
    its record. Anything but the index's adapter (another file, none, or its file changed since) is
    refused before the model loads (IndexMismatchError naming the difference, `compare_adapter`).
    """
    _check_choice("score", score, ("auto", *SCORES))
    _check_choice("aggregate", aggregate, AGGREGATES)
    if top_k < 1:
        raise UserError(f"--top-k {top_k}: it must be >= 1.", exit_code=2)
    check_input_file(Path(queries_path), "--queries")
    if out_path is not None:
        check_output_file(Path(out_path), "--out")
    manifest = IndexReader(index_dir).manifest
    if score == "auto":
        score = default_score(manifest)
        if damping is not None and score not in CURVATURE_SCORES:
            raise UserError(f"--damping {damping}: {index_dir} holds no K-FAC factors (grads.preconditioner="
                            f"{manifest.get('preconditioner', 'none')}), so --score auto is cosine, which uses no"
                            f" damping. Drop --damping, or name a --score that uses it ({', '.join(CURVATURE_SCORES)}).",
                            exit_code=2)
    if not isinstance(manifest.get("model"), str):
        raise IndexIntegrityError(f"{Path(index_dir) / 'manifest.json'} names no model (model:"
                                  f" {manifest.get('model')!r}); rebuild the index with `gradian index`.")
    check_circuit(manifest, circuit)
    check_token_policy(manifest, append_eos)
    if damping is not None and score not in CURVATURE_SCORES:
        raise UserError(f"--damping {damping} with --score {score}: {score} uses no curvature, so there is nothing to"
                        f" damp. Drop --damping, or rank with --score {' / '.join(CURVATURE_SCORES)}.", exit_code=2)
    if damping is not None and not (math.isfinite(damping) and damping > 0):
        raise UserError(f"--damping {damping}: it must be a finite number > 0 (a share of each module's mean eigenvalue).",
                        exit_code=2)
    if is_signs(manifest) and score not in SIGN_SCORES:
        raise UserError(_signs_refusal(index_dir, score), exit_code=2)
    if score in PRECONDITIONED_SCORES and IndexReader(index_dir).second_moment_blocks is None:
        _preconditioner(IndexReader(index_dir), damping)  # raises, naming the fix, before the model loads
    if score in KRONECKER_SCORES:
        _kronecker_check(IndexReader(index_dir))
    proj = manifest.get("projection")
    if isinstance(proj, dict):  # the stored projection files, before the model loads (IndexIntegrityError)
        check_allocation(index_dir, proj)
        if proj.get("kind") in STORED_KINDS:
            read_recorded(Path(index_dir), proj.get("whitening"), WHITENING_FILE, "the whitened projection's matrices")
    if loaded is not None:
        compare_adapter(manifest.get("adapter"), getattr(loaded, "lora", None), "the loaded model's adapter")
        if getattr(loaded, "lora", None) and not getattr(loaded, "adapter_kept", False):
            raise IndexMismatchError("the loaded model has its LoRA adapter merged into its weights; Gradian's queries"
                                     " need its LoRA linears kept: load_model(cfg, keep_adapter=True).")
    elif model_cfg is not None:
        asked_adapter(manifest, model_cfg.adapter or None)
    else:
        model_cfg = ModelConfig(name=manifest["model"], revision=manifest.get("revision"),
                                gguf_file=manifest.get("gguf_file"), precision=manifest.get("precision", "bfloat16"),
                                adapter=asked_adapter(manifest, adapter))
    if loaded is None:
        loaded = load_model(model_cfg, keep_adapter=True)
    projector = check_compatible(manifest, loaded, index_dir)
    q_grads, q_rows = query_gradients(manifest, loaded, projector, queries_path)
    top = stream_topk(index_dir, q_grads, top_k, score, aggregate, verify=verify, damping=damping)
    results = format_results(manifest, top, [r.row_id for r in q_rows], index_dir)
    if out_path is not None:
        payload = "".join(json.dumps(r) + "\n" for r in results).encode()
        atomic_write_bytes(Path(out_path), payload)
    return results
