"""Build a gradient index: rows -> per-example projected gradients -> shards on disk.

Same code for the pipeline's `grads` stage and `gradian index`, same `grads.*` keys. The
index header records everything that decides the stored values (model and weights hash,
tokenizer hash, modules and shapes, projection, storage dtype, loss reduction, data hash,
truncation settings), so a resumed or parallel run refuses an index made differently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from circuitkit.config import GradsConfig, ModelConfig
from circuitkit.errors import UserError
from circuitkit.io import sha256_file
from circuitkit.memory import estimate_grads
from gradian.capture import per_example_gradients
from gradian.data import batches, collate, length_limit, load_rows
from gradian.index import MANIFEST, STORAGE_DTYPES, IndexReader, IndexWriter, read_manifest
from gradian.projection import Projector, module_shapes, projection_fingerprint, select_modules

log = logging.getLogger(__name__)
SAMPLE_DATA = Path(__file__).resolve().parent / "data" / "sample_train.jsonl"


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary and special tokens (what decides the token ids)."""
    payload = {"vocab": tokenizer.get_vocab(), "special": tokenizer.all_special_tokens}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def check_input_file(path: Path, what: str) -> None:
    """A file the user named must be a readable file: one line naming it otherwise (UserError)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what}={str(path)!r} is a directory; give the JSONL file itself.", exit_code=2)
    if not path.exists():
        raise UserError(f"{what}={str(path)!r} does not exist (resolved to {path.resolve()}).", exit_code=2)
    if not os.access(path, os.R_OK):
        raise UserError(f"{what}={str(path)!r} is not readable (permission denied); fix its permissions.",
                        exit_code=2)


def check_writable_dir(path: Path, what: str) -> None:
    """`path` is, or can be created as, a directory this process can write into (UserError if not)."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UserError(f"{what}={str(path)!r}: {probe} is a file, not a directory; choose another place.",
                        exit_code=2)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{what}={str(path)!r}: cannot write into {probe} (permission denied or read-only);"
                        " choose a directory you can write to.", exit_code=2)


