"""Closed-form peak-memory estimates of attribution, from the model's shape alone.

No weights are loaded: the shape comes from `model.shape` in the config (known models in
`conf/model/*.yaml`) or from the model's `config.json`. Notation used in the formulas:

    B batch size, T tokens, N = B·T, L layers, H query heads, KV key/value heads, dh head width,
    d = d_model, f = d_mlp, V vocabulary, P parameters, p bytes per element of the model dtype,
    n_up = 1 + L·(H + 1)            upstream nodes (embedding, every head, every MLP)
    n_in = L·(H + 2·KV + 1)         residual-space inputs (Q per head, K and V per KV head, MLP)
    n_down = n_in + 1               downstream columns of the edge score matrix (+ logits)

See `estimate_attribution` for the terms and how their coefficients were measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from circuitkit.config import ModelConfig, ModelShape

MiB = 2**20
FP32 = 4
SHAPE_KEYS = ("family", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "d_mlp", "vocab_size",
              "n_params")
FAMILIES = ("gpt2", "gpt_neox", "llama", "gemma3")
# Hugging Face model_type -> family (Qwen2 and Mistral are Llama-shaped).
MODEL_TYPES = {"gpt2": "gpt2", "gpt_neox": "gpt_neox", "llama": "llama", "qwen2": "llama", "mistral": "llama",
               "gemma3": "gemma3", "gemma3_text": "gemma3"}

# Activations autograd saves for the backward of one forward pass, per layer, in units of N·d and
# N·f elements of the model dtype, plus ACT_BASE·N·d outside the blocks (embedding output, final
# norm). Measured with torch.autograd.graph.saved_tensors_hooks counting the unique storages saved
# during one forward with frozen parameters (parameters excluded), float32, sdpa attention, on
# random models with d = 64, 4 heads (2 KV heads for llama / gemma3), L ∈ {1, 2}, f ∈ {256, 512},
# N ∈ {64, 128, 256}: exactly linear in N, L and f, no T² term (sdpa keeps only q, k, v, the
# output and a logsumexp per head and token). Frozen linears save nothing for their weights, so
# e.g. GPT-NeoX's MLP saves only the GELU input (1·f); GPT-2's tanh-GELU saves 4·f; the gated
# MLPs (llama, gemma3) save gate, up and act(gate) (3·f).
ACT_PER_LAYER: dict[str, tuple[float, float]] = {  # family: (c_d, c_f)
    "gpt2": (8.125, 4.0),
    "gpt_neox": (5.125, 1.0),
    "llama": (5.09, 3.0),
    "gemma3": (8.79, 3.0),
}
ACT_BASE = 1.25
# Eager attention also saves the (B, H, T, T) softmax output (not calibrated: the fixtures use sdpa).
EAGER_ATTN_PER_LAYER = 1.0

# Gradient buffers alive at the peak of a backward pass, in units of N·d and N·f elements of the
# model dtype. Fitted to measure_peak (CPU dispatch tracker) at node level, ig_steps = 5, on the full
# sweep of scripts/check_memory_estimates.py: measured minus every other term was 6.5·N·d for the
# GPT-2-small shape (f = 4d, so 2·d + 1·f = 6·d) and 5.75·N·d for tiny GPT-NeoX (6·d).
BWD_TMP_D = 2.0
BWD_TMP_F = 1.0
# One no-grad forward pass (exact patching, cached runs): transient activations, same units.
FWD_TMP_D = 4.0
FWD_TMP_F = 2.0
# Temporaries of `_GradientSums.add_layer_inputs` for one layer, in units of its (H + 2·KV + 1)·N·d
# float32 rows: einsum output and norm_backward intermediates for Q, K, V, the parts list, the
# torch.cat result and (first step) its float32 copy. Fitted at edge level with ig_steps = 1 (where
# this phase is the peak): 2.2 leaves ≤ 2 % over the measurement for GPT-2-small and tiny GPT-2.
EDGE_TMP = 2.2
# Answer logits: (B, V) in the model dtype, its float32 copy, the clean copy, softmax / gradients.
LOGIT_COPIES = 4


@dataclass
class MemoryEstimate:
    """Peak device bytes, broken into named terms (bytes)."""

    terms: dict[str, int] = field(default_factory=dict)
    phase: str = ""  # which part of the algorithm the peak falls in
    index_bytes: int = 0  # on-disk bytes (estimate_grads): not device memory, not in total_bytes

    @property
    def total_bytes(self) -> int:
        return int(sum(self.terms.values()))

    def table(self, title: str | None = None) -> Table:
        """A rich table: term, MiB, share of the total."""
        total = max(self.total_bytes, 1)
        default = f"estimated peak memory ({self.phase})" if self.phase else "estimated peak memory"
        table = Table(title=title or default)
        table.add_column("term")
        table.add_column("MiB", justify="right")
        table.add_column("share", justify="right")
        for name, nbytes in sorted(self.terms.items(), key=lambda kv: -kv[1]):
            table.add_row(name, f"{nbytes / MiB:.1f}", f"{100 * nbytes / total:.1f}%")
        table.add_row("total", f"{self.total_bytes / MiB:.1f}", "100%", style="bold")
        return table


# --------------------------------------------------------------------------- shapes

def count_params(shape: dict[str, Any], *, tied: bool | None = None, n_positions: int = 1024,
                 qkv_bias: bool | None = None, o_bias: bool | None = None, mlp_bias: bool | None = None) -> int:
    """Parameter count in closed form from the shape (P in the module docstring).

    With d_q = H·dh and d_kv = KV·dh:

        gpt2:     V·d + n_pos·d + L·[2·2d + (d·3d + 3d) + (d·d + d) + (d·f + f) + (f·d + d)] + 2d
        gpt_neox: 2·V·d (untied unembedding) + L·[2·2d + (d·3d + 3d) + (d·d + d) + (d·f + f) + (f·d + d)] + 2d
        llama:    V·d (+ V·d untied) + L·[2d + d·(d_q + 2·d_kv) + d_q·d + 3·d·f] + d  (+ biases)
        gemma3:   llama with 4 norms per layer and q/k norms of width dh: + L·(2d + 2dh)

    Defaults when not given: tied embeddings except GPT-NeoX; biases as in the family's
    reference models (none for llama / gemma3).
    """
    fam = shape["family"]
    L, H, KV, dh = shape["n_layers"], shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    d, f, V = shape["d_model"], shape["d_mlp"], shape["vocab_size"]
    if fam in ("gpt2", "gpt_neox"):
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        if tied is None:
            tied = fam == "gpt2"
        embed = V * d * (1 if tied else 2) + (n_positions * d if fam == "gpt2" else 0)
        return embed + L * block + 2 * d
    if fam in ("llama", "gemma3"):
        dq, dkv = H * dh, KV * dh
        qkv_bias = bool(qkv_bias)
        o_bias = bool(o_bias)
        mlp_bias = bool(mlp_bias)
        attn = d * (dq + 2 * dkv) + dq * d + (dq + 2 * dkv if qkv_bias else 0) + (d if o_bias else 0)
        mlp = 3 * d * f + (2 * f + d if mlp_bias else 0)
        norms = 2 * d if fam == "llama" else 4 * d + 2 * dh
        if tied is None:
            tied = True
        return V * d * (1 if tied else 2) + L * (attn + mlp + norms) + d
    raise ValueError(f"family {fam!r} has no closed-form parameter count; known: {', '.join(FAMILIES)}")


def shape_from_config(hf_config: Any) -> dict[str, Any]:
    """The shape dict (keys SHAPE_KEYS) of a Hugging Face config; Gemma 3's `text_config` is used.

    n_params counts the text model (for a multimodal Gemma 3 checkpoint the vision tower is not
    included; `conf/model/gemma4b.yaml` carries the whole checkpoint's count).
    """
    cfg = getattr(hf_config, "text_config", None) or hf_config
    model_type = getattr(cfg, "model_type", None)
    fam = MODEL_TYPES.get(model_type)
    if fam is None:
        raise ValueError(f"model_type {model_type!r} has no memory estimate; known: {', '.join(sorted(MODEL_TYPES))}")
    extra: dict[str, Any] = {"tied": getattr(hf_config, "tie_word_embeddings", None)}
    if fam == "gpt2":
        d, H = cfg.n_embd, cfg.n_head
        shape = {"n_layers": cfg.n_layer, "n_heads": H, "n_kv_heads": H, "head_dim": d // H, "d_model": d,
                 "d_mlp": cfg.n_inner or 4 * d}
        extra["n_positions"] = cfg.n_positions
    else:
        d, H = cfg.hidden_size, cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or d // H
        kv = getattr(cfg, "num_key_value_heads", None) or H
        shape = {"n_layers": cfg.num_hidden_layers, "n_heads": H, "n_kv_heads": kv, "head_dim": head_dim,
                 "d_model": d, "d_mlp": cfg.intermediate_size}
        if fam == "llama":
            bias = bool(getattr(cfg, "attention_bias", False))
            extra.update(qkv_bias=bias or model_type == "qwen2", o_bias=bias,
                         mlp_bias=bool(getattr(cfg, "mlp_bias", False)))
        elif fam == "gemma3":
            bias = bool(getattr(cfg, "attention_bias", False))
            extra.update(qkv_bias=bias, o_bias=bias)
    shape = {"family": fam, **shape, "vocab_size": cfg.vocab_size}
    shape["n_params"] = count_params(shape, **extra)
    return shape


def shape_for(model_cfg: ModelConfig) -> dict[str, Any]:
    """Shape of the configured model: `model.shape` when every field is set, else its config.json.

    Only the config is read (`AutoConfig.from_pretrained`), never weights; `builtin:NAME`
    resolves to the local fixture directory.
    """
    given = model_cfg.shape
    values = {k: getattr(given, k, None) if not isinstance(given, dict) else given.get(k) for k in SHAPE_KEYS}
    if all(v is not None for v in values.values()):
        return values
    from transformers import AutoConfig

    from circuitkit.models.loading import resolve_model_path

    path = resolve_model_path(model_cfg.name)
    hf = AutoConfig.from_pretrained(path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code)
    shape = shape_from_config(hf)
    shape.update({k: v for k, v in values.items() if v is not None})  # explicit yaml values win
    return shape


def _shape_dict(shape: dict[str, Any] | ModelShape) -> dict[str, Any]:
    if isinstance(shape, dict):
        return shape
    return {k: getattr(shape, k) for k in SHAPE_KEYS}


# --------------------------------------------------------------------------- estimates

def estimate_attribution(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int,
                         algorithm: str = "eap-ig", level: str = "node", ig_steps: int | None = 5,
                         attn_implementation: str = "sdpa", ig_rule: str = "right") -> MemoryEstimate:
    """Peak device bytes of one attribution batch (`circuitkit.attribution.eap.attribute`).

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

    At node level the peak is the backward of a gradient pass. At edge level it is the larger
    of that backward and the per-layer contraction after the last backward. The running
    gradient sums exist during a backward only from the second interpolation point on, so
    ig_steps = 1 peaks a little lower (measured: 2-9 % less); from 2 points on ig_steps changes
    time only, not the peak: the m passes run one after another
    and reuse the same sums. `exact` runs no backward: weights, the two cached runs, Δ and
    one no-grad forward.
    """
    s = _shape_dict(shape)
    fam = s["family"]
    if fam not in ACT_PER_LAYER:
        raise ValueError(f"family {fam!r} has no calibrated estimate; known: {', '.join(FAMILIES)}")
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
    from circuitkit.attribution.quadrature import integration_rule

    n_points = integration_rule(algorithm, ig_steps, ig_rule).passes
    c_d, c_f = ACT_PER_LAYER[fam]
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


# --------------------------------------------------------------------------- gradient indexing

# Calibration of `estimate_grads` (gradian.capture.per_example_gradients). Measured with the CPU
# dispatch tracker of `measure_peak`, float32, sdpa, frozen parameters, on the tiny GPT-2 / Llama
# shapes of scripts/check_memory_estimates.py (vocab 1024 and 50257) with mlp.c_proj / down_proj
# and with every block linear selected, B = 4, prompt 16 / 64 / 240, supervised 8 / 16 / 32; the
# live bytes were read at the start of `backward()` and the peaks before and after it:
# * Saved activations are the attribution coefficients ACT_PER_LAYER, counted only from the first
#   selected module on (autograd's graph starts there): measured 25.2·N·d (GPT-2, c_proj: one
#   full layer + ACT_BASE = 25.4 predicted) and 12.4·N·d (Llama, down_proj: 12.3 predicted).
# * The (N_s, V) tensors: the forward holds the (upcast) logits and the saved float32
#   log-softmax; the peak is inside the log-softmax backward, with three float32 (N_s, V) tensors
#   live (saved log-softmax, its gradient, the logits' gradient): measured 3.03-3.07·N_s·V·4 over
#   the activations on the 50257-vocabulary tiny models. LOGIT_F32_COPIES = 3.
# * Forward temporaries of one block (GELU / SiLU intermediates) above the saved activations:
#   measured 15-17·N·d for GPT-2 (f = 4d) and 7.9-8.9·N·d for Llama (f = 2d): GRADS_FWD_TMP_F = 4
#   (units N·f·p). Alive only while no (N_s, V) tensor is, so the peak takes the larger of the two.
LOGIT_F32_COPIES = 3
GRADS_FWD_TMP_F = 4.0
# The first selected module's own block: a module in the attention keeps the whole block's
# activations, an MLP input projection the MLP's (c_f·f), an MLP output projection nothing.
_MLP_IN = ("c_fc", "gate_proj", "up_proj", "dense_h_to_4h", "fc1", "fc_in")
_MLP_OUT = ("c_proj", "down_proj", "dense_4h_to_h", "fc2", "fc_out")
# Index: per row float32 norm + int64 row id next to the stored gradient row.
INDEX_ROW_EXTRA_BYTES = 4 + 8


def _graph_layers(module_names: list[str], n_layers: int, c_d: float, c_f: float, d: int, f: int) -> float:
    """Activations autograd saves per token (units of elements), from the first selected module on.

    Layers after the first selected one count c_d·d + c_f·f; the first one its share by the
    module's kind (attention: all of it; MLP input: c_f·f; MLP output: none).
    """
    if not module_names:
        return n_layers * (c_d * d + c_f * f)
    first_layer, first_name = n_layers, ""
    for name in module_names:
        m = re.search(r"\.(\d+)\.", f".{name}.")
        layer = int(m.group(1)) if m else 0
        if layer < first_layer:
            first_layer, first_name = layer, name
    leaf = first_name.rsplit(".", 1)[-1]
    parent = first_name.rsplit(".", 2)[-2] if first_name.count(".") >= 1 else ""
    if leaf in _MLP_IN:
        share = c_f * f
    elif leaf in _MLP_OUT and "attn" not in parent and "attention" not in parent:
        share = 0.0
    else:
        share = c_d * d + c_f * f
    return max(0, n_layers - first_layer - 1) * (c_d * d + c_f * f) + share


def grads_index_bytes(n_rows: int, width: int, storage_dtype_bytes: int) -> int:
    """Bytes of a gradient index on disk (gradian.index), headers excluded:

        n_rows · (width · s + 4 + 8)      s = bytes of grads.storage_dtype; float32 norm, int64 row id

    Each shard adds a safetensors header (a few hundred bytes) and the index one manifest.json
    (a few kB); both are independent of the row count.
    """
    return int(n_rows * (width * storage_dtype_bytes + INDEX_ROW_EXTRA_BYTES))


def estimate_grads(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int,
                   supervised_per_row: int, module_shapes: dict[str, tuple[int, int]],
                   projection_kind: str = "kronecker", projection_dim: int | None = None,
                   storage_dtype_bytes: int = 2, n_rows: int = 0) -> MemoryEstimate:
    """Peak device bytes of one gradient-indexing batch (`gradian.capture.per_example_gradients`).

    seq_len is the padded row length (prompt + answer), supervised_per_row the targets per row;
    N = B·seq_len tokens, N_s = B·supervised_per_row supervised targets, module_shapes name ->
    (d_out, d_in) of the selected modules, k_i the kronecker input factor of a module
    (`gradian.projection.kronecker_factors`), width its row width. Terms:

        weights                         P·p
        activations saved for backward  N·p·(ACT_BASE·d + A),  A = per-family ACT_PER_LAYER
                                        from the first selected module on (`_graph_layers`)
        capture buffers                 kronecker: Σ_i N·k_i·4; raw / dense: Σ_i N·d_in·4 (the
                                        masked inputs); dense also B·d_out·d_in·4 (G of one
                                        module). The (B, width) rows are made by the module
                                        gradient hooks, after the peak, and are not counted
        projection matrices             kronecker Σ (k_o·d_out + k_i·d_in)·4; dense Σ min(k·d_out·d_in,
                                        cache) or one 4096-column chunk; raw 0
        logits (model dtype)            N_s·V·p
        fp32 logit upcast               N_s·V·4       (the allocation the OOM page is about)
        cross-entropy buffers           N_s·V·(4·LOGIT_F32_COPIES − 4 − p): with the two above, the
                                        three float32 (N_s, V) tensors of the log-softmax backward
        forward temporaries             max(0, GRADS_FWD_TMP_F·N·f·p − LOGIT_F32_COPIES·N_s·V·4):
                                        one block's transients, which peak when the vocabulary-
                                        sized tensors are not alive, so only their excess counts

    Only the supervised hidden states reach the unembedding, so no term but the activations grows
    with prompt length; the logit terms are linear in N_s. `index_bytes` (attribute, not in the
    total: it is disk) is `grads_index_bytes(n_rows, Σ width, storage_dtype_bytes)`.
    """
    from gradian.projection import _DENSE_CACHE_BYTES, _DENSE_CHUNK_COLS, kronecker_factors

    s = _shape_dict(shape)
    fam = s["family"]
    if fam not in ACT_PER_LAYER:
        raise ValueError(f"family {fam!r} has no calibrated estimate; known: {', '.join(FAMILIES)}")
    p = dtype_bytes
    d, f, V = s["d_model"], s["d_mlp"], s["vocab_size"]
    B, N, Ns = batch_size, batch_size * seq_len, batch_size * supervised_per_row
    kind = "raw" if projection_dim is None else projection_kind
    c_d, c_f = ACT_PER_LAYER[fam]
    acts = N * p * (ACT_BASE * d + _graph_layers(list(module_shapes), s["n_layers"], c_d, c_f, d, f))
    capture = matrices = width = 0
    max_g = 0
    for name, (d_out, d_in) in module_shapes.items():
        w = d_out * d_in if projection_dim is None else projection_dim
        width += w
        if kind.startswith("kronecker"):  # kronecker, kronecker_orthogonal: same factors and buffers
            k_o, k_i = kronecker_factors(projection_dim, d_out, d_in, name)
            capture += N * k_i * FP32
            matrices += (k_o * d_out + k_i * d_in) * FP32
        else:
            capture += N * d_in * FP32
            if kind == "dense":
                full = projection_dim * d_out * d_in * FP32
                matrices += full if full <= _DENSE_CACHE_BYTES else projection_dim * _DENSE_CHUNK_COLS * FP32
                max_g = max(max_g, B * d_out * d_in * FP32)
    capture += max_g  # the (B, width) rows appear after the peak (module grad hooks run later)
    logits_f32 = LOGIT_F32_COPIES * Ns * V * FP32
    terms = {
        "weights": s["n_params"] * p,
        "activations saved for backward": int(acts),
        "capture buffers": int(capture),
        "projection matrices": int(matrices),
        "logits (model dtype)": Ns * V * p,
        "fp32 logit upcast": Ns * V * FP32,
        "cross-entropy buffers": Ns * V * (FP32 * LOGIT_F32_COPIES - FP32 - p),
        "forward temporaries": int(max(0.0, GRADS_FWD_TMP_F * N * f * p - logits_f32)),
    }
    est = MemoryEstimate(terms, phase="log-softmax backward" if terms["forward temporaries"] == 0
                         else "forward of the last block")
    est.index_bytes = grads_index_bytes(n_rows, width, storage_dtype_bytes)
    return est


def module_pattern_matches(name: str, pattern: str) -> bool:
    """grads.module_filter semantics: a glob ("*.mlp.c_proj") matches the whole module name,
    a plain pattern ("down_proj") is a substring."""
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name


_LINEAR_LAYOUT = {  # family -> (block prefix, [(module suffix, (d_out, d_in) as a function of the shape)])
    "gpt2": ("transformer.h.{l}.", [("attn.c_attn", lambda s: (3 * s["n_heads"] * s["head_dim"], s["d_model"])),
                                     ("attn.c_proj", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
                                     ("mlp.c_fc", lambda s: (s["d_mlp"], s["d_model"])),
                                     ("mlp.c_proj", lambda s: (s["d_model"], s["d_mlp"]))]),
    "gpt_neox": ("gpt_neox.layers.{l}.", [
        ("attention.query_key_value", lambda s: (3 * s["n_heads"] * s["head_dim"], s["d_model"])),
        ("attention.dense", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
        ("mlp.dense_h_to_4h", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.dense_4h_to_h", lambda s: (s["d_model"], s["d_mlp"]))]),
    "llama": ("model.layers.{l}.", [
        ("self_attn.q_proj", lambda s: (s["n_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.k_proj", lambda s: (s["n_kv_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.v_proj", lambda s: (s["n_kv_heads"] * s["head_dim"], s["d_model"])),
        ("self_attn.o_proj", lambda s: (s["d_model"], s["n_heads"] * s["head_dim"])),
        ("mlp.gate_proj", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.up_proj", lambda s: (s["d_mlp"], s["d_model"])),
        ("mlp.down_proj", lambda s: (s["d_model"], s["d_mlp"]))]),
}
_LINEAR_LAYOUT["gemma3"] = ("model.language_model.layers.{l}.", _LINEAR_LAYOUT["llama"][1])


def linear_module_shapes(shape: dict[str, Any], patterns: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Linear modules of the blocks as name -> (d_out, d_in), from the shape alone (no model),
    filtered like grads.module_filter; names follow the Hugging Face modules of each family."""
    s = _shape_dict(shape)
    prefix, layout = _LINEAR_LAYOUT[s["family"]]
    out = {}
    for layer in range(s["n_layers"]):
        for suffix, dims in layout:
            name = prefix.format(l=layer) + suffix
            if not patterns or any(module_pattern_matches(name, p) for p in patterns):
                out[name] = dims(s)
    return out


def circuit_module_shapes(shape: dict[str, Any], head_mask: Any | None = None,
                          mlp_mask: Any | None = None) -> dict[str, tuple[int, int]]:
    """Sites of a circuit-restricted index (`gradian.restrict`) as name -> (d_out, d_in), from the
    shape alone: per kept head its (d_model, head_dim) block of the attention output projection,
    per kept MLP its output projection. head_mask (L, H) / mlp_mask (L,) None = all kept (the
    upper bound used before the pruning stage has written the circuit)."""
    s = _shape_dict(shape)
    prefix, layout = _LINEAR_LAYOUT[s["family"]]
    # The attention output projection is the 2nd attention linear of every layout; the MLP
    # output projection is the last linear.
    o_suffix = {"gpt2": "attn.c_proj", "gpt_neox": "attention.dense"}.get(s["family"], "self_attn.o_proj")
    mlp_out = layout[-1]
    out: dict[str, tuple[int, int]] = {}
    for layer in range(s["n_layers"]):
        for h in range(s["n_heads"]):
            if head_mask is None or bool(head_mask[layer][h]):
                out[f"{prefix.format(l=layer)}{o_suffix}:head{h}"] = (s["d_model"], s["head_dim"])
        if mlp_mask is None or bool(mlp_mask[layer]):
            out[prefix.format(l=layer) + mlp_out[0]] = mlp_out[1](s)
    return out
