"""Gemma 3: Llama names plus post-norms: post_attention_layernorm on the attention output,
pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm; q_norm/k_norm inside attention,
embeddings scaled by sqrt(d_model), final logits soft-capped when configured. The multimodal
Gemma3ForConditionalGeneration (model_type gemma3, the released checkpoints) keeps its text
blocks under model.language_model; the text-only Gemma3ForCausalLM (gemma3_text) under model.
"""

from __future__ import annotations

from torch import nn

from circuitkit.models.families.llama import LLAMA_PATHS, Llama


class Gemma3(Llama):
    """Gemma 3: Llama names plus post-norms; the multimodal class exposes its text model."""

    family = "gemma3"
    listed = 3
    model_types = {"gemma3_text": "Gemma 3 (text)",
                   "gemma3": "Gemma 3 (text path of Gemma3ForConditionalGeneration)"}
    gguf_model_types = ("gemma3",)
    image_text_model_types = ("gemma3",)
    paths = {**LLAMA_PATHS, "mlp_norm": "pre_feedforward_layernorm",
             "post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
    block_prefix = "model.language_model.layers.{l}."
    block_prefix_by_model_type = {"gemma3_text": "model.layers.{l}."}
    has_post_norms = True
    act_per_layer = (8.79, 3.0)
    softcap_field = "final_logit_softcapping"
    norms_per_layer = 4
    qk_norms = True
    attention_bias_fields = {"gemma3_text": "attention_bias"}  # the multimodal class's text config too

    @classmethod
    def count_extras(cls, cfg, hf_config) -> dict:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"tied": getattr(hf_config, "tie_word_embeddings", None), "qkv_bias": bias, "o_bias": bias}

    def find_base(self, model: nn.Module) -> nn.Module:
        inner = model.model
        return getattr(inner, "language_model", inner)
