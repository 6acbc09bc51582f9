"""What every architecture family provides, and the family-independent view of a causal LM.

A family is one module of `circuitkit/models/families/` holding one `ModelAdapter` subclass:
the single source of that family's facts, for a loaded model and for an offline shape alike.

    model_types        Hugging Face `model_type`s it serves -> display name
    paths              attribute paths (dotted) of its modules: `base` from the model; `blocks`,
                       `embed`, `final_norm` from the base; `attn`, `attn_norm`, `mlp_norm`,
                       `mlp`, `attn_out` (the attention output projection: its input is z), `mlp_out` (the MLP output linear; None
                       when the MLP has none, e.g. fused experts), `post_attn_norm`,
                       `post_mlp_norm` from a block
    block_prefix       offline module name of block l ("transformer.h.{l}."), per model_type
    linear_layout      the linear modules of a block: (path, role, (d_out, d_in) from the shape)
    read_dims          the shape fields of its Hugging Face config
    count_params       its parameter count in closed form
    act_per_layer      activations autograd saves per layer, (c_d, c_f) in units of N·d, N·f
    recomputed_c_f     c_f when `models.recompute` recomputes or fuses its activation, else None
    softcap_field      the config field of its final logit soft-capping, or None
    fused_experts      True when its MLPs hold expert weights as 3-D parameters (not nn.Linear)
    gguf_model_types   its model_types that load from a GGUF file (its `general.architecture`),
                       dequantized by transformers
    image_text_model_types  its model_types whose checkpoints load as AutoModelForImageTextToText
                       (a multimodal class whose text path is used)

Everything above `models/` speaks of layers, heads, Q/K/V inputs, `z` (the input of the
attention output projection, one slice per head) and MLPs, and reaches a module through the
hook sites below (`z_input`, `attn_write`, `mlp_write`, `mlp_output_linear`), never by name.

Weights are returned in nn.Linear orientation (out = W x + b), per head:
W_Q [n_heads, head_dim, d_model], W_K / W_V [n_kv_heads, head_dim, d_model] (GQA native),
W_O [n_heads, d_model, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

import torch
from torch import nn

# Roles of a block's linear modules (gradian.build.memory: where the backward's graph starts).
ATTENTION, MLP_IN, MLP_OUT = "attention", "mlp_in", "mlp_out"
Dims = Callable[[dict[str, Any]], tuple[int, int]]


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no family."""


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


def norm_spec(module: nn.Module) -> NormSpec:
    """LayerNorm, or an RMSNorm by its class name (Gemma's gain is 1 + w)."""
    if isinstance(module, nn.LayerNorm):
        return NormSpec("layernorm", module.weight, module.bias, module.eps)
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    if name.startswith("Gemma") and "RMSNorm" in name:
        return NormSpec("rmsnorm", 1.0 + module.weight.float(), None, eps)
    if "RMSNorm" in name:
        return NormSpec("rmsnorm", module.weight, None, eps)
    raise UnsupportedArchitectureError(f"Unknown normalisation layer {name}.")


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency, but keep it optional here
        return None
    return Conv1D


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2's linear layer, weight stored (in, out))."""
    conv1d = _conv1d_type()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def module_shape(module: nn.Module) -> tuple[int, int]:
    """(d_out, d_in) of a linear module in nn.Linear orientation, whatever its weight layout.

    nn.Linear stores W as (d_out, d_in); Conv1D stores it transposed, (d_in, d_out).
    """
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    conv1d = _conv1d_type()
    if conv1d is not None and isinstance(module, conv1d):
        d_in, d_out = module.weight.shape
        return int(d_out), int(d_in)
    raise TypeError(f"{type(module).__name__} is not a linear module (nn.Linear or Conv1D).")


def linear_param_count(d_out: int, d_in: int, bias: bool) -> int:
    return d_out * d_in + (d_out if bias else 0)


