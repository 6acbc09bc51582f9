"""The model's shape and the terms shared by the peak-memory estimates of the stages.

No weights are loaded: the shape comes from `model.shape` in the config (known models in
`conf/model/*.yaml`) or from the model's `config.json`. Each stage owns its estimate
(`circuitkit.attribution.memory` for attribution, `gradian.memory` for gradient indexing);
this module holds what they share: `MemoryEstimate`, the shape, the parameter count and the
activations autograd saves per layer. Notation used in the formulas:

    B batch size, T tokens, N = B·T, L layers, H query heads, KV key/value heads, dh head width,
    d = d_model, f = d_mlp, V vocabulary, P parameters, p bytes per element of the model dtype,
    n_up = 1 + L·(H + 1)            upstream nodes (embedding, every head, every MLP)
    n_in = L·(H + 2·KV + 1)         residual-space inputs (Q per head, K and V per KV head, MLP)
    n_down = n_in + 1               downstream columns of the edge score matrix (+ logits)

See `circuitkit.attribution.memory.estimate_attribution` and `gradian.memory.estimate_grads`
for the terms and how their coefficients were measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from circuitkit.config import ModelConfig, ModelShape, choices
from circuitkit.models.adapters import MODEL_TYPE_FAMILIES
from circuitkit.models.loading import auto_config, pretrained_args

MiB = 2**20
FP32 = 4
SHAPE_KEYS = ("family", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "d_mlp", "vocab_size",
              "n_params")
FAMILIES = choices(ModelShape, "family")

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
    """The shape dict (keys SHAPE_KEYS, plus the config's `model_type`) of a Hugging Face config;
    Gemma 3's `text_config` is used.

    n_params counts the text model (for a multimodal Gemma 3 checkpoint the vision tower is not
    included; `conf/model/gemma4b.yaml` carries the whole checkpoint's count).
    """
    cfg = getattr(hf_config, "text_config", None) or hf_config
    model_type = getattr(cfg, "model_type", None)
    fam = MODEL_TYPE_FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"model_type {model_type!r} has no memory estimate; known: {', '.join(sorted(MODEL_TYPE_FAMILIES))}")
    extra: dict[str, Any] = {"tied": getattr(hf_config, "tie_word_embeddings", None)}
    # The outer model_type says which class holds the blocks (Gemma 3: text-only or multimodal),
    # which decides their module names (circuitkit.models.linear_modules).
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
    shape["model_type"] = getattr(hf_config, "model_type", model_type)
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
    path, kwargs = pretrained_args(model_cfg)
    hf = auto_config(path, kwargs, model_cfg.revision, model_cfg.trust_remote_code)
    shape = shape_from_config(hf)
    shape.update({k: v for k, v in values.items() if v is not None})  # explicit yaml values win
    return shape


def shape_dict(shape: dict[str, Any] | ModelShape) -> dict[str, Any]:
    """The shape as a plain dict (keys SHAPE_KEYS), from a dict or a ModelShape."""
    if isinstance(shape, dict):
        return shape
    return {k: getattr(shape, k) for k in SHAPE_KEYS}


def calibrated(shape: dict[str, Any] | ModelShape) -> tuple[dict[str, Any], tuple[float, float]]:
    """(the shape as a dict, its family's ACT_PER_LAYER coefficients (c_d, c_f)): what every
    estimate starts from; ValueError for a family without measured coefficients."""
    s = shape_dict(shape)
    if s["family"] not in ACT_PER_LAYER:
        raise ValueError(f"family {s['family']!r} has no calibrated estimate; known: {', '.join(FAMILIES)}")
    return s, ACT_PER_LAYER[s["family"]]


def largest_fitting(fits, limit: int = 1024) -> int:
    """Largest n in 1..limit with fits(n) (fits is monotone, e.g. "the estimate at batch size n
    is under the budget"), 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
