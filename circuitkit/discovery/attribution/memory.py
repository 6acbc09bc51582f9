"""Peak device memory of the attribution stage, from the model's shape alone (no weights).

`estimate_attribution` is the closed form (notation in `circuitkit.preflight.memory`);
`attribution_estimate(cfg)` applies it to a config, `advice` names the settings that bring it
under a budget, and `ig_advice` adds EAP-IG's time/accuracy line. `ATTRIBUTION_MEMORY` hands
the three to the preflight through the attribution stage.
"""

from __future__ import annotations

from typing import Any

import torch

from circuitkit.core.device import model_dtype
from circuitkit.core.pipeline import StageMemory
from circuitkit.discovery.attribution.corruptions import SHARED_CLEAN
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.attribution.quadrature import integration_rule
from circuitkit.discovery.attribution.tradeoffs import advice_line
from circuitkit.discovery.tasks.corruption_sets import discovery_corruptions
from circuitkit.preflight.memory import ACT_BASE, FP32, MemoryEstimate, calibrated, largest_fitting, shape_for

# Eager attention also saves the (B, H, T, T) softmax output (not calibrated: the fixtures use sdpa).
EAGER_ATTN_PER_LAYER = 1.0

# Gradient buffers alive at the peak of a backward pass, in units of N·d and N·f elements of the
# model dtype. Fitted to measure_peak (CPU dispatch tracker) at node level, ig_steps = 5, on the full
# sweep of scripts/bench/check_memory_estimates.py: measured minus every other term was 6.5·N·d for the
# GPT-2-small shape (f = 4d, so 2·d + 1·f = 6·d) and 5.75·N·d for tiny GPT-NeoX (6·d).
BWD_TMP_D = 2.0
BWD_TMP_F = 1.0
# One no-grad forward pass (exact patching, cached runs): transient activations, same units.
FWD_TMP_D = 4.0
FWD_TMP_F = 2.0
# Temporaries of `_GradientSums.add_layer_inputs` for one layer, in units of its (H + 2·KV + 1)·N·d
# float32 rows: einsum output and norm_backward intermediates for Q, K, V, the parts list, the
# torch.cat result and (first step) its float32 copy. Fitted at edge level with ig_steps = 1 (where
# this phase is the peak): 2.2 left ≤ 2 % over the measurement for GPT-2-small and tiny GPT-2.
# Raised to 2.6 by the small-input grid at the Llama-3.2-1B width (docs/benchmarks.md):
# measured minus estimate there was 19·N·d float32 per batch (0.39 of the 49 rows), the same at
# 1 and 2 layers (one layer's temporaries, not a per-layer term), which left one layer at
# N = 1024 tokens at 0.950 of its measured peak.
EDGE_TMP = 2.6
# Answer logits: (B, V) in the model dtype, its float32 copy, the clean copy, softmax / gradients.
LOGIT_COPIES = 4


