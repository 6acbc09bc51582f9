"""Build a gradient index: rows -> per-example projected gradients -> shards on disk.

Same code for the pipeline's `grads` stage and `gradian index`, same `grads.*` keys. The
index header records everything that decides the stored values (model and weights hash,
tokenizer hash, modules and shapes, projection, storage dtype, loss reduction, data hash,
truncation settings), so a resumed or parallel run refuses an index made differently.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from circuitkit.core.batching import batch_overhead_tokens, plan_batches, rows_within_budget
from circuitkit.core.device import resolve_precision
from circuitkit.core.errors import UserError
from circuitkit.core.io import (
    atomic_save_safetensors,
    atomic_write_json,
    file_lock,
    sha256_file,
)
from circuitkit.core.progress import Progress
from circuitkit.core.recorded import MANIFEST, IndexIntegrityError, read_recorded
from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.loading import context_length, load_model, weights_hash
from gradian.build.checks import check_data_source, check_grads_config, check_shard_buffer, tokenizer_hash
from gradian.build.device_batch import device_batch
from gradian.build.memory import curvature_sides, estimate_grads
from gradian.build.shard_rows import ShardJob, ShardPipeline, ShardRows
from gradian.capture.consumers import RowsConsumer, SampledFisherConsumer
from gradian.capture.gradients import (
    Capture,
    LossSettings,
    SampledLabels,
    activation_mode,
    activation_numerics,
    capture_batch,
)
from gradian.capture.sites import restricted_sites, site_shapes
from gradian.curvature.allocation import allocated_projector, check_allocation
from gradian.curvature.consumers import FactorSumsConsumer
from gradian.curvature.factors import CURVATURE_FILE, FactorSums, check_kfac, has_kfac, has_module
from gradian.curvature.whitening import WHITEN_DAMPING, factor_pass, whitened_projector
from gradian.data.batch import collate, to_device
from gradian.data.corpus import TokenizedCorpus
from gradian.data.rows import TokenPolicy
from gradian.data.sources import Source, SourceSpec
from gradian.index.curvature import compute_curvature, current_record, shards_digest
from gradian.index.formats import format_for, format_of
from gradian.index.header import IndexHeader, header_json
from gradian.index.manifest import IndexMismatchError, read_manifest
from gradian.index.reader import IndexReader
from gradian.index.writer import IndexWriter
from gradian.projection.projector import STORED_KINDS, WHITENING_FILE, Projector, projection_fingerprint
from gradian.settings.grads import GradsConfig

log = logging.getLogger(__name__)
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "data" / "samples" / "sample_train.jsonl"


def finalize_curvature(index_dir: Path) -> Path | None:
    """Write ``curvature.safetensors`` (`gradian.curvature.factors`: eigenbases of the summed K-FAC factors
    and the EK-FAC eigenvalues of the stored rows) for a complete index whose shards hold K-FAC
    factors, and record it in the manifest (``curvature``: file, sha256, bytes and a digest of the
    shards' sha256 it was made from). Idempotent: a recorded file that is present and current is
    kept. Returns the path, or None while the index is not complete (the worker that completes
    it, or a resume, writes it). Two workers finishing together write the same bytes."""
    index_dir = Path(index_dir)
    reader = IndexReader(index_dir)
    if not reader.complete or not has_kfac(reader.manifest.get("preconditioner")):
        return None
    if current_record(index_dir, reader.manifest) is not None:
        return index_dir / CURVATURE_FILE
    tensors = compute_curvature(reader)
    path = atomic_save_safetensors(index_dir / CURVATURE_FILE, tensors)
    record = {"file": CURVATURE_FILE, "sha256": sha256_file(path), "bytes": path.stat().st_size,
              "shards_sha256": shards_digest(reader.manifest)}
    with file_lock(index_dir / ".manifest.lock"):
        manifest = read_manifest(index_dir)
        manifest["curvature"] = record
        atomic_write_json(index_dir / MANIFEST, manifest)
    log.info("wrote %s (EK-FAC eigenvalues of %d rows)", path, int(tensors["n_rows"][0]))
    return path


def _factor_pass(grads: GradsConfig, loaded, modules, corpus: TokenizedCorpus, activations: str, pad_id: int,
                 overhead: int, shapes: dict[str, tuple[int, int]], projected: Projector | None = None):
    """compute() -> (the full K-FAC factor sums of the rows `factor_row_ids` picks, their count): one
    factor pass (`gradian.curvature.whitening.factor_pass`, in row order, the rows' batch plan), run at most once
    however many data-dependent choices (the width allocation, the whitened projection) ask for it."""
    done: list = []
    ids = factor_row_ids(corpus.n_rows, grads.factor_rows)

    def batches():
        for first in range(0, len(ids), grads.rows_per_shard):
            chunk = ids[first:first + grads.rows_per_shard]
            rows = ([r for i in chunk for r in corpus.rows(i, i + 1)] if len(ids) < corpus.n_rows
                    else corpus.rows(chunk[0], chunk[-1] + 1))
            lengths = [len(r.input_ids) for r in rows]
            for plan in plan_batches(lengths, grads.batch_size, grads.batch_tokens, grads.group_by_length, overhead):
                batch = to_device(collate([rows[i] for i in plan], pad_id), loaded.device)
                yield batch, [chunk[i] for i in plan]

    def run_batch(projector, batch, row_ids, sums) -> None:
        consumer = FactorSumsConsumer(sums, recorded_fisher(grads))  # of the labels the index's K-FAC factors are of
        capture_batch(loaded.model, loaded.adapter, modules, projector, batch, [consumer],
                      LossSettings(grads.loss_reduction, grads.loss, activations),
                      SampledLabels(row_ids, grads.projection_seed))

    def compute():
        if not done:
            log.info("factor pass over %d of the %d rows", len(ids), corpus.n_rows)
            done.append(factor_pass(shapes, batches(), run_batch, projected))
        return done[0], len(ids)

    return compute


def factor_row_ids(n_rows: int, factor_rows: int | None) -> list[int]:
    """The rows the factor pass reads (grads.factor_rows): every row, or an evenly spaced sample of
    at most `factor_rows`, every ceil(n_rows / factor_rows)-th row from the first (no randomness: the
    same rows in every worker and rerun)."""
    if factor_rows is None or factor_rows >= n_rows:
        return list(range(n_rows))
    return list(range(0, n_rows, -(-n_rows // factor_rows)))


def _data_dependent(shapes: dict[str, tuple[int, int]], grads: GradsConfig, index_dir: Path, compute,
                    activations: str, fisher: str, facts: dict[str, Any]) -> Projector:
    """The spectrum allocation's widths (`gradian.curvature.allocation`), then the whitened matrices
    (`gradian.curvature.whitening`): each read from the index directory when a worker or an earlier run wrote
    it with the same settings, else computed from the factor pass and written there."""
    recorded = (read_manifest(Path(index_dir)).get("projection") or {}) if (Path(index_dir) / MANIFEST).is_file() else {}
    base = {**facts, "loss": grads.loss, "loss_reduction": grads.loss_reduction, "fisher": fisher,
            "activations": activation_numerics(activations),
            **({} if grads.factor_rows is None else {"factor_rows": grads.factor_rows})}
    try:
        if grads.width_allocation == "spectrum":
            projector = allocated_projector(shapes, grads.projection, grads.projection_dim, grads.projection_seed,
                                            index_dir, base, compute, recorded.get("allocation"))
        else:
            projector = Projector(shapes, grads.projection, grads.projection_dim, grads.projection_seed)
        if projector.kind in STORED_KINDS:
            projector = whitened_projector(projector, index_dir, {**base, "projection": projector.describe()}, compute,
                                           recorded.get("whitening"))
    except IndexIntegrityError:  # a stored file that is not the recorded one: bad content (exit code 1)
        raise
    except ValueError as err:
        raise ResumeMismatchError(str(err)) from None
    return projector


def _check_kfac_widths(projector: Projector, grads: GradsConfig) -> None:
    """With a K-FAC preconditioner, every module's factor sides must fit `check_kfac`'s limits."""
    if has_kfac(grads.preconditioner):
        check_kfac(projector.kind, {n: projector.factors.get(n, s) for n, s in projector.shapes.items()})


def recorded_fisher(grads: GradsConfig) -> str:
    """What the header records of grads.fisher: as asked with K-FAC factors, else "empirical"
    (no curvature depends on it)."""
    return grads.fisher if has_kfac(grads.preconditioner) else "empirical"


def recorded_rank(grads: GradsConfig) -> int | None:
    """What the header records of grads.row_rank: the rank of factored rows, None for dense ones."""
    return grads.row_rank if grads.row_format == "factored" else None


class ResumeMismatchError(UserError, IndexMismatchError):
    """The config asks for other settings than the index it would resume was made with (exit 2:
    the config is wrong, nothing was written)."""

    exit_code = 2


def check_resume_settings(manifest: dict[str, Any], grads: GradsConfig, index_dir: Path) -> None:
    """Refuse to resume an index whose manifest records other grads settings than asked, for the
    settings known before the model loads (ResumeMismatchError, an IndexMismatchError, exit code 2,
    naming each, as IndexWriter would); then one whose stored projection files (``allocation.json``,
    ``projection.safetensors``) are missing, linked outside the index or changed since the manifest
    recorded them (IndexIntegrityError, exit code 1: bad content, not a wrong config)."""
    asked = {"preconditioner": grads.preconditioner, "loss": grads.loss, "loss_reduction": grads.loss_reduction,
             "storage_dtype": grads.storage_dtype, "rows_per_shard": grads.rows_per_shard,
             "fisher": recorded_fisher(grads), "row_format": grads.row_format, "row_rank": recorded_rank(grads)}
    diffs = [f"{k}: index has {manifest.get(k)!r}, asked {v!r}" for k, v in asked.items()
             if k in manifest and manifest[k] != v]
    recorded = manifest.get("projection")
    if isinstance(recorded, dict):  # the projection's kind, width and seed (its matrices: once the model is loaded)
        kind = "raw" if grads.projection_dim is None else grads.projection
        for key, name, value in (("kind", "projection", kind), ("projection_dim", "projection_dim", grads.projection_dim),
                                 ("seed", "projection_seed", grads.projection_seed)):
            if key in recorded and recorded[key] != value and not (key == "seed" and kind == "raw"):
                diffs.append(f"{name}: index has {recorded[key]!r}, asked {value!r}")
        allocation = recorded.get("allocation")
        had = allocation.get("kind", "uniform") if isinstance(allocation, dict) else "uniform"
        if had != grads.width_allocation:
            diffs.append(f"width_allocation: index has {had!r}, asked {grads.width_allocation!r}")
        whitening = recorded.get("whitening")
        if kind == "whitened" and isinstance(whitening, dict) and whitening.get("damping") != WHITEN_DAMPING:
            diffs.append(f"whitening damping: index has {whitening.get('damping')!r}, this Gradian uses"
                         f" {WHITEN_DAMPING!r}")
    if diffs:
        raise ResumeMismatchError(f"{index_dir} holds an index made differently: {'; '.join(diffs)}. Use another"
                                  " grads.index_dir, or delete this one to rebuild it.")
    if isinstance(recorded, dict):  # the files the projection was made from, through their sha256
        check_allocation(Path(index_dir), recorded)
        if recorded.get("kind") in STORED_KINDS:
            read_recorded(Path(index_dir), recorded.get("whitening"), WHITENING_FILE, "the whitened projection")


@dataclass(frozen=True)
class _BatchCapture:
    """What every batch of an index run is computed with (`index_batch`): the run's open capture
    (its model, sites and projector; hooks and checks once per run) and the settings of the rows."""

    session: Capture
    grads: GradsConfig
    fisher: str
    factored: Any
    pad_id: int


def index_batch(capture: _BatchCapture, rows: list, plan: list[int], first_row: int, factors: FactorSums | None,
                buffer: ShardRows) -> int:
    """One batch of the index loop: collate on the host, copy, capture, store into the shard's buffer.

    The capture's consumers: the rows; with K-FAC the shard's factor sums, and with grads.fisher=sampled
    the sampled labels' rows (stored beside the rows, for the EK-FAC eigenvalues).
    Nothing here waits for the device (the hot path: tests/gradian/build/test_blocking_calls.py counts it): the
    batch's bookkeeping is collated on the host, the rows leave the device in their stored form
    without a wait (`gradian.build.shard_rows`), the factor sums stay on the device. Returns the batch's
    computed (padded) tokens."""
    grads, session = capture.grads, capture.session
    batch = to_device(collate(rows, capture.pad_id), session.device)
    names, projector = session.names, session.projector
    stored = RowsConsumer(projector, names, capture.factored)
    consumers = [stored]
    sampled = None
    if factors is not None:
        consumers.append(FactorSumsConsumer(factors, capture.fisher))
        if capture.fisher == "sampled":
            sampled = SampledFisherConsumer(projector, names, capture.factored)
            consumers.append(sampled)
    session.batch(batch, consumers, SampledLabels([first_row + i for i in plan], grads.projection_seed))
    buffer.add(plan, stored.row(), None if sampled is None else sampled.row())
    return batch["input_ids"].numel()


def token_policy(grads: GradsConfig) -> TokenPolicy:
    """The BOS / EOS policy the grads keys ask for (`gradian.data.rows.TokenPolicy`)."""
    return TokenPolicy(append_eos=grads.append_eos, prepend_bos=grads.prepend_bos)


class _Throughput:
    """Rows/s, tokens/s and the padding share of the work done so far, for the progress bar."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows = self.real_tokens = self.computed_tokens = 0
        self.shapes: set[tuple[int, int, int]] = set()  # (rows, padded length, most targets of a row) formed

    def add(self, rows: int, real_tokens: int, computed_tokens: int, most_targets: int = 0) -> None:
        self.rows += rows
        self.real_tokens += real_tokens
        self.computed_tokens += computed_tokens
        self.shapes.add((rows, computed_tokens // max(rows, 1), most_targets))

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def text(self) -> str:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        return (f"{self.rows / wall:.1f} rows/s, {self.real_tokens / wall:.0f} tok/s,"
                f" padding {100 * self.padding_share:.1f}%")


def _precision_line(asked: str, used: str, device) -> str:
    """The summary's precision line: the dtype the rows are made in (the manifest's `precision`) and why."""
    try:
        resolved = resolve_precision(asked, device)
    except ValueError:
        resolved = None
    why = (resolved.note if resolved is not None and resolved.used == used
           else f"the loaded model's dtype (model.precision={asked})")
    return f"precision {used}: {why}"


def build_index(model_cfg: ModelConfig, grads: GradsConfig, index_dir: Path, console: Console | None = None,
                loaded=None, circuit_path: str | Path | None = None) -> dict[str, Any]:
    """Index `grads.data_path` into `index_dir` (this worker's shards); returns the index summary.

    Rows are read from the source a record at a time and kept tokenized on disk
    (`TokenizedCorpus`); each shard's rows are batched by length under the token budget
    (`plan_batches`) and stored in row order. `loaded`: an already loaded model
    (circuitkit.models.loading.LoadedModel), else loaded here; with `model.adapter` its LoRA linears
    are kept (`load_model(..., keep_adapter=True)`) and the manifest records the adapter.
    `circuit_path`: the circuit.pt that `grads.circuit` names (the pipeline resolves 'run' to
    its own circuit.pt); when given, only the circuit's kept heads and MLPs are indexed
    (`gradian.capture.sites`) and the manifest records the circuit.
    """
    console = console or Console(stderr=True)
    if grads.data_path is None:
        data_path = str(SAMPLE_DATA)
        log.warning("grads.data_path is null: indexing the shipped sample %s (24 hand-written rows, for trying"
                    " the pipeline); set grads.data_path to your data.", SAMPLE_DATA.name)
    else:
        data_path = str(grads.data_path)
    # Before the model loads: nothing is worth loading for a run that cannot read or write.
    check_grads_config(model_cfg, grads, index_dir)
    check_data_source(grads, data_path)
    if (Path(index_dir) / MANIFEST).is_file():
        # A damaged or tampered index to resume is refused first, and so is one made with other
        # settings that the config alone decides (the rest is compared once the model is loaded).
        check_resume_settings(read_manifest(Path(index_dir)), grads, Path(index_dir))
    source = Source(SourceSpec.from_grads(grads, data_path))
    loaded = loaded or load_model(model_cfg, keep_adapter=True)
    if getattr(model_cfg, "adapter", None) and not getattr(loaded, "adapter_kept", False):
        raise ValueError("model.adapter is set but the model given to build_index has no LoRA linears (merged, or"
                         " loaded without it): load it with load_model(cfg, keep_adapter=True).")
    tokenizer = loaded.tokenizer
    with console.status(f"reading and tokenizing {source.name}") as status:
        # The loaded model's own config decides the bound (check_grads_config may not have seen one offline).
        corpus = TokenizedCorpus.scan(source, tokenizer, grads.max_seq_length, grads.on_truncation,
                                      grads.truncation_side, context_length=context_length(loaded.model.config),
                                      policy=token_policy(grads),
                                      progress=lambda n: status.update(f"tokenizing {source.name}: {n} rows read"))
    with corpus:
        return _index_corpus(model_cfg, grads, Path(index_dir), console, loaded, source, corpus, circuit_path)


def _index_corpus(model_cfg: ModelConfig, grads: GradsConfig, index_dir: Path, console: Console, loaded,
                  source: Source, corpus: TokenizedCorpus, circuit_path: str | Path | None) -> dict[str, Any]:
    model, tokenizer, adapter = loaded.model, loaded.tokenizer, loaded.adapter
    report = corpus.report
    if corpus.n_rows == 0:
        raise ValueError(f"{source.name}: no row has a supervised token left to index ({report.summary()}).")
    circuit_path = circuit_path if circuit_path is not None else grads.circuit
    if circuit_path == "run":
        raise ValueError("grads.circuit=run means the circuit.pt of this pipeline run; outside the pipeline"
                         " (gradian index) give the path of a circuit.pt.")
    circuit = None
    if circuit_path is not None:
        if grads.module_filter:
            log.warning("grads.module_filter=%s is not used: grads.circuit decides the indexed weights.",
                        grads.module_filter)
        modules, circuit = restricted_sites(model, adapter, circuit_path, grads.circuit_mlps, model_cfg.name)
        shapes = site_shapes(modules)
    else:
        modules = select_modules(model, adapter, grads.module_filter)
        shapes = module_shapes(modules)
    data_dependent = grads.projection in STORED_KINDS or grads.width_allocation != "uniform"
    # Uniform widths are checked here, before any work; allocated ones once the factor pass chose them.
    projector = None if grads.width_allocation != "uniform" else Projector(
        shapes, grads.projection, grads.projection_dim, grads.projection_seed)
    if projector is not None:
        _check_kfac_widths(projector, grads)
    model_dtype = next(model.parameters()).dtype
    activations = activation_mode(grads.activations, model_dtype)  # "model", "recompute" or "fused"
    local = Path(source.name)
    data_file = str(local.resolve()) if local.exists() else source.name
    n_params = sum(p.numel() for p in model.parameters())
    covered = sum(d_out * d_in for d_out, d_in in shapes.values())  # weight elements whose gradient is projected
    fisher = recorded_fisher(grads)
    weights_sha256, tokenizer_sha256, data_sha256 = weights_hash(model), tokenizer_hash(tokenizer), source.fingerprint()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    overhead = batch_overhead_tokens(loaded.device)
    if data_dependent:  # the factor pass, before any row
        # the eigen projection at uniform widths needs only the projected (k, k) factors: a pass of
        # projected activations, not of (d, d) products
        projected = (Projector(shapes, "kronecker_orthogonal", grads.projection_dim, grads.projection_seed)
                     if grads.projection == "eigen" and grads.width_allocation == "uniform" else None)
        compute = _factor_pass(grads, loaded, modules, corpus, activations, pad_id, overhead, dict(shapes),
                               projected)
        projector = _data_dependent(dict(shapes), grads, index_dir, compute, activations, fisher,
                                    {"weights_sha256": weights_sha256, "tokenizer_sha256": tokenizer_sha256,
                                     "data_sha256": data_sha256, "report": report.summary()})
        _check_kfac_widths(projector, grads)
    row_format = format_for(grads)  # gradian.index.formats: how the rows are computed and stored
    factored = row_format.capture(grads, projector)  # None: the projector's dense blocks
    # What a row holds while it is computed (float32), and what is stored of it: sign rows are packed bytes.
    buffer_width = row_format.computed_width(grads, projector)
    row_width = row_format.stored_width(grads, projector)
    header = header_json(IndexHeader(
        model=model_cfg.name, revision=model_cfg.revision, precision=str(model_dtype).removeprefix("torch."),
        weights_sha256=weights_sha256, tokenizer_sha256=tokenizer_sha256,
        projection=projector.describe(), storage_dtype=grads.storage_dtype,
        loss_reduction=grads.loss_reduction, loss=grads.loss, preconditioner=grads.preconditioner,
        data_file=data_file, data_source={**source.spec.describe(), "path": data_file},
        data_sha256=data_sha256,
        max_seq_length=report.max_seq_length, truncation_side=grads.truncation_side,
        on_truncation=grads.on_truncation, data_report=report.summary(),
        token_policy=report.policy.resolve(tokenizer), row_width=row_width,
        circuit=circuit,
        projection_sha256=projection_fingerprint(projector),
        activations=activation_numerics(activations),
        parameter_share=covered / n_params, gguf_file=model_cfg.gguf_file, fisher=fisher,
        adapter=getattr(loaded, "lora", None), base_name=getattr(model_cfg, "base_name", None),
        row_format=grads.row_format, row_rank=recorded_rank(grads),
    ))
    console.print(_precision_line(model_cfg.precision, str(model_dtype).removeprefix("torch."), loaded.device),
                  highlight=False)
    console.print(f"the index covers {covered / n_params:.1%} of the model's parameters ({covered:,} of"
                  f" {n_params:,} weight elements)")
    lengths = corpus.lengths
    longest, shortest = int(lengths.max()), int(lengths.min())

    # The shard pipeline's two host buffers (refused here if they cannot fit): on a CPU they are the
    # device's memory too, so its estimates count them.
    host_bytes = check_shard_buffer(grads, corpus.n_rows, row_width, len(shapes),
                                    list(curvature_sides(projector).values()), value_bytes=row_format.value_bytes(grads))

    def estimate_at(rows: int, length: int, targets: int | None = None):
        estimate = estimate_grads(
            adapter.shape(), model_dtype.itemsize, rows, length, length if targets is None else targets,
            projector, row_format.value_bytes(grads), corpus.n_rows,
            activations=activations, preconditioner=grads.preconditioner, rows_per_shard=grads.rows_per_shard,
            fisher=fisher, loss=grads.loss, factor_pass=grads.width_allocation != "uniform", stored_width=row_width,
            device=loaded.device)
        if loaded.device.type == "cpu":
            estimate.terms["shard buffers (host memory: the CPU's own)"] = host_bytes
        return estimate

    def beyond_weights(rows: int, length: int) -> int:  # the loaded weights are not in the free memory
        estimate = estimate_at(rows, length)
        return estimate.total_bytes - estimate.terms["weights"]

    sizing = device_batch(grads.device_batch, loaded.device, grads.batch_size,
                          grads.batch_tokens or grads.batch_size * longest, shortest, longest, beyond_weights)
    batch_size = sizing.batch_size
    budget = grads.batch_tokens if sizing.source == "configured" else sizing.batch_tokens
    # The largest batch the plan can form: the token budget bounds rows x longest row.
    estimate = estimate_at(min(rows_within_budget(batch_size, budget, longest), corpus.n_rows), longest)
    writer = IndexWriter(index_dir, header, corpus.n_rows, grads.rows_per_shard, grads.num_shards, grads.shard_index)
    pending = writer.pending()
    n_pending_rows = sum(end - start for start, end in map(writer.row_range, pending))
    session = Capture(loaded.model, loaded.adapter, modules, projector,
                      LossSettings(grads.loss_reduction, grads.loss, activations))
    capture = _BatchCapture(session, grads, fisher, factored, pad_id)
    form = format_of(header)  # the stored form of this index's rows (gradian.index.formats)
    stats = _Throughput()
    what = row_format.computed_text(grads)
    console.print(f"building a gradient index of {n_pending_rows:,} rows of {source.name} in {index_dir}: each row the"
                  f" projected gradient of {len(shapes)} modules ({buffer_width:,} {what}), preconditioner"
                  f" {grads.preconditioner}; {sizing.note}", highlight=False)
    with Progress(console, "indexing", n_pending_rows, "rows") as bar, session, \
            ShardPipeline(writer, min(grads.rows_per_shard, corpus.n_rows), form, loaded.device,
                          buffer_width if fisher == "sampled" else None) as shards:
        for k in pending:
            start, end = writer.row_range(k)
            rows = corpus.rows(start, end)
            row_lengths = [len(r.input_ids) for r in rows]
            buffer = shards.next_buffer()
            factors = FactorSums(projector.names) if has_kfac(grads.preconditioner) else None
            for plan in plan_batches(row_lengths, batch_size, budget, grads.group_by_length, overhead):
                computed = index_batch(capture, [rows[i] for i in plan], plan, start, factors, buffer)
                stats.add(len(plan), sum(row_lengths[i] for i in plan), computed,
                          max(sum(rows[i].supervised) for i in plan))
                bar.advance(len(plan), rates=stats.text())
            shards.submit(ShardJob(k, start, buffer, torch.from_numpy(corpus.positions[start:end].copy()),
                                   {} if factors is None else factors.tensors(),
                                   len(shapes) if has_module(grads.preconditioner) else None))
        shards.finish()
    if has_kfac(grads.preconditioner):
        finalize_curvature(index_dir)  # the EK-FAC eigenvalues, once every shard is written
    if stats.rows:
        console.print(f"indexed {stats.rows} rows: {stats.text()} ({stats.real_tokens} tokens,"
                      f" {stats.computed_tokens} computed)")
    # `estimated_peak_bytes` is for the longest row in the largest batch the budget allows (an upper
    # bound, what the device batch and the preflight plan with); `estimated_batch_peak_bytes` for the
    # batches this run formed, each at its padded length and its rows' most targets (the figure a
    # measured peak is held against).
    formed = max((estimate_at(rows, length, targets).total_bytes for rows, length, targets in stats.shapes),
                 default=None)
    return {**IndexReader(index_dir).summary(), "estimated_peak_bytes": estimate.total_bytes,
            "estimated_batch_peak_bytes": formed,
            "padding_share": round(stats.padding_share, 4), "real_tokens": stats.real_tokens, "batch": sizing.record(),
            "computed_tokens": stats.computed_tokens}