class ModelAdapter:
    """Family-independent view of a causal LM; a family subclasses it (see the module docstring)."""

    # -- the family's facts (class attributes, read offline too) ------------------------------
    family: ClassVar[str] = ""
    model_types: ClassVar[dict[str, str]] = {}
    paths: ClassVar[dict[str, str | None]] = {}
    block_prefix: ClassVar[str] = ""
    block_prefix_by_model_type: ClassVar[dict[str, str]] = {}
    act_per_layer: ClassVar[tuple[float, float]] = (0.0, 0.0)
    recomputed_c_f: ClassVar[float | None] = None
    softcap_field: ClassVar[str | None] = None
    fused_experts: ClassVar[bool] = False
    gguf_model_types: ClassVar[tuple[str, ...]] = ()
    image_text_model_types: ClassVar[tuple[str, ...]] = ()
    has_post_norms: ClassVar[bool] = False
    listed: ClassVar[int] = 100  # place in the lists of supported families (messages, docs)
    parallel_residual: bool = False

    @classmethod
    def linear_layout(cls, s: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
        """(path in the block, role, (d_out, d_in)) of every linear module of a block, in
        registration order, from the shape alone."""
        raise NotImplementedError

    @classmethod
    def read_dims(cls, cfg: Any) -> dict[str, int]:
        """n_layers, n_heads, n_kv_heads, head_dim, d_model, d_mlp, vocab_size of a Hugging Face
        (text) config; the default reads the Llama-style field names."""
        d, h = cfg.hidden_size, cfg.num_attention_heads
        return {"n_layers": cfg.num_hidden_layers, "n_heads": h,
                "n_kv_heads": getattr(cfg, "num_key_value_heads", None) or h,
                "head_dim": getattr(cfg, "head_dim", None) or d // h, "d_model": d,
                "d_mlp": cfg.intermediate_size, "vocab_size": cfg.vocab_size}

    @classmethod
    def count_extras(cls, cfg: Any, hf_config: Any) -> dict[str, Any]:
        """Keyword arguments of `count_params` that the shape lacks (biases, tying, ...)."""
        return {"tied": getattr(hf_config, "tie_word_embeddings", None)}

    @classmethod
    def count_params(cls, shape: dict[str, Any], **extra: Any) -> int:
        """Parameter count in closed form from the shape (and `count_extras`)."""
        raise NotImplementedError

    @classmethod
    def prefix(cls, model_type: str | None = None) -> str:
        """Offline module name prefix of block {l}: the family's released checkpoint class unless
        `model_type` names another."""
        return cls.block_prefix_by_model_type.get(model_type, cls.block_prefix)

    # -- a loaded model -----------------------------------------------------------------------
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = getattr(model.config, "text_config", None) or model.config
        self.base = self.find_base(model)
        self._dims = self.read_dims(self.config)

    def find_base(self, model: nn.Module) -> nn.Module:
        """The decoder without its LM head (its forward returns `last_hidden_state`)."""
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
        return self._dims["n_heads"]

    @property
    def n_kv_heads(self) -> int:
        return self._dims["n_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self._dims["head_dim"]

    @property
    def d_model(self) -> int:
        return self._dims["d_model"]

    @property
    def d_mlp(self) -> int:
        return self._dims["d_mlp"]

    @property
    def vocab_size(self) -> int:
        return self.unembed.weight.shape[0]

    def shape(self) -> dict[str, int | str]:
        """The model's shape in the vocabulary of `conf/model/*.yaml`."""
        return {"family": self.family, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "d_model": self.d_model,
                "d_mlp": self.d_mlp, "vocab_size": self.vocab_size,
                "n_params": sum(p.numel() for p in self.model.parameters())}

    @property
    def logit_softcap(self) -> float | None:
        """c of the LM head's c·tanh(logits / c) (Gemma), or None."""
        return None if self.softcap_field is None else getattr(self.config, self.softcap_field, None)

    # -- modules ------------------------------------------------------------------------
    @property
    def blocks(self) -> list[nn.Module]:
        return list(attrgetter(self.paths["blocks"])(self.base))

    @property
    def embed(self) -> nn.Module:
        """The token embedding (Gemma's scales by sqrt(d_model) itself)."""
        return attrgetter(self.paths["embed"])(self.base)

    @property
    def final_norm(self) -> nn.Module:
        return attrgetter(self.paths["final_norm"])(self.base)

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

    def post_attn_norm(self, layer: int) -> nn.Module | None:
        """Norm on the attention output before the residual add (Gemma 3), else None."""
        return self._in_block("post_attn_norm", layer)

    def post_mlp_norm(self, layer: int) -> nn.Module | None:
        """Norm on the MLP output before the residual add (Gemma 3), else None."""
        return self._in_block("post_mlp_norm", layer)

    # -- hook sites: where each quantity is read or replaced ------------------------------
    def z_input(self, layer: int) -> nn.Module:
        """The attention output projection: its first input is z, the heads' outputs side by side
        (B, T, n_heads·head_dim), head h in columns h·head_dim .. (h+1)·head_dim - 1."""
        return self._in_block("attn_out", layer)

    def attn_write(self, layer: int) -> nn.Module:
        """The module whose (first) output is what attention adds to the residual stream: the
        post-attention norm where the family has one, else the attention module."""
        return self.post_attn_norm(layer) or self.attn(layer)

    def mlp_write(self, layer: int) -> nn.Module:
        """The module whose (first) output is what the MLP adds to the residual stream: the
        post-MLP norm where the family has one, else the MLP."""
        return self.post_mlp_norm(layer) or self.mlp(layer)

    def mlp_output_linear(self, layer: int) -> nn.Module | None:
        """The MLP's output projection (a linear module), or None when the MLP has none
        (fused expert weights)."""
        return self._in_block("mlp_out", layer)

    def norm_spec(self, module: nn.Module) -> NormSpec:
        """The maths of a norm module (for closed-form gradients through it)."""
        return norm_spec(module)

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
        lin = self.z_input(layer)
        w = lin.weight  # (d_model, n_heads * head_dim)
        return w.view(self.d_model, self.n_heads, self.head_dim).permute(1, 0, 2), lin.bias

    # -- a circuit written into the weights (circuitkit.discovery.export.hf) -----------------
    # The config field that gives the attention linears (the output projection among them) a bias,
    # per model_type; a model_type missing here has no such field (its output projection's bias
    # is either always there, as GPT-2's, or never, as Qwen2's and Mistral's).
    attention_bias_fields: ClassVar[dict[str, str]] = {}
    # Whether a layer can hold fewer heads than its config's n_heads implies: True where the config
    # states head_dim apart from d_model / n_heads and Q, K, V are separate projections.
    kv_groups_removable: ClassVar[str | None] = None  # None = yes, else why not (for the provenance)

    def _display(self) -> str:
        return self.model_types.get(getattr(self.config, "model_type", ""), self.family)

    def ensure_o_bias(self) -> dict[str, Any]:
        """Give every layer's attention output projection a bias (zeros), so a constant can be
        folded into it; returns the config fields changed ({} when it had one already).

        Where one config field adds biases to every attention linear (Llama's `attention_bias`), the
        Q, K and V biases it also creates are zeros, so the model computes what it did.
        """
        if all(self.z_input(layer).bias is not None for layer in range(self.n_layers)):
            return {}
        model_type = getattr(self.config, "model_type", None)
        flag = self.attention_bias_fields.get(model_type)
        if flag is None:
            from circuitkit.core.errors import UserError

            raise UserError(f"mean ablation cannot be folded into {self._display()}'s weights: its attention output"
                            " projection has no bias and no config field adds one (transformers builds it without);"
                            " export with --ablation zero (export.ablation=zero).", exit_code=2)
        layout = self.linear_layout(self.shape())
        for layer in range(self.n_layers):
            for path, role, _ in layout:
                if role != ATTENTION:
                    continue
                lin = attrgetter(path)(self.blocks[layer])
                if lin.bias is None:
                    lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                        device=lin.weight.device), requires_grad=False)
        setattr(self.config, flag, True)
        return {flag: True}

    @torch.no_grad()
    def fold_head_ablation(self, layer: int, heads: list[int], mean_z: torch.Tensor | None) -> None:
        """Make removed heads' ablation live in the weights of `layer`: their slices of W_O zeroed
        and, for a mean ablation, Σ_h W_O[h] mean_z[h] added to the output projection's bias.

        mean_z: (n_heads·head_dim,) the heads' mean z (one vector per head, not per position), or
        None for zero ablation. The output projection then computes exactly what it computes on z
        with the removed heads' slices replaced by mean_z (call `ensure_o_bias` first).
        """
        if not heads:
            return
        w_o, bias = self.o_weights(layer)  # (H, d_model, head_dim), a view of the weight
        if mean_z is not None:
            if bias is None:
                raise ValueError(f"layer {layer}'s attention output projection has no bias: call ensure_o_bias first")
            means = mean_z.float().view(self.n_heads, self.head_dim)[heads]  # (k, head_dim)
            shift = torch.einsum("kdh,kh->d", w_o[heads].float(), means.to(w_o.device))
            bias.add_(shift.to(bias.dtype))
        w_o[heads] = 0

    @torch.no_grad()
    def remove_kv_groups(self, layer: int, groups: list[int]) -> None:
        """Physically remove whole KV groups of `layer` (each KV head with all of its query heads:
        query head h reads KV head h // (n_heads / n_kv_heads)): the rows of Q, K and V and the
        columns of the output projection. The config's head counts are the caller's (`set_head_counts`),
        as every layer must lose as many."""
        if self.kv_groups_removable is not None:
            raise ValueError(f"{self._display()}: {self.kv_groups_removable}")
        if not groups:
            return
        attn, dh = self.attn(layer), self.head_dim
        n_kv = attn.k_proj.out_features // dh
        n_q = attn.q_proj.out_features // dh
        per_group = n_q // n_kv
        keep_kv = [g for g in range(n_kv) if g not in set(groups)]
        keep_q = [h for h in range(n_q) if h // per_group not in set(groups)]

        def units(keep: list[int]) -> torch.Tensor:
            return torch.tensor([u * dh + i for u in keep for i in range(dh)], device=attn.q_proj.weight.device)

        _keep_rows(attn.q_proj, units(keep_q))
        _keep_rows(attn.k_proj, units(keep_kv))
        _keep_rows(attn.v_proj, units(keep_kv))
        _keep_columns(self.z_input(layer), units(keep_q))

    def set_head_counts(self, n_heads: int, n_kv_heads: int) -> dict[str, int]:
        """Set the config's per-layer head counts (after `remove_kv_groups` in every layer), head_dim
        stated explicitly; returns the fields set."""
        changes = {"num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "head_dim": self.head_dim}
        for key, value in changes.items():
            setattr(self.config, key, value)
        self._dims = self.read_dims(self.config)
        return changes


def _keep_rows(lin: nn.Module, rows: torch.Tensor) -> None:
    """nn.Linear: keep the output rows `rows` (weight and bias)."""
    lin.weight = nn.Parameter(lin.weight.index_select(0, rows).clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.index_select(0, rows).clone(), requires_grad=False)
    lin.out_features = lin.weight.shape[0]


def _keep_columns(lin: nn.Module, columns: torch.Tensor) -> None:
    """nn.Linear: keep the input columns `columns` (the bias is per output, unchanged)."""
    lin.weight = nn.Parameter(lin.weight.index_select(1, columns).clone(), requires_grad=False)
    lin.in_features = lin.weight.shape[1]
