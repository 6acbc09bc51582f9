"""GPT-2: transformer.h[l]: ln_1 -> attn.c_attn (fused QKV, Conv1D) -> attn.c_proj; ln_2 -> mlp.

Conv1D stores its weight (in, out). Tanh GELU (`gelu_new`), which `models.recompute` fuses.
"""

from __future__ import annotations

from typing import Any

import torch

from circuitkit.models.families.base import ATTENTION, MLP_IN, MLP_OUT, ModelAdapter, QKVSite, QKVWeights


class GPT2(ModelAdapter):
    """GPT-2: fused QKV in a Conv1D (weights stored (in, out))."""

    family = "gpt2"
    listed = 0
    model_types = {"gpt2": "GPT-2"}
    gguf_model_types = ("gpt2",)
    paths = {"base": "transformer", "blocks": "h", "embed": "wte", "final_norm": "ln_f", "attn": "attn",
             "attn_norm": "ln_1", "mlp_norm": "ln_2", "mlp": "mlp", "attn_out": "attn.c_proj", "mlp_out": "mlp.c_proj"}
    block_prefix = "transformer.h.{l}."
    # Activations saved per layer (circuitkit.preflight.memory): GPT-2's tanh GELU saves 4·f.
    act_per_layer = (8.125, 4.0)
    recomputed_c_f = 1.0  # the recomputed or fused GELU keeps its input only
    # c_proj always has a bias. transformers 5 dropped config.pruned_heads, and head_dim is n_embd / n_head.
    kv_groups_removable = ("a layer cannot hold fewer heads (head_dim is n_embd / n_head, and transformers 5 no"
                           " longer reads config.pruned_heads): removed heads are zeroed in W_O, not cut")

    @classmethod
    def linear_layout(cls, s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
        hd, d, f = s["n_heads"] * s["head_dim"], s["d_model"], s["d_mlp"]
        return [("attn.c_attn", ATTENTION, (3 * hd, d)), ("attn.c_proj", ATTENTION, (d, hd)),
                ("mlp.c_fc", MLP_IN, (f, d)), ("mlp.c_proj", MLP_OUT, (d, f))]

    @classmethod
    def read_dims(cls, cfg: Any) -> dict[str, int]:
        d, h = cfg.n_embd, cfg.n_head
        return {"n_layers": cfg.n_layer, "n_heads": h, "n_kv_heads": h, "head_dim": d // h, "d_model": d,
                "d_mlp": cfg.n_inner or 4 * d, "vocab_size": cfg.vocab_size}

    @classmethod
    def count_extras(cls, cfg: Any, hf_config: Any) -> dict[str, Any]:
        return {**super().count_extras(cfg, hf_config), "n_positions": cfg.n_positions}

    @classmethod
    def count_params(cls, shape: dict[str, Any], *, tied: bool | None = None, n_positions: int = 1024,
                     **_: Any) -> int:
        """V·d + n_pos·d + L·[2·2d + (d·3d + 3d) + (d·d + d) + (d·f + f) + (f·d + d)] + 2d (tied)."""
        d, f, V = shape["d_model"], shape["d_mlp"], shape["vocab_size"]
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        tied = True if tied is None else tied
        return V * d * (1 if tied else 2) + n_positions * d + shape["n_layers"] * block + 2 * d

    def o_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        conv = self.z_input(layer)  # Conv1D weight is (in, out)
        w = conv.weight.view(self.n_heads, self.head_dim, self.d_model).permute(0, 2, 1)
        return w, conv.bias

    def qkv_weights(self, layer: int) -> QKVWeights:
        conv = self.attn(layer).c_attn
        w = conv.weight.t().view(3, self.n_heads, self.head_dim, self.d_model)
        b = conv.bias.view(3, self.n_heads, self.head_dim)
        return QKVWeights(w[0], w[1], w[2], b[0], b[1], b[2])

    def qkv_sites(self, layer: int) -> list[QKVSite]:
        h, dh = self.n_heads, self.head_dim

        def split(out: torch.Tensor) -> dict[str, torch.Tensor]:
            q, k, v = out.view(*out.shape[:-1], 3, h, dh).unbind(-3)
            return {"q": q, "k": k, "v": v}

        def merge(parts: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.stack([parts["q"], parts["k"], parts["v"]], -3).flatten(-3)

        return [QKVSite(self.attn(layer).c_attn, split, merge)]
