"""Llama, Mistral and Qwen2: model.layers[l]: input_layernorm -> self_attn.{q,k,v}_proj ->
o_proj; post_attention_layernorm -> mlp (gate_proj, up_proj -> down_proj). Qwen2 adds q/k/v
biases. The families built on these names (Gemma 3, Qwen3) subclass `Llama`.
"""

from __future__ import annotations

from typing import Any

from circuitkit.models.families.base import ATTENTION, MLP_IN, MLP_OUT, ModelAdapter

LLAMA_PATHS = {"base": "model", "blocks": "layers", "embed": "embed_tokens", "final_norm": "norm",
               "attn": "self_attn", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "mlp": "mlp", "attn_out": "self_attn.o_proj", "mlp_out": "mlp.down_proj"}


def attention_layout(s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
    """q, k, v and o projections of Llama-named attention."""
    dq, dkv, d = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"], s["d_model"]
    return [("self_attn.q_proj", ATTENTION, (dq, d)), ("self_attn.k_proj", ATTENTION, (dkv, d)),
            ("self_attn.v_proj", ATTENTION, (dkv, d)), ("self_attn.o_proj", ATTENTION, (d, dq))]


def attention_params(s: dict[str, Any], qkv_bias: bool, o_bias: bool) -> int:
    """d·(d_q + 2·d_kv) + d_q·d (+ biases), d_q = H·dh, d_kv = KV·dh."""
    dq, dkv, d = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"], s["d_model"]
    return d * (dq + 2 * dkv) + dq * d + (dq + 2 * dkv if qkv_bias else 0) + (d if o_bias else 0)


class Llama(ModelAdapter):
    """Llama, Mistral and Qwen2 share module names (Qwen2 adds q/k/v biases)."""

    family = "llama"
    listed = 2
    model_types = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
    gguf_model_types = ("llama", "mistral", "qwen2")
    paths = LLAMA_PATHS
    block_prefix = "model.layers.{l}."
    # The gated MLP saves gate, up and act(gate) (3·f).
    act_per_layer = (5.09, 3.0)
    norms_per_layer = 2  # d-wide norms of a block
    qk_norms = False  # per-head q/k norms of width head_dim (Gemma 3, Qwen3)
    # attention_bias adds q/k/v/o biases; Mistral's and Qwen2's o_proj has none, whatever the config.
    attention_bias_fields = {"llama": "attention_bias"}

    @classmethod
    def linear_layout(cls, s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
        d, f = s["d_model"], s["d_mlp"]
        return [*attention_layout(s), ("mlp.gate_proj", MLP_IN, (f, d)), ("mlp.up_proj", MLP_IN, (f, d)),
                ("mlp.down_proj", MLP_OUT, (d, f))]

    @classmethod
    def count_extras(cls, cfg: Any, hf_config: Any) -> dict[str, Any]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {**super().count_extras(cfg, hf_config), "qkv_bias": bias or cfg.model_type == "qwen2",
                "o_bias": bias, "mlp_bias": bool(getattr(cfg, "mlp_bias", False))}

    @classmethod
    def count_params(cls, shape: dict[str, Any], *, tied: bool | None = None, qkv_bias: bool | None = None,
                     o_bias: bool | None = None, mlp_bias: bool | None = None, **_: Any) -> int:
        """V·d (+ V·d untied) + L·[norms + d·(d_q + 2·d_kv) + d_q·d + 3·d·f] + d (+ biases); norms
        2d (Llama), 4d + 2dh (Gemma 3), 2d + 2dh (Qwen3). Tied and bias-free unless told."""
        d, f, V = shape["d_model"], shape["d_mlp"], shape["vocab_size"]
        attn = attention_params(shape, bool(qkv_bias), bool(o_bias))
        mlp = 3 * d * f + (2 * f + d if mlp_bias else 0)
        norms = cls.norms_per_layer * d + (2 * shape["head_dim"] if cls.qk_norms else 0)
        tied = True if tied is None else tied
        return V * d * (1 if tied else 2) + shape["n_layers"] * (attn + mlp + norms) + d
