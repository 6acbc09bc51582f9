"""GPT-NeoX (Pythia): gpt_neox.layers[l]: input_layernorm -> attention.query_key_value (fused,
interleaved per head) -> attention.dense; post_attention_layernorm -> mlp; parallel residual
when config.use_parallel_residual. Untied unembedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from circuitkit.models.families.base import ATTENTION, MLP_IN, MLP_OUT, ModelAdapter, QKVSite, QKVWeights


class GPTNeoX(ModelAdapter):
    """GPT-NeoX (Pythia): fused QKV interleaved per head, optional parallel residual."""

    family = "gpt_neox"
    listed = 1
    model_types = {"gpt_neox": "GPT-NeoX (Pythia)"}
    paths = {"base": "gpt_neox", "blocks": "layers", "embed": "embed_in", "final_norm": "final_layer_norm",
             "attn": "attention", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "mlp": "mlp", "attn_out": "attention.dense", "mlp_out": "mlp.dense_4h_to_h"}
    block_prefix = "gpt_neox.layers.{l}."
    # The MLP saves only the GELU input (1·f).
    act_per_layer = (5.125, 1.0)
    attention_bias_fields = {"gpt_neox": "attention_bias"}  # query_key_value's and dense's biases
    kv_groups_removable = ("a layer cannot hold fewer heads (head_dim is hidden_size / num_attention_heads):"
                           " removed heads are zeroed in W_O, not cut")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.parallel_residual = bool(self.config.use_parallel_residual)

    @classmethod
    def linear_layout(cls, s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
        hd, d, f = s["n_heads"] * s["head_dim"], s["d_model"], s["d_mlp"]
        return [("attention.query_key_value", ATTENTION, (3 * hd, d)), ("attention.dense", ATTENTION, (d, hd)),
                ("mlp.dense_h_to_4h", MLP_IN, (f, d)), ("mlp.dense_4h_to_h", MLP_OUT, (d, f))]

    @classmethod
    def count_params(cls, shape: dict[str, Any], *, tied: bool | None = None, **_: Any) -> int:
        """2·V·d (untied unembedding) + L·[2·2d + (d·3d + 3d) + (d·d + d) + (d·f + f) + (f·d + d)] + 2d."""
        d, f, V = shape["d_model"], shape["d_mlp"], shape["vocab_size"]
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        tied = False if tied is None else tied
        return V * d * (1 if tied else 2) + shape["n_layers"] * block + 2 * d

    def qkv_weights(self, layer: int) -> QKVWeights:
        lin = self.attn(layer).query_key_value  # rows ordered (head, [q|k|v], head_dim)
        w = lin.weight.view(self.n_heads, 3, self.head_dim, self.d_model)
        b = None if lin.bias is None else lin.bias.view(self.n_heads, 3, self.head_dim)

        def pick(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if t is None else t[:, i]

        return QKVWeights(w[:, 0], w[:, 1], w[:, 2], pick(b, 0), pick(b, 1), pick(b, 2))

    def qkv_sites(self, layer: int) -> list[QKVSite]:
        h, dh = self.n_heads, self.head_dim

        def split(out: torch.Tensor) -> dict[str, torch.Tensor]:
            q, k, v = out.view(*out.shape[:-1], h, 3, dh).unbind(-2)
            return {"q": q, "k": k, "v": v}

        def merge(parts: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.stack([parts["q"], parts["k"], parts["v"]], -2).flatten(-3)

        return [QKVSite(self.attn(layer).query_key_value, split, merge)]
