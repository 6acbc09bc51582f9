"""Architecture adapters: the only code that knows Hugging Face module names.

Everything above `circuitkit/models/` speaks of layers, heads, Q/K/V inputs, `z` (the input
of the attention output projection, one slice per head) and MLPs. An adapter maps that
vocabulary onto one family's modules and weights:

    GPT-2       transformer.h[l]: ln_1 -> attn.c_attn (fused QKV, Conv1D) -> attn.c_proj; ln_2 -> mlp
    GPT-NeoX    gpt_neox.layers[l]: input_layernorm -> attention.query_key_value (fused,
                interleaved per head) -> attention.dense; post_attention_layernorm -> mlp;
                parallel residual when config.use_parallel_residual
    Llama       model.layers[l]: input_layernorm -> self_attn.{q,k,v}_proj -> o_proj;
                post_attention_layernorm -> mlp   (also Mistral, Qwen2)
    Gemma 3     as Llama, plus post_attention_layernorm on the attention output,
                pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm (post-norms),
                q_norm/k_norm inside attention, embeddings scaled by sqrt(d_model)

Weights are returned in nn.Linear orientation (out = W x + b), per head:
W_Q [n_heads, head_dim, d_model], W_K / W_V [n_kv_heads, head_dim, d_model] (GQA native),
W_O [n_heads, d_model, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_FAMILIES = {
    "gpt2": "GPT-2",
    "gpt_neox": "GPT-NeoX (Pythia)",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "gemma3_text": "Gemma 3 (text)",
    "gemma3": "Gemma 3 (text path of Gemma3ForConditionalGeneration)",
}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no adapter."""


@dataclass
class QKVWeights:
    """Per-head projection weights of one layer, nn.Linear orientation."""

    w_q: torch.Tensor  # (n_heads, head_dim, d_model)
    w_k: torch.Tensor  # (n_kv_heads, head_dim, d_model)
    w_v: torch.Tensor  # (n_kv_heads, head_dim, d_model)
    b_q: torch.Tensor | None  # (n_heads, head_dim)
    b_k: torch.Tensor | None  # (n_kv_heads, head_dim)
    b_v: torch.Tensor | None  # (n_kv_heads, head_dim)


@dataclass
class QKVSite:
    """A module whose output holds some of q, k, v, and how to split/merge it per head.

    split(out) -> {"q": (B, T, n_heads, head_dim), ...}; merge(parts) rebuilds `out`.
    """

    module: nn.Module
    split: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    merge: Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class NormSpec:
    """A normalisation layer as maths: LayerNorm or RMSNorm with effective gain and bias."""

    kind: str  # "layernorm" | "rmsnorm"
    weight: torch.Tensor | None  # effective gain (Gemma's 1 + w already applied)
    bias: torch.Tensor | None
    eps: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's forward in float32: (..., d) -> (..., d)."""
        x = x.float()
        if self.kind == "layernorm":
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x = x * self.weight.float()
        if self.bias is not None:
            x = x + self.bias.float()
        return x


def _norm_spec(module: nn.Module) -> NormSpec:
    if isinstance(module, nn.LayerNorm):
        return NormSpec("layernorm", module.weight, module.bias, module.eps)
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    if name.startswith("Gemma") and "RMSNorm" in name:
        return NormSpec("rmsnorm", 1.0 + module.weight.float(), None, eps)
    if "RMSNorm" in name:
        return NormSpec("rmsnorm", module.weight, None, eps)
    raise UnsupportedArchitectureError(f"Unknown normalisation layer {name}.")


