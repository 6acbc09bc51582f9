"""Measure a family's activation coefficients (c_d, c_f): what autograd saves per layer and token.

One forward with frozen parameters and an input embedding that requires grad, float32, sdpa;
torch.autograd.graph.saved_tensors_hooks counts the unique storages saved (parameters
excluded). Per-layer bytes are the difference between 2 and 1 layers; two MLP widths separate
the N·d and N·f parts: saved per layer and token = c_d·d + c_f·f (elements). Compares with the
family's `act_per_layer` (circuitkit/models/families/).

    python scripts/tools/measure_act_coefficients.py tiny-qwen3 tiny-qwen3-moe [--tokens 128]

The fixture's config is used with its layers and MLP width replaced (MoE: f = top_k · f_e).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from circuitkit.fixtures.models import ensure_fixture  # noqa: E402
from circuitkit.models.adapters import family_of_config  # noqa: E402
from circuitkit.preflight.memory import shape_from_config  # noqa: E402


def saved_elements(config, n_tokens: int) -> int:
    """Elements autograd saves in one forward of a random model of `config` (parameters excluded)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    model.requires_grad_(False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes() // t.element_size()
        return t

    emb = torch.randn(4, n_tokens // 4, config.hidden_size).requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=emb).logits.sum()
    return sum(saved.values())


def _with(config, **changes):
    values = {**config.to_dict(), **changes}
    if values.get("layer_types") and "num_hidden_layers" in changes:  # keep one type per layer
        values["layer_types"] = values["layer_types"][-changes["num_hidden_layers"]:]
    return config.__class__.from_dict(values)


def measure(name: str, n_tokens: int) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ensure_fixture(name))
    fam = family_of_config(config)
    moe = hasattr(config, "moe_intermediate_size")
    key = "moe_intermediate_size" if moe else "intermediate_size"
    if config.model_type == "gpt2":
        key = "n_inner"
    base = getattr(config, key) or 4 * config.hidden_size
    per_layer = {}
    for width in (base, 2 * base):
        one = saved_elements(_with(config, num_hidden_layers=1, **{key: width}), n_tokens)
        two = saved_elements(_with(config, num_hidden_layers=2, **{key: width}), n_tokens)
        f = shape_from_config(_with(config, **{key: width}))["d_mlp"]
        per_layer[f] = (two - one) / n_tokens
    (f1, s1), (f2, s2) = sorted(per_layer.items())
    c_f = (s2 - s1) / (f2 - f1)
    d = config.hidden_size
    c_d = (s1 - c_f * f1) / d
    return {"fixture": name, "family": fam.family, "measured": [round(c_d, 3), round(c_f, 3)],
            "act_per_layer": list(fam.act_per_layer), "per_layer_per_token": per_layer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("fixtures", nargs="+")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    for name in args.fixtures:
        print(json.dumps(measure(name, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
