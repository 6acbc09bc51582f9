"""The model's shape and the terms shared by the peak-memory estimates of the stages.

No weights are loaded: the shape comes from `model.shape` in the config (known models in
`conf/model/*.yaml`) or from the model's `config.json`. Each stage owns its estimate
(`circuitkit.discovery.attribution.memory` for attribution, `circuitkit.discovery.pruning.memory` for pruning,
`gradian.build.memory` for gradient indexing); this module holds what they share: `MemoryEstimate`,
the shape, the parameter count and the activations autograd saves per layer. Notation used in the formulas:

    B batch size, T tokens, N = B·T, L layers, H query heads, KV key/value heads, dh head width,
    d = d_model, f = d_mlp, V vocabulary, P parameters, p bytes per element of the model dtype,
    n_up = 1 + L·(H + 1)            upstream nodes (embedding, every head, every MLP)
    n_in = L·(H + 2·KV + 1)         residual-space inputs (Q per head, K and V per KV head, MLP)
    n_down = n_in + 1               downstream columns of the edge score matrix (+ logits)

See `circuitkit.discovery.attribution.memory.estimate_attribution` and `gradian.build.memory.estimate_grads`
for the terms and how their coefficients were measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from circuitkit.models.config import ModelConfig, ModelShape
from circuitkit.models.families import FAMILIES, family, family_of_config
from circuitkit.models.loading import auto_config, pretrained_args

MiB = 2**20
FP32 = 4
SHAPE_KEYS = ("family", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "d_mlp", "vocab_size",
              "n_params")

# Activations autograd saves for the backward of one forward pass, per layer, in units of N·d and
# N·f elements of the model dtype (each family's `act_per_layer`, circuitkit/models/families/),
# plus ACT_BASE·N·d outside the blocks (embedding output, final norm). Measured with
# torch.autograd.graph.saved_tensors_hooks counting the unique storages saved during one forward
# with frozen parameters (parameters excluded), float32, sdpa attention, on random models with
# d = 64, 4 heads (2 KV heads for the Llama-named families), L ∈ {1, 2}, f ∈ {256, 512},
# N ∈ {64, 128, 256}: exactly linear in N, L and f, no T² term (sdpa keeps only q, k, v, the
# output and a logsumexp per head and token); scripts/tools/measure_act_coefficients.py measures them.
ACT_PER_LAYER: dict[str, tuple[float, float]] = {name: cls.act_per_layer for name, cls in FAMILIES.items()}
ACT_BASE = 1.25
@dataclass
class MemoryEstimate:
    """Peak device bytes, broken into named terms (bytes)."""

    terms: dict[str, int] = field(default_factory=dict)
    phase: str = ""  # which part of the algorithm the peak falls in
    index_bytes: int = 0  # on-disk bytes (estimate_grads): not device memory, not in total_bytes
    # The batch the estimate was taken at and why (`circuitkit.discovery.data_lengths`): tokens, rows,
    # source ("tokenized" or "configured") and `line`, which the preflight prints and the manifest keeps.
    lengths: dict[str, Any] = field(default_factory=dict)

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

def count_params(shape: dict[str, Any], **extra: Any) -> int:
    """Parameter count in closed form from the shape (P in the module docstring): the family's
    `count_params` (circuitkit/models/families/), with `extra` what the shape lacks (tied
    embeddings, biases, ...); defaults as in the family's reference models."""
    return family(shape["family"]).count_params(shape, **extra)


def shape_from_config(hf_config: Any) -> dict[str, Any]:
    """The shape dict (keys SHAPE_KEYS, plus the config's `model_type`) of a Hugging Face config;
    Gemma 3's `text_config` is used. The family reads its own config fields (`read_dims`,
    `count_extras`).

    n_params counts the text model (for a multimodal Gemma 3 checkpoint the vision tower is not
    included; `conf/model/gemma4b.yaml` carries the whole checkpoint's count).
    """
    try:
        fam = family_of_config(hf_config)
    except ValueError as err:
        raise ValueError(f"{err} (no memory estimate)") from None
    cfg = getattr(hf_config, "text_config", None) or hf_config
    shape = {"family": fam.family, **fam.read_dims(cfg)}
    shape["n_params"] = fam.count_params(shape, **fam.count_extras(cfg, hf_config))
    # The outer model_type says which class holds the blocks (Gemma 3: text-only or multimodal),
    # which decides their module names (circuitkit.models.linear_modules).
    shape["model_type"] = getattr(hf_config, "model_type", getattr(cfg, "model_type", None))
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
    return s, family(s["family"]).act_per_layer


# The share of a device's free memory that a batch sized to it (grads.device_batch,
# discovery.device_batch) may take by the estimate: the estimates are within a few percent of the
# measured peak; allocator fragmentation and pinned copies need the rest.
DEVICE_FREE_SHARE = 0.9


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
