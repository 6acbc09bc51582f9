"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and a sparse mixture-of-experts MLP:
mlp.gate (router, E·d, not an nn.Linear) picks top_k of E experts per token; the experts'
weights are fused 3-D parameters, mlp.experts.gate_up_proj (E, 2·f_e, d) and
mlp.experts.down_proj (E, d, f_e), not linear modules.

The shape's d_mlp is the MLP width one token activates, top_k·f_e (what its activations scale
with); the parameter count needs E and f_e from the config (`count_extras`). No MLP output
linear: a circuit's MLP cannot be indexed as one (`mlp_output_linear` is None), and Gradian
refuses an index that would silently leave the experts out (`fused_experts`).
"""

from __future__ import annotations

from typing import Any

from circuitkit.models.families.llama import attention_layout, attention_params
from circuitkit.models.families.qwen3 import Qwen3


class Qwen3MoE(Qwen3):
    """Qwen3-MoE: Qwen3 attention, experts in fused 3-D weights."""

    family = "qwen3_moe"
    listed = 5
    model_types = {"qwen3_moe": "Qwen3-MoE"}
    paths = {**Qwen3.paths, "mlp_out": None}
    fused_experts = True
    attention_bias_fields = {"qwen3_moe": "attention_bias"}
    # Measured with scripts/tools/measure_act_coefficients.py on tiny-qwen3-moe's shape (d 64, top_k 2
    # of 4 experts, f = top_k·f_e): c_d holds the routed copies of the MLP input (top_k·d) and
    # the router's float32 probabilities (E per token), so it holds for that routing only; see
    # docs/memory.md.
    act_per_layer = (8.95, 3.0)

    @classmethod
    def read_dims(cls, cfg: Any) -> dict[str, int]:
        dims = super().read_dims(cfg)
        dims["d_mlp"] = cfg.num_experts_per_tok * cfg.moe_intermediate_size
        return dims

    @classmethod
    def linear_layout(cls, s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
        return attention_layout(s)  # the router and the experts are not linear modules

    @classmethod
    def count_extras(cls, cfg: Any, hf_config: Any) -> dict[str, Any]:
        sparse = [layer for layer in range(cfg.num_hidden_layers)
                  if layer not in (cfg.mlp_only_layers or []) and (layer + 1) % cfg.decoder_sparse_step == 0]
        return {**super().count_extras(cfg, hf_config), "n_experts": cfg.num_experts,
                "d_expert": cfg.moe_intermediate_size, "n_sparse": len(sparse), "d_dense": cfg.intermediate_size}

    @classmethod
    def count_params(cls, shape: dict[str, Any], *, tied: bool | None = None, qkv_bias: bool | None = None,
                     o_bias: bool | None = None, n_experts: int | None = None, d_expert: int | None = None,
                     n_sparse: int | None = None, d_dense: int = 0, **_: Any) -> int:
        """V·d (+ V·d untied) + L·[2d + 2dh + attention] + d, plus per sparse layer E·d (router)
        + E·3·d·f_e (experts), per dense layer 3·d·f. Needs E and f_e (from the config)."""
        if n_experts is None or d_expert is None:
            raise ValueError("a Qwen3-MoE parameter count needs the number of experts and their width"
                             " (from config.json); give model.shape.n_params")
        d, V, L = shape["d_model"], shape["vocab_size"], shape["n_layers"]
        n_sparse = L if n_sparse is None else n_sparse
        per_layer = attention_params(shape, bool(qkv_bias), bool(o_bias)) + 2 * d + 2 * shape["head_dim"]
        moe = n_experts * d + n_experts * 3 * d * d_expert
        tied = True if tied is None else tied
        return V * d * (1 if tied else 2) + L * per_layer + n_sparse * moe + (L - n_sparse) * 3 * d * d_dense + d
