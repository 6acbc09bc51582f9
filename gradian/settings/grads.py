"""The `grads` group's schema: what the gradient index reads, how rows are made, projected and stored.

The keys' docs, choices and ranges are the fields' metadata (`circuitkit.core.config._f`), read by
validation, docs/configuration.md, `gradian index --help` and the code that branches on a value
(`choices(GradsConfig, "row_format")`). `check_grads` holds the rules that read several grads keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from circuitkit.core.config import ConfigError, _f
from circuitkit.core.flags import MAX_SEED


@dataclass
class GradsConfig:
    enabled: bool = _f(True, "run the gradient-indexing stage")
    data_path: Optional[str] = _f(None, "training data: a JSONL, Parquet or Arrow file, a datasets.save_to_disk"
                                  " directory, or a hub dataset name (prompt+completion or messages rows)")
    batch_size: int = _f(8, "rows per forward/backward (first memory lever)", ge=1)
    max_seq_length: int = _f(512, "tokens per row after truncation (second memory lever)", ge=2)
    on_truncation: str = _f("warn", "when a completion is cut", choices=("warn", "error", "drop"))
    truncation_side: str = _f("right", "what truncation removes", choices=("right", "prompt_left"))
    loss_reduction: str = _f("sum", "per-example loss over supervised tokens", choices=("sum", "mean"))
    loss: str = _f("margin", "per-token function whose gradient is indexed: margin = TRAK's negated log-odds"
                   " -log(p/(1-p)) of the correct token, ce = cross-entropy", choices=("ce", "margin"))
    append_eos: bool = _f(False, "prompt/completion rows end with the tokenizer's EOS, supervised; chat rows also"
                          " supervise the template's end-of-turn tokens (false: only what the rows wrote)")
    prepend_bos: Optional[bool] = _f(None, "prompt/completion rows start with BOS: true, false, or null = as the"
                                     " tokenizer does by itself (chat rows: as the template writes)")
    module_filter: Optional[list[str]] = _f(None, "name patterns of linear modules; null = all in the blocks (the index size, and the peak a little: activations kept from the first selected module on, capture buffers). With model.adapter: adapter (or lora_A, lora_B) = the LoRA linears, which a base module's pattern does not select")
    projection: str = _f("kronecker_orthogonal", "random projection kind: kronecker_orthogonal = Kronecker factors with"
                         " orthonormal rows, kronecker = Rademacher (±1) factors, dense = one Gaussian matrix,"
                         " whitened = kronecker_orthogonal after each module's damped full K-FAC whitening (a"
                         " factor pass over the data before any row; the matrices are stored with the index),"
                         " eigen = kronecker_orthogonal rotated into the eigenbasis of each module's projected"
                         " K-FAC factors (the same factor pass; dense rows score as kronecker_orthogonal's; each"
                         " coordinate one K-FAC eigen-direction, what row_format signs keeps the sign of)",
                         choices=("kronecker", "kronecker_orthogonal", "dense", "whitened", "eigen"))
    projection_dim: Optional[int] = _f(1024, "projected width per module; null = raw gradients (the index size, and the peak a little: capture buffers, projection matrices)", ge=1)
    projection_seed: int = _f(0, "seed of the projection matrices", ge=0, le=MAX_SEED)
    width_allocation: str = _f("uniform", "how the row's total width, n_modules x projection_dim, is split among"
                               " the modules: uniform = projection_dim each; spectrum = in proportion to each"
                               " module's effective dimension under its damped K-FAC curvature (a factor pass over"
                               " the data before any row, as whitened's; each width at least projection_dim / 4, a"
                               " balanced Kronecker size; the widths stored with the index). Kronecker projections"
                               " only, not with preconditioner module", choices=("uniform", "spectrum"))
    preconditioner: str = _f("kfac", "curvature stored with the index: each module's second moment of the rows"
                             " (module, for `gradian rank --score influence|whitened`), K-FAC factors of the"
                             " projected activations and output gradients (kfac, for --score kfac|ekfac), or both",
                             choices=("none", "module", "kfac", "module+kfac"))
    fisher: str = _f("empirical", "the Fisher whose K-FAC factors and EK-FAC eigenvalues kfac stores: empirical ="
                     " output gradients of the data's own labels; sampled = the true Fisher, of labels sampled"
                     " from the model's own prediction at each supervised position (Kronfluence's default; one"
                     " more backward per batch and the sampled rows stored beside the rows; the stored rows keep"
                     " the data's labels)", choices=("empirical", "sampled"))
    storage_dtype: str = _f("float16", "dtype of stored rows (on-disk index size only, not the peak)",
                          choices=("float16", "bfloat16", "float32"))
    factor_rows: Optional[int] = _f(None, "rows the factor pass reads before any row is written (projection whitened,"
                                    " width_allocation spectrum): null = every row (a second pass over the data);"
                                    " m = an evenly spaced sample of at most m rows (every ceil(n/m)-th), recorded"
                                    " in the stored matrices' settings", ge=1)
    row_format: str = _f("dense", "how each module's projected gradient G (k_o x k_i) is stored: dense = G itself;"
                         " factored = rank-c factors U (k_o x c), V (k_i x c), c = row_rank, with G ~ U V^T:"
                         " c (k_o + k_i) values, exact for a row with at most c positions carrying gradient, else"
                         " G's best rank-c approximation (gradian.index.formats.factored). Kronecker projections or raw rows, not"
                         " dense; not with preconditioner module; signs = one bit per projected coordinate (its sign,"
                         " 1/32 of float32's bytes), scored by n - 2 x Hamming distance (gradian.index.formats.signs): rank with"
                         " cosine or dot, preconditioner none (projection eigen, the grads=signs preset, or whitened"
                         " for a K-FAC-preconditioned score; storage_dtype does not apply)",
                         choices=("dense", "factored", "signs"))
    row_rank: int = _f(8, "c, the rank of each module's factors with row_format=factored (at most min(k_o, k_i)"
                       " of every module; unused with dense)", ge=1, le=4096)
    batch_tokens: Optional[int] = _f(None, "token budget of one batch: rows x longest row (padding included);"
                                     " null = batch_size x max_seq_length", ge=1)
    group_by_length: bool = _f(True, "batch rows of similar length together (false: batches in source order)")
    device_batch: str = _f("auto", "auto = on an accelerator (CUDA, MPS) raise the token budget and the row cap to the"
                           " largest batch the memory estimate fits in 90% of the device's free memory (never below"
                           " batch_size / batch_tokens; recorded in the index summary); off = batch_size and"
                           " batch_tokens as set. The CPU always uses them as set", choices=("auto", "off"))
    activations: str = _f("auto", "how multi-op activations (GPT-2's tanh GELU) run in the gradient pass: model"
                          " (the model's own ops, intermediates kept), recompute (the same ops re-run in the"
                          " backward: same bits, lower peak, ~6% slower), fused (one torch kernel for the same"
                          " function: lower peak, faster, other rounding); auto = fused for 16-bit model"
                          " precision, model for float32", choices=("auto", "model", "recompute", "fused"))
    data_format: str = _f("auto", "format of data_path", choices=("auto", "jsonl", "parquet", "arrow", "hf"))
    data_split: Optional[str] = _f("train", "split of a DatasetDict directory or a hub dataset")
    data_row_range: Optional[list[int]] = _f(None, "[start, end): read only these records of the source"
                                              " (0-based, source order); null = all")
    prompt_column: str = _f("prompt", "column (JSONL key) holding the prompt")
    completion_column: str = _f("completion", "column (JSONL key) holding the completion")
    messages_column: str = _f("messages", "column (JSONL key) holding chat messages")
    rows_per_shard: int = _f(4096, "rows per safetensors shard", ge=1)
    num_shards: int = _f(1, "workers splitting the data", ge=1)
    shard_index: int = _f(0, "this worker's share, 0 <= shard_index < num_shards", ge=0)
    index_dir: Optional[str] = _f(None, "where the index goes; null = <run dir>/index")
    circuit: Optional[str] = _f(None, "restrict the index to a circuit's kept heads/MLPs: null = no,"
                                " 'run' = this run's circuit.pt, or a path to a circuit.pt")
    circuit_mlps: str = _f("kept", "with grads.circuit: index the kept MLPs' output projections too, or heads only",
                           choices=("kept", "none"))


def check_grads(g: GradsConfig) -> None:
    """The grads keys that must agree with each other (the worker's share, the row range)."""
    if g.shard_index >= g.num_shards:
        raise ConfigError(f"Config key 'grads.shard_index' = {g.shard_index} must be < grads.num_shards"
                          f" = {g.num_shards} (workers are numbered 0..num_shards-1).")
    if g.data_row_range is not None and (len(g.data_row_range) != 2 or not 0 <= g.data_row_range[0] < g.data_row_range[1]):
        raise ConfigError(f"Config key 'grads.data_row_range' = {list(g.data_row_range)} must be [start, end] with"
                          " 0 <= start < end (records start..end-1), or null for all.")