def model_context_length(model_cfg: ModelConfig) -> int | None:
    """The model's context length from its config.json alone (no weights); None if unknown here.

    None when the config cannot be read now (e.g. a hub name offline): the bound is then applied
    after the model is loaded, from the loaded model's config.
    """
    from transformers import AutoConfig

    from circuitkit.models.loading import context_length, resolve_model_path

    try:
        hf = AutoConfig.from_pretrained(resolve_model_path(model_cfg.name), revision=model_cfg.revision,
                                        trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        log.debug("no config for %s before loading (%s); the context bound waits for the model", model_cfg.name, err)
        return None
    return context_length(hf)


def check_grads_config(model_cfg: ModelConfig, grads: GradsConfig, index_dir: Path | str | None = None) -> int:
    """What can be checked before any work, cheaply (the model's config.json, no weights).

    Checks that grads.shard_index < grads.num_shards, that grads.data_path (when set) is a
    readable file, and that the index directory (`index_dir`, else grads.index_dir, when set)
    is writable. Returns the row length the run will use: grads.max_seq_length bounded by the
    model's context length (logged when the bound applies). Raises UserError (exit code 2)
    naming the key, the value and the fix.
    """
    if grads.shard_index >= grads.num_shards:
        raise UserError(f"grads.shard_index={grads.shard_index} must be < grads.num_shards={grads.num_shards}"
                        f" (workers are numbered 0..{grads.num_shards - 1}).", exit_code=2)
    if grads.data_path is not None:
        check_input_file(Path(grads.data_path), "grads.data_path")
    target = index_dir if index_dir is not None else grads.index_dir
    if target is not None:
        check_writable_dir(Path(target), "grads.index_dir")
    context = model_context_length(model_cfg)
    tokens, limit = length_limit(grads.max_seq_length, context)
    if tokens < grads.max_seq_length:
        log.info("rows are cut at %s", limit)
    return tokens


def build_index(model_cfg: ModelConfig, grads: GradsConfig, index_dir: Path, console: Console | None = None,
                loaded=None, circuit_path: str | Path | None = None) -> dict[str, Any]:
    """Index `grads.data_path` into `index_dir` (this worker's shards); returns the index summary.

    `loaded`: an already loaded model (circuitkit.models.loading.LoadedModel), else loaded here.
    `circuit_path`: the circuit.pt that `grads.circuit` names (the pipeline resolves 'run' to
    its own circuit.pt); when given, only the circuit's kept heads and MLPs are indexed
    (`gradian.restrict`) and the manifest records the circuit.
    """
    from circuitkit.models.loading import context_length, load_model, weights_hash

    console = console or Console(stderr=True)
    if grads.data_path is None:
        data_path = SAMPLE_DATA
        log.warning("grads.data_path is null: indexing the shipped sample %s (24 hand-written rows, for trying"
                    " the pipeline); set grads.data_path to your JSONL data.", SAMPLE_DATA.name)
    else:
        data_path = Path(grads.data_path)
    # Before the model loads: nothing is worth loading for a run that cannot read or write.
    check_grads_config(model_cfg, grads, index_dir)
    check_input_file(data_path, "grads.data_path")
    if (Path(index_dir) / MANIFEST).is_file():
        read_manifest(Path(index_dir))  # a damaged or tampered index to resume is refused first
    loaded = loaded or load_model(model_cfg)
    model, tokenizer, adapter = loaded.model, loaded.tokenizer, loaded.adapter
    # The loaded model's own config decides (check_grads_config may not have seen one offline).
    max_tokens, _ = length_limit(grads.max_seq_length, context_length(model.config))
    rows, report = load_rows(data_path, tokenizer, grads.max_seq_length, grads.on_truncation, grads.truncation_side,
                             context_length=context_length(model.config))
    if not rows:
        raise ValueError(f"{data_path}: no row has a supervised token left to index ({report.summary()}).")
    circuit_path = circuit_path if circuit_path is not None else grads.circuit
    if circuit_path == "run":
        raise ValueError("grads.circuit=run means the circuit.pt of this pipeline run; outside the pipeline"
                         " (gradian index) give the path of a circuit.pt.")
    circuit = None
    if circuit_path is not None:
        from gradian.restrict import restricted_sites, site_shapes

        if grads.module_filter:
            log.warning("grads.module_filter=%s is not used: grads.circuit decides the indexed weights.",
                        grads.module_filter)
        modules, circuit = restricted_sites(model, adapter, circuit_path, grads.circuit_mlps, model_cfg.name)
        shapes = site_shapes(modules)
    else:
        modules = select_modules(model, adapter, grads.module_filter)
        shapes = module_shapes(modules)
    projector = Projector(shapes, grads.projection, grads.projection_dim, grads.projection_seed)
    header = {
        "model": model_cfg.name, "revision": model_cfg.revision, "precision": model_cfg.precision,
        "weights_sha256": weights_hash(model), "tokenizer_sha256": tokenizer_hash(tokenizer),
        "projection": projector.describe(), "storage_dtype": grads.storage_dtype,
        "loss_reduction": grads.loss_reduction, "data_file": str(data_path.resolve()),
        "data_sha256": sha256_file(data_path), "max_seq_length": max_tokens,
        "truncation_side": grads.truncation_side, "on_truncation": grads.on_truncation,
        "data_report": report.summary(), "row_width": projector.total_width, "circuit": circuit,
        "projection_sha256": projection_fingerprint(projector),
    }
    estimate = estimate_grads(
        adapter.shape(), next(model.parameters()).element_size(), min(grads.batch_size, len(rows)),
        max(len(r.input_ids) for r in rows), max(sum(r.supervised) for r in rows), shapes,
        grads.projection, grads.projection_dim, STORAGE_DTYPES[grads.storage_dtype].itemsize, len(rows))
    writer = IndexWriter(index_dir, header, len(rows), grads.rows_per_shard, grads.num_shards, grads.shard_index)
    pending = writer.pending()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_pending_rows = sum(end - start for start, end in map(writer.row_range, pending))
    with Progress(TextColumn("indexing"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("rows", total=n_pending_rows)
        for k in pending:
            start, end = writer.row_range(k)
            parts = []
            for chunk in batches(rows[start:end], grads.batch_size):
                batch = {key: t.to(loaded.device) for key, t in collate(chunk, pad_id).items()}
                parts.append(per_example_gradients(model, adapter, modules, projector, batch,
                                                   grads.loss_reduction).row().cpu())
                bar.advance(task, len(chunk))
            writer.write_shard(k, torch.cat(parts), torch.arange(start, end))
    # The estimate is for the longest row and the most supervised tokens in one batch: an upper bound.
    return {**IndexReader(index_dir).summary(), "estimated_peak_bytes": estimate.total_bytes}