def estimate_attribution(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int,
                         algorithm: str = "eap-ig", level: str = "node", ig_steps: int | None = 5,
                         attn_implementation: str = "sdpa", ig_rule: str = "right",
                         num_examples: int | None = None, n_corruptions: int = 1) -> MemoryEstimate:
    """Peak device bytes of one attribution batch (`circuitkit.discovery.attribution.eap.attribute`).

    Terms (notation in the module docstring; float32 is 4 bytes):

        weights                        P·p
        activations saved for backward N·p·(ACT_BASE·d + L·(c_d·d + c_f·f))   (per family)
        backward temporaries           N·p·(BWD_TMP_D·d + BWD_TMP_F·f)
        delta buffer                   node: N·(d + L·(H·dh + d))·4;  edge: + n_up·N·d·4
        gradient sums                  node: N·(d + L·(H·dh + d))·4;  edge: + (n_in + 1)·N·d·4
                                       (in the backward phase only from the 2nd point on)
        cached clean/corrupted runs    e_clean, e_corrupt, e_k: 3·N·d·max(p, 4)
        saved input gradients (edge)   L·N·((H + 2·KV)·dh + d)·p + 2·L·N·d·p (norm inputs kept);
                                       contraction phase only
        edge temporaries (edge)        EDGE_TMP·(H + 2·KV + 1)·N·d·4 (one layer of add_layer_inputs)
        logits                         LOGIT_COPIES·B·V·4
        score matrix (edge)            n_up·n_down·4
        several corruptions            (n_corruptions ≥ 2, SHARED_CLEAN) the batch's recorded clean
                                       run, held through every corruption but the last:
                                       N·(d + L·(H·dh + d))·p + B·V·p (+ L·N·d·p post-norm, edge);
                                       each other corruption's score sums: (C - 1)·(L·H + L + 3)·4,
                                       edge: + (C - 1)·n_up·n_down·4

    At node level the peak is the backward of a gradient pass. At edge level it is the larger
    of that backward and the per-layer contraction after the last backward. The running
    gradient sums exist during a backward only from the second interpolation point on, so
    ig_steps = 1 peaks a little lower (measured: 2-9 % less); from 2 points on ig_steps changes
    time only, not the peak: the m passes run one after another
    and reuse the same sums. `exact` runs no backward: weights, the two cached runs, Δ and
    one no-grad forward. `eap-gp` is EAP-IG's estimate plus its path buffers (the previous
    point, the steering gradient and the next point: 3·N·d·4). `acdc` runs no backward either:
    weights, the corrupted runs of all `num_examples` examples (every test reruns them all) with
    their answer logits, the clean answer logits, and one no-grad forward with the removed edges
    patched (at edge level: the forward's own writes, held until it ends, the differences of the
    patched upstream writes, at most n_up·N·d·4, and one layer's live and corrupted head writes).
    """
    est = _one_corruption(shape, dtype_bytes, batch_size, seq_len, algorithm, level, ig_steps, attn_implementation,
                          ig_rule, num_examples)
    if n_corruptions < 2 or algorithm not in SHARED_CLEAN:  # the others run each corruption on its own
        return est
    s = calibrated(shape)[0]
    p, edges = dtype_bytes, level == "edge"
    L, H, KV, d = s["n_layers"], s["n_heads"], s["n_kv_heads"], s["d_model"]
    N = batch_size * seq_len
    post_norm = edges and s["family"] == "gemma3"  # attn_total recorded per layer
    est.terms["clean run held across corruptions"] = (N * (d + L * (H * s["head_dim"] + d) + (L * d if post_norm else 0))
                                                      * p + batch_size * s["vocab_size"] * p)
    n_up, n_in = 1 + L * (H + 1), L * (H + 2 * KV + 1)
    est.terms["other corruptions' score sums"] = (n_corruptions - 1) * FP32 * (L * H + L + 3
                                                                              + (n_up * (n_in + 1) if edges else 0))
    est.phase = f"{est.phase}, under the first of {n_corruptions} corruptions (the clean run held for the others)"
    return est