class ModelAdapter:
    """Family-independent view of a causal LM; subclasses bind the module names."""

    family: str = ""
    parallel_residual: bool = False
    has_post_norms: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = getattr(model.config, "text_config", None) or model.config
        self._base = self._find_base(model)

    # -- shapes -------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def n_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.n_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.d_model // self.n_heads

    @property
    def d_model(self) -> int:
        return self.config.hidden_size

    @property
    def d_mlp(self) -> int:
        return getattr(self.config, "intermediate_size", None) or 4 * self.d_model

    @property
    def vocab_size(self) -> int:
        return self.unembed.weight.shape[0]

    def shape(self) -> dict[str, int | str]:
        """The model's shape in the vocabulary of `conf/model/*.yaml`."""
        return {"family": self.family, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "d_model": self.d_model,
                "d_mlp": self.d_mlp, "vocab_size": self.vocab_size,
                "n_params": sum(p.numel() for p in self.model.parameters())}

    # -- modules (subclasses) -----------------------------------------------------------
    def _find_base(self, model: nn.Module) -> nn.Module:
        raise UnsupportedArchitectureError(type(model).__name__)

    @property
    def blocks(self) -> list[nn.Module]:
        raise UnsupportedArchitectureError(self.family)

    def attn(self, layer: int) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    def attn_norm(self, layer: int) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    def mlp_norm(self, layer: int) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    def mlp(self, layer: int) -> nn.Module:
        return self.blocks[layer].mlp

    def o_proj(self, layer: int) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    def post_attn_norm(self, layer: int) -> nn.Module | None:
        return None

    def post_mlp_norm(self, layer: int) -> nn.Module | None:
        return None

    @property
    def embed(self) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    @property
    def final_norm(self) -> nn.Module:
        raise UnsupportedArchitectureError(self.family)

    @property
    def unembed(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def norm_spec(self, module: nn.Module) -> NormSpec:
        """The maths of a norm module (for closed-form gradients through it)."""
        return _norm_spec(module)

    # -- per-head weights and q/k/v sites -----------------------------------------------
    def qkv_weights(self, layer: int) -> QKVWeights:
        raise UnsupportedArchitectureError(self.family)

    def qkv_sites(self, layer: int) -> list[QKVSite]:
        raise UnsupportedArchitectureError(self.family)

    def o_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_O (n_heads, d_model, head_dim) and its bias (d_model,) or None."""
        lin = self.o_proj(layer)
        w = lin.weight  # (d_model, n_heads * head_dim)
        return w.view(self.d_model, self.n_heads, self.head_dim).permute(1, 0, 2), lin.bias

    def _separate_qkv(self, attn: nn.Module) -> list[QKVSite]:
        def site(module: nn.Module, part: str, n: int) -> QKVSite:
            return QKVSite(module,
                           lambda out: {part: out.view(*out.shape[:-1], n, self.head_dim)},
                           lambda parts: parts[part].reshape(*parts[part].shape[:-2], -1))
        return [site(attn.q_proj, "q", self.n_heads), site(attn.k_proj, "k", self.n_kv_heads),
                site(attn.v_proj, "v", self.n_kv_heads)]

    def _separate_qkv_weights(self, attn: nn.Module) -> QKVWeights:
        def per_head(lin: nn.Linear, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = lin.weight.view(n, self.head_dim, self.d_model)
            b = None if lin.bias is None else lin.bias.view(n, self.head_dim)
            return w, b
        (wq, bq), (wk, bk), (wv, bv) = (per_head(attn.q_proj, self.n_heads),
                                        per_head(attn.k_proj, self.n_kv_heads),
                                        per_head(attn.v_proj, self.n_kv_heads))
        return QKVWeights(wq, wk, wv, bq, bk, bv)


class GPT2Adapter(ModelAdapter):
    family = "gpt2"

    def _find_base(self, model: nn.Module) -> nn.Module:
        return model.transformer

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self._base.h)

    @property
    def d_mlp(self) -> int:
        return self.config.n_inner or 4 * self.d_model

    def attn(self, layer: int) -> nn.Module:
        return self.blocks[layer].attn

    def attn_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].ln_1

    def mlp_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].ln_2

    def o_proj(self, layer: int) -> nn.Module:
        return self.blocks[layer].attn.c_proj

    def o_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        conv = self.o_proj(layer)  # Conv1D weight is (in, out)
        w = conv.weight.view(self.n_heads, self.head_dim, self.d_model).permute(0, 2, 1)
        return w, conv.bias

    @property
    def embed(self) -> nn.Module:
        return self._base.wte

    @property
    def final_norm(self) -> nn.Module:
        return self._base.ln_f

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


class NeoXAdapter(ModelAdapter):
    family = "gpt_neox"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.parallel_residual = bool(self.config.use_parallel_residual)

    def _find_base(self, model: nn.Module) -> nn.Module:
        return model.gpt_neox

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self._base.layers)

    def attn(self, layer: int) -> nn.Module:
        return self.blocks[layer].attention

    def attn_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].input_layernorm

    def mlp_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].post_attention_layernorm

    def o_proj(self, layer: int) -> nn.Module:
        return self.attn(layer).dense

    @property
    def embed(self) -> nn.Module:
        return self._base.embed_in

    @property
    def final_norm(self) -> nn.Module:
        return self._base.final_layer_norm

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


class LlamaAdapter(ModelAdapter):
    """Llama, Mistral and Qwen2 share module names (Qwen2 adds q/k/v biases)."""

    family = "llama"

    def _find_base(self, model: nn.Module) -> nn.Module:
        return model.model

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self._base.layers)

    def attn(self, layer: int) -> nn.Module:
        return self.blocks[layer].self_attn

    def attn_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].input_layernorm

    def mlp_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].post_attention_layernorm

    def o_proj(self, layer: int) -> nn.Module:
        return self.attn(layer).o_proj

    @property
    def embed(self) -> nn.Module:
        return self._base.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self._base.norm

    def qkv_weights(self, layer: int) -> QKVWeights:
        return self._separate_qkv_weights(self.attn(layer))

    def qkv_sites(self, layer: int) -> list[QKVSite]:
        return self._separate_qkv(self.attn(layer))


class Gemma3Adapter(LlamaAdapter):
    """Gemma 3: Llama names plus post-norms; the multimodal class exposes its text model."""

    family = "gemma3"
    has_post_norms = True

    def _find_base(self, model: nn.Module) -> nn.Module:
        inner = model.model
        return getattr(inner, "language_model", inner)

    def mlp_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].pre_feedforward_layernorm

    def post_attn_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].post_attention_layernorm

    def post_mlp_norm(self, layer: int) -> nn.Module:
        return self.blocks[layer].post_feedforward_layernorm


_ADAPTERS: dict[str, type[ModelAdapter]] = {
    "gpt2": GPT2Adapter,
    "gpt_neox": NeoXAdapter,
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "gemma3_text": Gemma3Adapter,
    "gemma3": Gemma3Adapter,
}


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`, chosen by `model.config.model_type`."""
    model_type = getattr(model.config, "model_type", None)
    cls = _ADAPTERS.get(model_type)
    if cls is None:
        supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_FAMILIES.items())
        raise UnsupportedArchitectureError(
            f"Architecture '{model_type}' ({type(model).__name__}) is not supported. Supported families:"
            f" {supported}.")
    return cls(model)
