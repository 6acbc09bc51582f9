"""Qwen3: Llama names plus per-head q_norm / k_norm (RMSNorm of width head_dim on each head's
query and key, before RoPE); no q/k/v biases unless `attention_bias`.
"""

from __future__ import annotations

from circuitkit.models.families.llama import Llama


class Qwen3(Llama):
    """Qwen3: Llama with per-head q/k norms."""

    family = "qwen3"
    listed = 4
    model_types = {"qwen3": "Qwen3"}
    gguf_model_types = ("qwen3",)
    # Measured with scripts/tools/measure_act_coefficients.py on tiny-qwen3's shape (d 64, head_dim 16):
    # Llama's 5.09 plus what the per-head q/k norms save (1.6·N·d here).
    act_per_layer = (6.69, 3.0)
    qk_norms = True
    attention_bias_fields = {"qwen3": "attention_bias"}

    @classmethod
    def count_extras(cls, cfg, hf_config) -> dict:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"tied": getattr(hf_config, "tie_word_embeddings", None), "qkv_bias": bias, "o_bias": bias}
