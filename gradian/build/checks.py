"""What the index loop checks before it starts: the data source is readable, the settings agree
(modules, widths, allocation, row format), and one shard's buffers fit in the host's memory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from circuitkit.core.device import DTYPES, free_memory_bytes
from circuitkit.core.errors import UserError
from circuitkit.core.io import (
    check_writable,
)
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import model_context
from gradian.curvature.factors import check_kfac, has_kfac, has_module
from gradian.curvature.moments import check_block_width
from gradian.data.rows import length_limit
from gradian.data.sources import DataError, SourceSpec, resolve_format
from gradian.index.formats import format_for
from gradian.settings.grads import GradsConfig

log = logging.getLogger(__name__)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary and special tokens (what decides the token ids)."""
    payload = {"vocab": tokenizer.get_vocab(), "special": tokenizer.all_special_tokens}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def check_input_file(path: Path, what: str) -> None:
    """A file the user named must be a readable file: one line naming it otherwise (UserError)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what}={str(path)!r} is a directory; give the JSONL file itself.", exit_code=2)
    _check_readable(path, what)


def check_data_source(grads: GradsConfig, path: str | Path) -> None:
    """grads.data_path names data that can be read: a readable file, a `datasets.save_to_disk`
    directory, or (not a local path) a hub dataset name. UserError (exit code 2) otherwise."""
    spec = SourceSpec.from_grads(grads, path)
    try:
        fmt = resolve_format(spec)
    except DataError as err:
        raise UserError(str(err), exit_code=2) from None
    local = Path(path)
    if fmt == "hf" and not local.exists():
        return
    if local.is_dir():
        if not any((local / marker).is_file() for marker in _DATASET_DIR_MARKERS) and fmt != "hf":
            raise UserError(f"grads.data_path={str(local)!r} is a directory, but not one written by"
                            " datasets' save_to_disk; give the JSONL, Parquet or Arrow file itself.", exit_code=2)
        return
    _check_readable(local, "grads.data_path")


# Files that datasets' save_to_disk writes into a Dataset / DatasetDict directory.
_DATASET_DIR_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


def _check_readable(path: Path, what: str) -> None:
    if not path.exists():
        raise UserError(f"{what}={str(path)!r} does not exist (resolved to {path.resolve()}).", exit_code=2)
    if not os.access(path, os.R_OK):
        raise UserError(f"{what}={str(path)!r} is not readable (permission denied); fix its permissions.",
                        exit_code=2)


def check_shard_buffer(grads: GradsConfig, n_rows: int, row_width: int, n_blocks: int = 1,
                       factor_sides: list[tuple[int, int]] | None = None, value_bytes: int = 2) -> int:
    """A shard's rows stay in host memory, in their stored form (`value_bytes` per value: the storage
    dtype's, or 1 for packed sign bytes, row_width of them), until the shard is written, and two shards
    are held at once (`gradian.build.shard_rows`: one filled while the other is written): refuse a shard that
    cannot fit (raw gradients of a large model are megabytes per row) before anything is written.
    With grads.preconditioner=module the shard's second moments (`n_blocks` of k x k float32) and
    one block's float64 scratch (rows x k) come on top; with kfac the float64 factor sums:
    Σ (k_o² + k_i²) · 8 over `factor_sides` ((k_o, k_i) per module, `gradian.build.memory.curvature_sides`),
    else bounded from the width alone. Returns the buffers' bytes."""
    rows = min(grads.rows_per_shard, n_rows)
    need = 2 * rows * row_width * value_bytes
    if has_kfac(grads.preconditioner) and grads.fisher == "sampled":  # the sampled-label rows, for EK-FAC
        need += 2 * rows * row_width * DTYPES[grads.storage_dtype].itemsize
    if has_module(grads.preconditioner):
        k = row_width // n_blocks
        need += n_blocks * k * k * 4 + rows * k * 8
    if has_kfac(grads.preconditioner) and factor_sides is not None:
        need += sum((k_o * k_o + k_i * k_i) * 8 for k_o, k_i in factor_sides)
    elif has_kfac(grads.preconditioner):  # float64 factor sums; a side is at most k (raw: d <= 4096)
        k = row_width // n_blocks
        side = min(k, 4096)
        need += n_blocks * 2 * side * side * 8 if grads.projection_dim is None else n_blocks * 4 * k * 8
    available = free_memory_bytes(torch.device("cpu"))
    if need > available:
        fits = max(1, available // (4 * row_width * value_bytes))
        what = format_for(grads).stored_text(grads)
        raise UserError(
            f"grads.rows_per_shard={grads.rows_per_shard}: a shard holds {rows} rows of {row_width:,} {what}"
            f" and two shards are held at once ({need / 2**30:.1f} GiB in host memory until they are written), and"
            f" {available / 2**30:.1f} GiB are"
            f" available. Lower grads.rows_per_shard (e.g. {fits}) or shrink the rows (grads.projection_dim,"
            " grads.module_filter).", exit_code=2)
    return need


def check_grads_config(model_cfg: ModelConfig, grads: GradsConfig, index_dir: Path | str | None = None) -> int:
    """What can be checked before any work, cheaply (the model's config.json, no weights).

    Checks that grads.shard_index < grads.num_shards, that grads.data_path (when set) can be
    read (a file, a save_to_disk directory or a hub dataset name), and that the index directory (`index_dir`, else grads.index_dir, when set)
    is writable. Returns the row length the run will use: grads.max_seq_length bounded by the
    model's context length (logged when the bound applies). Raises UserError (exit code 2)
    naming the key, the value and the fix.
    """
    if grads.shard_index >= grads.num_shards:
        raise UserError(f"grads.shard_index={grads.shard_index} must be < grads.num_shards={grads.num_shards}"
                        f" (workers are numbered 0..{grads.num_shards - 1}).", exit_code=2)
    try:
        check_block_width(grads.projection_dim, grads.preconditioner)
        check_width_allocation(grads)
        check_row_format(grads)
        if has_kfac(grads.preconditioner) and grads.projection_dim is not None:
            check_kfac(grads.projection, {})  # dense rows: refused before the model loads
    except ValueError as err:
        raise UserError(str(err), exit_code=2) from None
    if grads.data_path is not None:
        check_data_source(grads, grads.data_path)
    target = index_dir if index_dir is not None else grads.index_dir
    if target is not None:
        check_writable(Path(target), "grads.index_dir", directory=True)
    context = model_context(model_cfg)
    tokens, limit = length_limit(grads.max_seq_length, context)
    if tokens < grads.max_seq_length:
        log.info("rows are cut at %s", limit)
    return tokens


def check_width_allocation(grads: GradsConfig) -> None:
    """grads.width_allocation=spectrum needs projected Kronecker rows and equal blocks for nothing
    (the module preconditioner's second moments assume one width): ValueError naming the key."""
    if grads.width_allocation == "uniform":
        return
    if grads.projection_dim is None or grads.projection == "dense":
        what = "raw rows (grads.projection_dim=null)" if grads.projection_dim is None else "grads.projection=dense"
        raise ValueError(f"grads.width_allocation={grads.width_allocation} splits a projected width among Kronecker"
                         f" projections; {what} has none. Set grads.width_allocation=uniform.")
    if has_module(grads.preconditioner):
        raise ValueError(f"grads.width_allocation={grads.width_allocation} gives modules different widths, and"
                         f" grads.preconditioner={grads.preconditioner} stores one second moment per module of"
                         " equal width. Use grads.preconditioner=kfac (or none), or grads.width_allocation=uniform.")


def check_row_format(grads: GradsConfig) -> None:
    """What grads.row_format cannot store with the other grads settings (`gradian.index.formats`, each
    format's `config_problem`): ValueError naming the keys."""
    problem = format_for(grads).config_problem(grads)
    if problem:
        raise ValueError(problem)


