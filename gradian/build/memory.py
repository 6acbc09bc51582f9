"""Peak device memory of gradient indexing, from the model's shape alone (no weights).

`estimate_grads` is the closed form (notation in `circuitkit.preflight.memory`); it reads the modules,
the projection and its kronecker factors from a `Projector`, the same object that projects
the gradients, so the factors are computed once. `grads_estimate(cfg)` applies it to a
config before any weight is loaded (the modules named from the shape by
`circuitkit.models.linear_modules`, the same names `select_modules` finds in the model) and
`grads_advice` names the settings that bring it under a budget. `GRADS_MEMORY` hands both to
the preflight through the grads stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from circuitkit.core.batching import rows_within_budget
from circuitkit.core.circuit_file import grads_circuit_path, kept_components, load_circuit
from circuitkit.core.device import get_device, model_dtype
from circuitkit.core.pipeline import StageMemory
from circuitkit.models.adapters import family
from circuitkit.models.linear_modules import block_role, circuit_module_shapes, linear_module_shapes
from circuitkit.models.lora import lora_linear_shapes, read_adapter
from circuitkit.preflight.memory import ACT_BASE, FP32, MemoryEstimate, calibrated, largest_fitting, shape_for
from gradian.build.width_table import width_note
from gradian.capture.gradients import activation_mode, logit_chunk_rows
from gradian.curvature.factors import has_kfac, has_module
from gradian.index.formats import format_for
from gradian.projection.projector import (
    _DENSE_CACHE_BYTES,
    _DENSE_CHUNK_COLS,
    KRONECKER_KINDS,
    STORED_KINDS,
    Projector,
)

# Calibration of `estimate_grads` (gradian.capture.gradients.per_example_gradients). Measured with the CPU
# dispatch tracker of `measure_peak`, float32, sdpa, frozen parameters, on the tiny GPT-2 / Llama
# shapes of scripts/bench/check_memory_estimates.py (vocab 1024 and 50257) with mlp.c_proj / down_proj
# and with every block linear selected, B = 4, prompt 16 / 64 / 240, supervised 8 / 16 / 32; the
# live bytes were read at the start of `backward()` and the peaks before and after it:
# * Saved activations are the attribution coefficients ACT_PER_LAYER, counted only from the first
#   selected module on (autograd's graph starts there): measured 25.2·N·d (GPT-2, c_proj: one
#   full layer + ACT_BASE = 25.4 predicted) and 12.4·N·d (Llama, down_proj: 12.3 predicted).
# * The (N_s, V) tensors: the forward holds the (upcast) logits and the saved float32
#   log-softmax; the peak is inside the log-softmax backward, with three float32 (N_s, V) tensors
#   live (saved log-softmax, its gradient, the logits' gradient): measured 3.03-3.07·N_s·V·4 over
#   the activations on the 50257-vocabulary tiny models. LOGIT_F32_COPIES = 3. grads.loss=margin
#   (`gradian.capture.gradients._Margin`) keeps one fewer: its backward holds the saved softmax over the
#   other classes and the logits' gradient; measured 1.0 MiB under ce at N_s = 256, V = 1024 and
#   the same peak as ce wherever the block temporaries dominate: LOGIT_F32_COPIES_BY_LOSS.
# * Forward temporaries of one block (GELU / SiLU intermediates) above the saved activations:
#   measured 15-17·N·d for GPT-2 (f = 4d) and 7.9-8.9·N·d for Llama (f = 2d): GRADS_FWD_TMP_F = 4
#   (units N·f·p). Alive only while no (N_s, V) tensor is, so the peak takes the larger of the two.
# * Activations recomputed in the backward or fused (`circuitkit.models.recompute`,
#   `grads.activations`): GPT-2's tanh GELU then keeps its input only, so its c_f is 1 here (4
#   with the model's own ops, and in attribution, which changes nothing).
#   The backward of a recomputed activation holds its recomputed intermediates and their
#   gradients: measured 5.2-5.6·N·f·p above the saved activations on the tiny and small GPT-2
#   shapes (B 1-8, 32-256 tokens), RECOMPUTE_TMP_F = 5.5, in place of GRADS_FWD_TMP_F. A fused
#   activation has no intermediates; GRADS_FWD_TMP_F is kept for it (an upper bound).
# * Supervised positions reach the unembedding `logit_chunk_rows(V, device)` at a time, so the (N_s, V)
#   terms are (min(N_s, chunk rows), V).
LOGIT_F32_COPIES = 3
LOGIT_F32_COPIES_BY_LOSS = {"ce": LOGIT_F32_COPIES, "margin": 2}
RECOMPUTE_TMP_F = 5.5
GRADS_FWD_TMP_F = 4.0
# Index: per row float32 norm + int64 row id next to the stored gradient row.
INDEX_ROW_EXTRA_BYTES = 4 + 8


def _graph_layers(module_names: list[str], s: dict[str, Any], c_d: float, c_f: float) -> float:
    """Activations autograd saves per token (units of elements), from the first selected module on.

    Layers after the first selected one count c_d·d + c_f·f; the first one its share by the
    module's role (attention: all of it; MLP input: c_f·f; MLP output: none), because the graph
    of the backward starts at the first module whose weight gradient is asked for.
    """
    n_layers, d, f = s["n_layers"], s["d_model"], s["d_mlp"]
    if not module_names:
        return n_layers * (c_d * d + c_f * f)
    first_layer, first_role = min((block_role(name, s) for name in module_names), key=lambda lr: lr[0])
    share = {"mlp_in": c_f * f, "mlp_out": 0.0}.get(first_role, c_d * d + c_f * f)
    return max(0, n_layers - first_layer - 1) * (c_d * d + c_f * f) + share


def grads_index_bytes(n_rows: int, width: int, storage_dtype_bytes: int) -> int:
    """Bytes of a gradient index on disk (gradian.index.manifest), headers excluded:

        n_rows · (width · s + 4 + 8)      s = bytes of grads.storage_dtype; float32 norm, int64 row id

    Each shard adds a safetensors header (a few hundred bytes) and the index one manifest.json
    (a few kB); both are independent of the row count.
    """
    return int(n_rows * (width * storage_dtype_bytes + INDEX_ROW_EXTRA_BYTES))


def curvature_sides(projector: Projector) -> dict[str, tuple[int, int]]:
    """(k_o, k_i) per module: the sides of its K-FAC factors (kronecker factors; raw rows: the shape)."""
    return {n: projector.factors.get(n, shape) for n, shape in projector.shapes.items()}


def preconditioner_index_bytes(projector: Projector, preconditioner: str, n_shards: int = 1) -> int:
    """Bytes the preconditioner adds to an index on disk (float32; headers excluded):

        module  per shard   Σ_m width_m² · 4                         (second moments)
        kfac    per shard   Σ_m (k_i² + k_o²) · 4 + 8               (factor sums, position count)
                once        Σ_m (k_i² + k_o² + k_i + k_o + k_o·k_i) · 4 + 16   (curvature.safetensors)
    """
    total = 0
    if has_module(preconditioner):
        total += n_shards * sum(projector.width(n) ** 2 * FP32 for n in projector.shapes)
    if has_kfac(preconditioner):
        sides = curvature_sides(projector).values()
        total += n_shards * (sum((k_i * k_i + k_o * k_o) * FP32 for k_o, k_i in sides) + 8)
        total += sum((k_i * k_i + k_o * k_o + k_i + k_o + k_o * k_i) * FP32 for k_o, k_i in sides) + 16
    return int(total)


def estimate_grads(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int,
                   supervised_per_row: int, projector: Projector, storage_dtype_bytes: int = 2,
                   n_rows: int = 0, activations: str = "model", preconditioner: str = "none",
                   rows_per_shard: int | None = None, fisher: str = "empirical",
                   loss: str = "ce", factor_pass: bool = False, stored_width: int | None = None,
                   device: torch.device | str | None = None) -> MemoryEstimate:
    """Peak device bytes of one gradient-indexing batch (`gradian.capture.gradients.per_example_gradients`).

    seq_len is the padded row length (prompt + answer), supervised_per_row the targets per row;
    N = B·seq_len tokens, N_s = B·supervised_per_row supervised targets; the projector holds the
    selected modules (name -> (d_out, d_in)), the projection kind and dim, and each module's
    kronecker factors (k_o, k_i), computed once when it was made; width is a module's row
    width. Terms:

        weights                         P·p
        activations saved for backward  N·p·(ACT_BASE·d + A),  A = per-family ACT_PER_LAYER
                                        from the first selected module on (`_graph_layers`),
                                        with the family's recomputed_c_f for recomputed or fused
                                        activations (`activations`: the run's
                                        `gradian.capture.gradients.activation_mode`; the default,
                                        "model", keeps the most)
        capture buffers                 kronecker: Σ_i N·k_i·4; raw / dense: Σ_i N·d_in·4 (the
                                        masked inputs); dense also B·d_out·d_in·4 (G of one
                                        module). The (B, width) rows are made by the module
                                        gradient hooks, after the peak, and are not counted
        projection matrices             kronecker Σ (k_o·d_out + k_i·d_in)·4; dense Σ min(k·d_out·d_in,
                                        cache) or one 4096-column chunk; raw 0
        logits (model dtype)            N_s·V·p
        fp32 logit upcast               N_s·V·4       (the allocation the OOM page is about)
        loss buffers                    N_s·V·(4·C − 4 − p): with the two above, the C float32
                                        (N_s, V) tensors of the loss's backward, C =
                                        LOGIT_F32_COPIES_BY_LOSS[loss] (ce: 3, the log-softmax
                                        backward; margin: 2)
        block temporaries               max(0, F·N·f·p − C·N_s·V·4): one block's
                                        transients (F = GRADS_FWD_TMP_F in the forward, or
                                        RECOMPUTE_TMP_F in the backward of a recomputed
                                        activation), which peak when the vocabulary-sized
                                        tensors are not alive, so only their excess counts

    Here N_s is one unembedding chunk: min(B·supervised_per_row, `logit_chunk_rows(V, device)`: its
    size depends on the device type the batch runs on, None the CPU's). Only
    the supervised hidden states reach the unembedding, a chunk at a time, so no term but the
    activations grows with prompt length, and the logit terms stop growing at one chunk.
        K-FAC factor scratch            with a kfac `preconditioner`, the largest module's float64
                                        copies of its projected inputs and output gradients and
                                        their outer-product sums: N·(k_i + k_o)·8 + (k_i² + k_o²)·8
                                        (raw rows: d_in, d_out), made in the backward hooks
        eigen factor pass               with kind "eigen" at uniform widths: the pass sums projected
                                        factors, the largest module's N·(k_i + k_o)·8 + (k_i² + k_o²)·8
        whitening factor pass           with kind "whitened" (`whitening_pass_bytes`): the factor pass's
                                        raw inputs Σ N·(d_in − k_i)·4 and the largest module's float64
                                        scratch N·(d_in + d_out)·8 + (d_in² + d_out²)·8
        factor pass (width allocation)  the same with grads.width_allocation=spectrum (`factor_pass`);
                                        the widths are not known before it, so the other terms use
                                        projection_dim per module (the rows' total width is at most
                                        the same, n_modules x projection_dim)
        sampled-label pass              with kfac and `fisher` "sampled" (grads.fisher): the second
                                        backward's float32 logits kept beside its cross-entropy
                                        buffers, N_s·V·4 (measured: +12.3 MiB at N_s = 64, V = 50257,
                                        the whole difference), and its (B, Σ width) float32 rows

    The shard pipeline's buffers are host memory (`gradian.build.checks.check_shard_buffer`); on a
    CPU, where that is the device's, the index adds them to its estimates.

    `index_bytes` (attribute, not in the total: it is disk) is
    `grads_index_bytes(n_rows, Σ width, storage_dtype_bytes)` plus `preconditioner_index_bytes`
    for ceil(n_rows / rows_per_shard) shards (one when rows_per_shard is None); `stored_width`,
    when given, replaces Σ width there (the row format's, `gradian.index.formats`: factored rows' factors,
    sign rows' packed bytes).
    """
    s, (c_d, c_f) = calibrated(shape)
    p = dtype_bytes
    d, f, V = s["d_model"], s["d_mlp"], s["vocab_size"]
    B, N = batch_size, batch_size * seq_len
    Ns = min(batch_size * supervised_per_row, logit_chunk_rows(V, device))  # rows of one unembedding chunk
    recomputed_c_f = family(s["family"]).recomputed_c_f
    lean = activations in ("recompute", "fused") and recomputed_c_f is not None
    recomputed = lean and activations == "recompute"
    c_f = recomputed_c_f if lean else c_f
    tmp_f = RECOMPUTE_TMP_F if recomputed else GRADS_FWD_TMP_F
    kind, projection_dim, module_shapes = projector.kind, projector.projection_dim, projector.shapes
    acts = N * p * (ACT_BASE * d + _graph_layers(list(module_shapes), s, c_d, c_f))
    capture = matrices = width = 0
    max_g = 0
    for name, (d_out, d_in) in module_shapes.items():
        width += projector.width(name)
        if kind in KRONECKER_KINDS:  # kronecker, kronecker_orthogonal, whitened: same factors and buffers
            k_o, k_i = projector.factors[name]
            capture += N * k_i * FP32
            matrices += (k_o * d_out + k_i * d_in) * FP32
        else:
            capture += N * d_in * FP32
            if kind == "dense":
                full = projection_dim * d_out * d_in * FP32
                matrices += full if full <= _DENSE_CACHE_BYTES else projection_dim * _DENSE_CHUNK_COLS * FP32
                max_g = max(max_g, B * d_out * d_in * FP32)
    capture += max_g  # the (B, width) rows appear after the peak (module grad hooks run later)
    copies = LOGIT_F32_COPIES_BY_LOSS[loss]
    logits_f32 = copies * Ns * V * FP32
    terms = {
        "weights": s["n_params"] * p,
        "activations saved for backward": int(acts),
        "capture buffers": int(capture),
        "projection matrices": int(matrices),
        "logits (model dtype)": Ns * V * p,
        "fp32 logit upcast": Ns * V * FP32,
        "loss buffers": Ns * V * (FP32 * copies - FP32 - p),
        "block temporaries": int(max(0.0, tmp_f * N * f * p - logits_f32)),
    }
    if has_kfac(preconditioner):
        terms["K-FAC factor scratch"] = factor_scratch_bytes(N, curvature_sides(projector).values())
    if has_kfac(preconditioner) and fisher == "sampled":
        terms["sampled-label pass"] = Ns * V * FP32 + B * (stored_width or width) * FP32
    if kind == "eigen" and not factor_pass:  # uniform widths: the pass sums projected (k, k) factors
        terms["eigen factor pass"] = factor_scratch_bytes(N, projector.factors.values())
    elif kind in STORED_KINDS:  # whitened (or eigen after a width allocation): raw (d, d) factors
        terms["whitening factor pass"] = whitening_pass_bytes(projector, N)
    elif factor_pass:  # grads.width_allocation=spectrum: the same pass, before the widths are known
        terms["factor pass (width allocation)"] = whitening_pass_bytes(projector, N)
    est = MemoryEstimate(terms, phase=f"{loss} loss backward" if terms["block temporaries"] == 0
                         else "backward of a recomputed activation" if recomputed else "forward of the last block")
    n_shards = max(1, -(-n_rows // rows_per_shard)) if rows_per_shard else 1
    width = stored_width or width  # the stored rows (factored: c (k_o + k_i) per module)
    est.index_bytes = (grads_index_bytes(n_rows, width, storage_dtype_bytes)
                       + preconditioner_index_bytes(projector, preconditioner, n_shards))
    if has_kfac(preconditioner) and fisher == "sampled":  # the sampled-label rows, beside the rows
        est.index_bytes += grads_index_bytes(n_rows, width, storage_dtype_bytes)
    if kind == "whitened":  # projection.safetensors: the whitened factors, once per index
        est.index_bytes += sum((k_o * d_out + k_i * d_in) * FP32 for (d_out, d_in), (k_o, k_i)
                               in zip(module_shapes.values(), projector.factors.values(), strict=True))
    elif kind == "eigen":  # projection.safetensors: the (k, k) rotations
        est.index_bytes += sum((k_o * k_o + k_i * k_i) * FP32 for k_o, k_i in projector.factors.values())
    return est


def factor_scratch_bytes(n_tokens: int, sides) -> int:
    """The largest module's float64 copies of N projected inputs and output gradients and their
    outer-product sums, N·(k_i + k_o)·8 + (k_i² + k_o²)·8, over `sides` ((k_o, k_i) per module)."""
    return max(n_tokens * (k_i + k_o) * 8 + (k_i * k_i + k_o * k_o) * 8 for k_o, k_i in sides)


def whitening_pass_bytes(projector: Projector, n_tokens: int) -> int:
    """What the whitened projection's factor pass (`gradian.curvature.whitening`, before any row) needs beyond a
    row batch of N = `n_tokens` positions: the raw module inputs instead of the projected ones,
    Σ_i N·(d_in − k_i)·4, and the largest module's float64 copies of x and δ with their
    outer-product sums, N·(d_in + d_out)·8 + (d_in² + d_out²)·8. Counted on top of the row pass's
    terms (an upper bound: the two passes do not overlap). On the host, Σ (d_in² + d_out²)·8 of
    factor sums (not in this device total)."""
    extra = sum(n_tokens * (d_in - projector.factors[n][1]) * FP32 for n, (d_out, d_in) in projector.shapes.items())
    scratch = max(n_tokens * (d_in + d_out) * 8 + (d_in * d_in + d_out * d_out) * 8
                  for d_out, d_in in projector.shapes.values())
    return int(extra + scratch)


def grads_projector(cfg: Any, shape: dict[str, Any] | None = None) -> Projector:
    """The Projector of the modules `cfg.grads` selects, named from the model's shape alone:
    `grads.module_filter` over the blocks' linear modules (a `model.adapter`'s LoRA linears among
    them, their shapes read from its weights file), or the sites of `grads.circuit`."""
    g = cfg.grads
    shape = shape or shape_for(cfg.model)
    lora = lora_linear_shapes(read_adapter(cfg.model.adapter)) if getattr(cfg.model, "adapter", None) else None
    modules = linear_module_shapes(shape, g.module_filter, lora) if g.circuit is None else _circuit_shapes(cfg, shape)
    if g.width_allocation != "uniform" and g.projection_dim is not None:
        from gradian.curvature.allocation import (
            provisional_widths,  # the widths themselves come from the factor pass
        )

        return Projector(modules, g.projection, g.projection_dim, g.projection_seed,
                         widths=provisional_widths(modules, g.projection_dim))
    return Projector(modules, g.projection, g.projection_dim, g.projection_seed)


def grads_estimate(cfg: Any, batch_size: int | None = None, seq_len: int | None = None,
                   supervised: int | None = None, n_rows: int = 0, projector: Projector | None = None) -> MemoryEstimate:
    """Estimated peak of gradient indexing. Before the data is read, rows are assumed as long
    as `grads.max_seq_length` and fully supervised (the worst case the settings allow); a batch
    holds at most `grads.batch_tokens` tokens, so at most batch_tokens // max_seq_length such rows.
    `projector`: the one `grads_projector(cfg)` made, when the caller asks several times."""
    g = cfg.grads
    shape = shape_for(cfg.model)
    seq = seq_len or g.max_seq_length
    projector = projector or grads_projector(cfg, shape)
    rows = rows_within_budget(batch_size or g.batch_size, g.batch_tokens, seq)
    dtype = model_dtype(cfg.model)  # the dtype the run uses (auto resolved)
    return estimate_grads(shape, dtype.itemsize, rows, seq, supervised or seq, projector,
                          format_for(g).value_bytes(g), n_rows, activation_mode(g.activations, dtype),
                          g.preconditioner, g.rows_per_shard, g.fisher, g.loss,
                          factor_pass=g.width_allocation != "uniform", stored_width=format_for(g).stored_width(g, projector),
                          device=get_device())


def _circuit_shapes(cfg: Any, shape) -> dict[str, tuple[int, int]]:
    """Sites of a grads.circuit-restricted index: from the circuit file when it exists already,
    else (grads.circuit=run before pruning has run) every head and MLP, an upper bound."""
    path = grads_circuit_path(cfg.grads.circuit, cfg.output_path, None)  # no run dir before the run
    heads = mlps = None
    if path is not None and Path(path).is_file():
        heads, mlps = kept_components(load_circuit(Path(path)))
    if cfg.grads.circuit_mlps == "none":
        mlps = [False] * int(shape["n_layers"])
    return circuit_module_shapes(shape, heads, mlps)


def grads_advice(cfg: Any, budget_bytes: int) -> list[str]:
    """grads.batch_size first, then grads.max_seq_length: the two settings that move the peak."""
    g = cfg.grads
    projector = grads_projector(cfg)  # once: its kronecker factors (and their warnings) do not change
    best = largest_fitting(lambda b: grads_estimate(cfg, batch_size=b, projector=projector).total_bytes
                           <= budget_bytes, g.batch_size)
    if best:
        return [f"grads.batch_size={best}"]
    seq = largest_fitting(lambda n: grads_estimate(cfg, batch_size=1, seq_len=n, projector=projector).total_bytes
                          <= budget_bytes, g.max_seq_length)
    tips = [f"grads.batch_size=1 with grads.max_seq_length={seq}"] if seq >= 2 else []
    return tips + ["a device with more memory, or a smaller model (storage_dtype only shrinks the index on"
                   " disk; module_filter and projection_dim mostly do, and move only the peak's capture"
                   " buffers and projection matrices)"]


def _grads_stage_estimate(cfg: Any) -> MemoryEstimate | None:
    return grads_estimate(cfg) if cfg.grads.enabled else None


def _width_note(cfg: Any) -> str | None:
    return width_note(cfg, grads_projector)


GRADS_MEMORY = StageMemory(estimate=_grads_stage_estimate, advice=grads_advice, note=_width_note)