def _one_corruption(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int, algorithm: str,
                    level: str, ig_steps: int | None, attn_implementation: str, ig_rule: str,
                    num_examples: int | None) -> MemoryEstimate:
    """`estimate_attribution` under one corruption."""
    s, (c_d, c_f) = calibrated(shape)
    p = dtype_bytes
    L, H, KV, dh = s["n_layers"], s["n_heads"], s["n_kv_heads"], s["head_dim"]
    d, f, V = s["d_model"], s["d_mlp"], s["vocab_size"]
    B, N = batch_size, batch_size * seq_len
    edges = level == "edge"
    n_up = 1 + L * (H + 1)
    n_in = L * (H + 2 * KV + 1)
    node_values = N * (d + L * (H * dh + d))  # embed, z per layer, MLP output per layer
    terms: dict[str, int] = {"weights": s["n_params"] * p, "logits": LOGIT_COPIES * B * V * FP32}
    delta = node_values * FP32 + (n_up * N * d * FP32 if edges else 0)
    if edges:
        terms["score matrix"] = n_up * (n_in + 1) * FP32
    if algorithm == "exact":
        terms["cached clean/corrupted runs"] = 2 * node_values * p
        terms["delta buffer"] = delta
        terms["forward temporaries"] = int(N * p * (FWD_TMP_D * d + FWD_TMP_F * f))
        return MemoryEstimate(terms, phase="exact: no-grad forward with cached runs and Δ")
    if algorithm == "acdc":
        n_all = max(num_examples or batch_size, batch_size)  # the walk keeps every batch's corrupted run
        terms["cached corrupted runs (all examples)"] = ((node_values // B) + V) * n_all * p  # + answer logits
        terms["clean answer logits (all examples)"] = n_all * V * FP32
        terms["forward temporaries"] = int(N * p * (FWD_TMP_D * d + FWD_TMP_F * f))
        if edges:
            # this forward's writes stay referenced until it ends (the shifts read them); one
            # difference per patched upstream row; one layer's live and corrupted head writes
            terms["live writes held"] = node_values * p
            terms["patched write differences"] = n_up * N * d * FP32
            terms["patch temporaries"] = (2 * H + 2) * N * d * FP32
        else:  # each removed head's hook copies its layer's z: the input and one copy alive
            terms["patch temporaries"] = 2 * H * dh * N * p
        return MemoryEstimate(terms, phase="acdc: one no-grad forward with the removed edges patched")
    if algorithm == "eap-gp":
        terms["path buffers"] = 3 * N * d * FP32
    # eap-ig-activations and eap-gp: the same passes one after another (eap-ig's points), one set of sums live
    rule_of = "eap-ig" if algorithm in ("eap-ig-activations", "eap-gp") else algorithm
    n_points = integration_rule(rule_of, ig_steps, ig_rule).passes
    acts = N * p * (ACT_BASE * d + L * (c_d * d + c_f * f))
    if attn_implementation == "eager":
        acts += EAGER_ATTN_PER_LAYER * L * B * H * seq_len**2 * p
    terms["delta buffer"] = delta
    terms["cached clean/corrupted runs"] = 3 * N * d * max(p, FP32)
    node_sums = node_values * FP32
    bwd_tmp = N * p * (BWD_TMP_D * d + BWD_TMP_F * f)
    running = n_points >= 2  # sums allocated by an earlier pass are live during this backward
    if not edges:
        terms["activations saved for backward"] = int(acts)
        terms["backward temporaries"] = int(bwd_tmp)
        terms["gradient sums"] = node_sums if running else 0
        return MemoryEstimate(terms, phase="backward of a gradient pass")
    input_sums = (n_in + 1) * N * d * FP32
    saved_grads = L * N * ((H + 2 * KV) * dh + d) * p + 2 * L * N * d * p
    edge_tmp = EDGE_TMP * (H + 2 * KV + 1) * N * d * FP32
    backward = acts + bwd_tmp + ((node_sums + input_sums) if running else 0)
    contraction = node_sums + input_sums + saved_grads + edge_tmp
    if backward >= contraction:
        terms["activations saved for backward"] = int(acts)
        terms["backward temporaries"] = int(bwd_tmp)
        terms["gradient sums"] = (node_sums + input_sums) if running else 0
        phase = "backward of a gradient pass"
    else:
        terms["gradient sums"] = node_sums + input_sums
        terms["saved input gradients"] = saved_grads
        terms["edge temporaries"] = int(edge_tmp)
        phase = "per-layer contraction of input gradients"
    return MemoryEstimate(terms, phase=phase)


def attribution_estimate(cfg: Any, batch_size: int | None = None, seq_len: int | None = None) -> MemoryEstimate:
    """Estimated peak of the attribution stage for `cfg` (optionally another batch size / length).

    The sequence length is `discovery.data_params.seq_len`: the induction task's length, and the
    length assumed for tasks whose prompts are only known after tokenizing.
    """
    d = cfg.discovery
    shape = shape_for(cfg.model)
    dtype_bytes = model_dtype(cfg.model).itemsize  # the dtype the run uses (auto resolved)
    return estimate_attribution(shape, dtype_bytes, batch_size or d.batch_size, seq_len or d.data_params.seq_len,
                                d.algorithm, d.level, d.ig_steps, num_examples=d.data_params.num_examples,
                                n_corruptions=max(len(discovery_corruptions(d.task, d.data_params)), 1))


def largest_fitting_batch(cfg: Any, budget_bytes: int, limit: int = 1024) -> int:
    """The largest discovery.batch_size whose estimate fits `budget_bytes` (0 if even 1 does not)."""
    return largest_fitting(lambda b: attribution_estimate(cfg, batch_size=b).total_bytes <= budget_bytes, limit)


def advice(cfg: Any, budget_bytes: int) -> list[str]:
    """Knobs that bring the attribution peak under `budget_bytes`, in the order to try them."""
    tips = []
    best = largest_fitting_batch(cfg, budget_bytes)
    if 0 < best < cfg.discovery.batch_size:
        tips.append(f"discovery.batch_size={best} (largest that fits; scores do not depend on the batch size)")
    elif best == 0:
        seq = cfg.discovery.data_params.seq_len
        while seq > 8 and attribution_estimate(cfg, batch_size=1, seq_len=seq).total_bytes > budget_bytes:
            seq //= 2
        if attribution_estimate(cfg, batch_size=1, seq_len=seq).total_bytes <= budget_bytes:
            tips.append(f"discovery.batch_size=1 with discovery.data_params.seq_len={seq} (shorter prompts)")
        if cfg.discovery.level == "edge":
            tips.append("discovery.level=node (no per-edge Δ and gradient buffers)")
        if model_dtype(cfg.model) == torch.float32:
            tips.append("model.precision=bfloat16 (half the weight and activation bytes)")
        tips.append("a device with more memory, or a smaller model")
    return tips


def ig_advice(cfg: Any) -> str | None:
    """The speed/accuracy line for EAP-IG (None for other algorithms or without a measured table)."""
    d = cfg.discovery
    if d.algorithm == "eap-ig-activations":  # O(m x layers): one interpolation per group of nodes
        L = shape_for(cfg.model)["n_layers"]
        m = integration_rule("eap-ig", d.ig_steps, d.ig_rule).passes
        return (f"eap-ig-activations runs ig_steps x (2 x layers + 1) = {m} x {2 * L + 1} = {m * (2 * L + 1)}"
                f" forward+backward passes per batch ({2 * L + 1}x EAP-IG-inputs at the same ig_steps); its peak"
                " is one such pass's")
    if d.algorithm == "eap-gp":
        m = integration_rule("eap-ig", d.ig_steps, d.ig_rule).passes
        return (f"eap-gp runs ig_steps = {m} forward+backward passes per batch, as EAP-IG, along a path it builds"
                " from their gradients (no extra pass); its peak is EAP-IG's plus 3 float32 copies of the input"
                " embeddings")
    if d.algorithm == "acdc":
        s = shape_for(cfg.model)
        L, H, KV = s["n_layers"], s["n_heads"], s["n_kv_heads"]
        n_up, n_in = 1 + L * (H + 1), L * (H + 2 * KV + 1)
        tested = (Graph(L, H, KV, False).n_edges if d.level == "edge" else L * (H + 1) + 1)
        batches = -(-d.data_params.num_examples // d.batch_size)
        return (f"acdc runs one forward over all {d.data_params.num_examples} examples per {d.level} tested: at most"
                f" {tested} tests x {batches} batches = {tested * batches} forward passes (edges into a node that no"
                f" longer reaches the logits are removed without one; graph {n_up} x {n_in + 1}); its peak is one"
                " forward's plus the corrupted runs of every example")
    return advice_line(d.algorithm, d.level, d.ig_steps, d.ig_rule, cfg.preflight.ig_error_budget)


ATTRIBUTION_MEMORY = StageMemory(estimate=attribution_estimate, advice=advice, note=ig_advice)
