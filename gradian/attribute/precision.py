"""The precision the eval set is scored in, and which flipped items only flipped because of it.

`--precision` (attribute.precision) picks the dtype both models are evaluated in, so the measured
regression can match the user's own eval:

    index     the precision the index was built with (its manifest's `precision`: `gradian index`'s
              model.precision as it resolved there); the default, and what attribute always did
    auto      bfloat16 where this device computes it natively, else float32 (`circuitkit.core.device`)
    float32, bfloat16, float16   exactly that

The query gradients always run in the index's precision: the rows were made with those weights (their
sha256 includes the dtype), so a query in another dtype would be another model's.

A flipped item (right -> wrong, `gradian.attribute.regression`) whose flip is a rounding accident is a
near-tie: its flipped items alone are scored again on both models in the other precision (float32
when the run used 16 bits, bfloat16 when it used float32) and marked when there the base margin is
below `NEAR_TIE` nats or the tuned margin above -`NEAR_TIE` (`regression.near_ties`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from circuitkit.core.device import Precision, bf16_support, release_memory, resolve_precision
from circuitkit.core.errors import UserError
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from gradian.attribute.evaluate import EvalItem, ItemScores, score_items
from gradian.attribute.regression import NEAR_TIE, near_ties

EVAL_PRECISIONS = ("index", "auto", "float32", "bfloat16", "float16")


def eval_precision(asked: str, manifest: dict[str, Any], device: torch.device | str | None = None) -> Precision:
    """The dtype the eval runs in for `--precision asked`, with the sentence that says why
    (UserError, exit code 2, for a value not in `EVAL_PRECISIONS`)."""
    if asked not in EVAL_PRECISIONS:
        raise UserError(f"--precision {asked!r}; valid: {', '.join(EVAL_PRECISIONS)} (index: the precision the index"
                        " was built with).", exit_code=2)
    index = str(manifest.get("precision", "bfloat16"))
    if asked == "index":
        return Precision("index", index, f"--precision index: the index's precision ({index}, what `gradian index` ran"
                                         " the model in)")
    if asked == "auto":
        support = bf16_support(device)
        used = "bfloat16" if support.native else "float32"
        native = "native" if support.native else "no native"
        return Precision("auto", used, f"--precision auto: {native} bf16 on {support.device} ({support.how})",
                         support)
    resolved = resolve_precision(asked, device)
    return Precision(asked, resolved.used, f"--precision {asked}", resolved.support)


def other_precision(used: str) -> str:
    """The precision a flipped item is checked in: float32 for a 16-bit run, bfloat16 for a float32 one."""
    return "bfloat16" if used == "float32" else "float32"


def precision_line(evaluated: Precision, index_precision: str) -> str:
    """The command's first line about precision."""
    queries = ("the same" if evaluated.used == index_precision
               else f"in the index's {index_precision}, the rows' weights")
    return f"precision: evaluating in {evaluated.used} ({evaluated.note}); query gradients {queries}"



def near_tie_check(base_cfg: ModelConfig, tuned_cfg: ModelConfig, items: Sequence[EvalItem], flipped: list[int],
                   used: str, load: Callable[[ModelConfig], Any] | None = None,
                   eps: float = NEAR_TIE) -> dict[str, Any]:
    """Score the `flipped` items again on both models in `other_precision(used)`, one model at a time,
    and return the result's `precision.near_tie` entry: {precision, eps, checked, items (the near-ties,
    0-based item numbers), margins [{item, base, tuned}] in that precision}.

    `base_cfg` / `tuned_cfg`: the models as evaluated (their precision is replaced); `load`: the loader
    (default `load_model(cfg, keep_adapter=True)`)."""
    other = other_precision(used)
    load = load or (lambda cfg: load_model(cfg, keep_adapter=True))
    part = [items[i] for i in flipped]
    scores: list[ItemScores] = []
    for cfg in (base_cfg, tuned_cfg):
        loaded = load(dataclasses.replace(cfg, precision=other))
        try:
            scores.append(score_items(loaded, part))
        finally:
            del loaded
            release_memory()
    ties = near_ties(flipped, scores[0], scores[1], eps)
    return {"precision": other, "eps": eps, "checked": len(flipped), "items": ties,
            "margins": [{"item": i, "base": float(scores[0].margin[j]), "tuned": float(scores[1].margin[j])}
                        for j, i in enumerate(flipped)]}
