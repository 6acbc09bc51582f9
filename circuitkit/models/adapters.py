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
from operator import attrgetter

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
    """Family-independent view of a causal LM.

    A family names its modules in `paths` (attribute paths, dotted): `base` from the model,
    `blocks`, `embed` and `final_norm` from the base, and `attn`, `attn_norm`, `mlp_norm`,
    `o_proj`, `mlp`, `post_attn_norm`, `post_mlp_norm` from a block. It says how to split its
    Q/K/V projections per head in `qkv_weights` and `qkv_sites`.
    """

    family: str = ""
    paths: dict[str, str] = {}
    parallel_residual: bool = False
    has_post_norms: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = getattr(model.config, "text_config", None) or model.config
        self._base = self._find_base(model)

    def _find_base(self, model: nn.Module) -> nn.Module:
        return attrgetter(self.paths["base"])(model)

    def _in_block(self, key: str, layer: int) -> nn.Module | None:
        path = self.paths.get(key)
        return None if path is None else attrgetter(path)(self.blocks[layer])

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
        return getattr(self.config, "intermediate_size", None) or getattr(self.config, "n_inner", None) \
            or 4 * self.d_model

    @property
    def vocab_size(self) -> int:
        return self.unembed.weight.shape[0]

    def shape(self) -> dict[str, int | str]:
        """The model's shape in the vocabulary of `conf/model/*.yaml`."""
        return {"family": self.family, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "d_model": self.d_model,
                "d_mlp": self.d_mlp, "vocab_size": self.vocab_size,
                "n_params": sum(p.numel() for p in self.model.parameters())}

    # -- modules ------------------------------------------------------------------------
    @property
    def blocks(self) -> list[nn.Module]:
        return list(attrgetter(self.paths["blocks"])(self._base))

    @property
    def embed(self) -> nn.Module:
        """The token embedding (Gemma's scales by sqrt(d_model) itself)."""
        return attrgetter(self.paths["embed"])(self._base)

    @property
    def final_norm(self) -> nn.Module:
        return attrgetter(self.paths["final_norm"])(self._base)

    @property
    def unembed(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def attn(self, layer: int) -> nn.Module:
        return self._in_block("attn", layer)

    def attn_norm(self, layer: int) -> nn.Module:
        """The norm whose output feeds Q, K and V."""
        return self._in_block("attn_norm", layer)

    def mlp_norm(self, layer: int) -> nn.Module:
        """The norm whose output feeds the MLP."""
        return self._in_block("mlp_norm", layer)

    def mlp(self, layer: int) -> nn.Module:
        return self._in_block("mlp", layer)

    def o_proj(self, layer: int) -> nn.Module:
        """The attention output projection; its input is z, the heads' outputs side by side."""
        return self._in_block("o_proj", layer)

    def post_attn_norm(self, layer: int) -> nn.Module | None:
        """Norm on the attention output before the residual add (Gemma 3), else None."""
        return self._in_block("post_attn_norm", layer)

    def post_mlp_norm(self, layer: int) -> nn.Module | None:
        """Norm on the MLP output before the residual add (Gemma 3), else None."""
        return self._in_block("post_mlp_norm", layer)

    def norm_spec(self, module: nn.Module) -> NormSpec:
        """The maths of a norm module (for closed-form gradients through it)."""
        return _norm_spec(module)

    # -- per-head weights and q/k/v sites (separate q_proj / k_proj / v_proj by default) -----
    def qkv_weights(self, layer: int) -> QKVWeights:
        attn = self.attn(layer)

        def per_head(lin: nn.Linear, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = lin.weight.view(n, self.head_dim, self.d_model)
            return w, None if lin.bias is None else lin.bias.view(n, self.head_dim)
        (wq, bq), (wk, bk), (wv, bv) = (per_head(attn.q_proj, self.n_heads),
                                        per_head(attn.k_proj, self.n_kv_heads),
                                        per_head(attn.v_proj, self.n_kv_heads))
        return QKVWeights(wq, wk, wv, bq, bk, bv)

    def qkv_sites(self, layer: int) -> list[QKVSite]:
        attn = self.attn(layer)

        def site(module: nn.Module, part: str, n: int) -> QKVSite:
            return QKVSite(module,
                           lambda out: {part: out.view(*out.shape[:-1], n, self.head_dim)},
                           lambda parts: parts[part].reshape(*parts[part].shape[:-2], -1))
        return [site(attn.q_proj, "q", self.n_heads), site(attn.k_proj, "k", self.n_kv_heads),
                site(attn.v_proj, "v", self.n_kv_heads)]

    def o_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_O (n_heads, d_model, head_dim) and its bias (d_model,) or None."""
        lin = self.o_proj(layer)
        w = lin.weight  # (d_model, n_heads * head_dim)
        return w.view(self.d_model, self.n_heads, self.head_dim).permute(1, 0, 2), lin.bias


class GPT2Adapter(ModelAdapter):
    """GPT-2: fused QKV in a Conv1D (weights stored (in, out))."""

    family = "gpt2"
    paths = {"base": "transformer", "blocks": "h", "embed": "wte", "final_norm": "ln_f", "attn": "attn",
             "attn_norm": "ln_1", "mlp_norm": "ln_2", "mlp": "mlp", "o_proj": "attn.c_proj"}

    def o_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        conv = self.o_proj(layer)  # Conv1D weight is (in, out)
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


class NeoXAdapter(ModelAdapter):
    """GPT-NeoX (Pythia): fused QKV interleaved per head, optional parallel residual."""

    family = "gpt_neox"
    paths = {"base": "gpt_neox", "blocks": "layers", "embed": "embed_in", "final_norm": "final_layer_norm",
             "attn": "attention", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "mlp": "mlp", "o_proj": "attention.dense"}

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.parallel_residual = bool(self.config.use_parallel_residual)

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


_LLAMA_PATHS = {"base": "model", "blocks": "layers", "embed": "embed_tokens", "final_norm": "norm",
                "attn": "self_attn", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "mlp": "mlp", "o_proj": "self_attn.o_proj"}


class LlamaAdapter(ModelAdapter):
    """Llama, Mistral and Qwen2 share module names (Qwen2 adds q/k/v biases)."""

    family = "llama"
    paths = _LLAMA_PATHS


class Gemma3Adapter(ModelAdapter):
    """Gemma 3: Llama names plus post-norms; the multimodal class exposes its text model."""

    family = "gemma3"
    has_post_norms = True
    paths = {**_LLAMA_PATHS, "mlp_norm": "pre_feedforward_layernorm",
             "post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}

    def _find_base(self, model: nn.Module) -> nn.Module:
        inner = model.model
        return getattr(inner, "language_model", inner)


_ADAPTERS: dict[str, type[ModelAdapter]] = {
    "gpt2": GPT2Adapter,
    "gpt_neox": NeoXAdapter,
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "gemma3_text": Gemma3Adapter,
    "gemma3": Gemma3Adapter,
}
# Hugging Face model_type -> family (Qwen2 and Mistral are Llama-shaped): the one table, which
# the memory estimate (circuitkit.memory) reads too.
MODEL_TYPE_FAMILIES = {model_type: cls.family for model_type, cls in _ADAPTERS.items()}


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
