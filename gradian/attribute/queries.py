"""Query gradients of the regressed items, through the index's own capture and projection.

For a regressed item with prompt x, correct answer a and what the tuned model now says w (its own
greedy answer, up to its EOS or `SAID_MAX_TOKENS`, of whatever length: `gradian.attribute.evaluate.
greedy_continuations`), teacher-forced under the tuned model with parameters θ:

    contrastive   q = ∇θ [ℓ(a | x) - ℓ(w | x)]       ℓ = Σ_t CE over the answer's tokens (the
                                                     index's loss_reduction: sum, or mean per token)
    ce            q = ∇θ ℓ(a | x)
    margin        q = ∇θ Σ_t (logsumexp_{j != a_t} z_{t,j} - z_{t,a_t})
                                                     the negated log-odds of each answer token
                                                     (`gradian.capture.gradients`'s margin loss): a logit
                                                     margin against the soft maximum of every other
                                                     token, whose gradient does not fade as
                                                     p(a_t) -> 1 (ce's does)

The contrastive query asks why the model now prefers w to a: a training row that pushed w up and
a down counts against the item twice, one that made every answer likelier (a longer-sentence
habit) cancels out. w is what the model says whole, not cut to a's length: a model that now answers
"Capital: Rome" for "Rome" is explained by the rows that taught the "Capital:" habit, which a cut
"Capital:" alone would miss the end of, and an answer that stops early keeps the EOS that ends it.
Each term is a per-example gradient of the index's modules, projected with the
index's projector (`gradian.capture.gradients.per_example_gradients`): the projection is linear, so the
difference of the two projected rows is the projection of the gradient of the difference, and a
query is a vector in the index rows' space (the same width, modules, projection, loss reduction
and activation numerics; `tests/gradian/attribute/test_attribute.py` checks both against autograd).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from circuitkit.core.config import choices
from gradian.attribute.evaluate import SAID_MAX_TOKENS, EvalItem, pad_id, teacher_forced_batch
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import sites_from_names
from gradian.projection.projector import Projector
from gradian.settings.attribute import AttributeConfig

QUERY_LOSSES = choices(AttributeConfig, "query_loss")  # the schema's list: attribute.query_loss, --query-loss
QUERY_BATCH = 8


def _rows(loaded, modules, projector: Projector, prompts: list[list[int]], answers: list[list[int]],
          loss: str, loss_reduction: str, activations: str) -> torch.Tensor:
    batch = teacher_forced_batch(prompts, answers, pad_id(loaded.tokenizer))
    grads = per_example_gradients(loaded.model, loaded.adapter, modules, projector, batch, loss_reduction, loss,
                                  activations)
    return grads.row().float().cpu()


def query_gradients(loaded, projector: Projector, items: Sequence[EvalItem], query_loss: str,
                    said: Sequence[list[int]] | None = None, loss_reduction: str = "sum",
                    activations: str = "model", batch_size: int = QUERY_BATCH) -> torch.Tensor:
    """(Q, projector.total_width) float32 query gradients of `items` on the tuned model `loaded`.

    `said`: per item what the tuned model says now (token ids, at least one, any length: its greedy
    answer), needed by `contrastive`. `loss_reduction` / `activations`: the index manifest's, so that a query is made
    as the index's rows were. An item whose continuation equals its answer has a zero contrastive
    gradient (nothing to explain): callers pass regressed items only.
    """
    if query_loss not in QUERY_LOSSES:
        raise ValueError(f"query loss {query_loss!r}; valid: {', '.join(QUERY_LOSSES)}.")
    if query_loss == "contrastive":
        if said is None or len(said) != len(items):
            raise ValueError("the contrastive query needs what the tuned model says for every item (`said`).")
        bad = [it.item for it, s in zip(items, said, strict=True) if not s]
        if bad:
            raise ValueError(f"items {bad[:5]}: what the model says has no token; give its greedy answer.")
    modules = sites_from_names(loaded.model, loaded.adapter, projector.names)
    out = torch.empty(len(items), projector.total_width, dtype=torch.float32)
    for start in range(0, len(items), batch_size):
        part = list(items[start:start + batch_size])
        prompts = [it.prompt_ids for it in part]
        loss = "margin" if query_loss == "margin" else "ce"
        q = _rows(loaded, modules, projector, prompts, [it.answer_ids for it in part], loss, loss_reduction,
                  activations)
        if query_loss == "contrastive":
            q -= _rows(loaded, modules, projector, prompts, [list(s) for s in said[start:start + len(part)]], "ce",
                       loss_reduction, activations)
        out[start:start + len(part)] = q
    return out


def query_record(query_loss: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the result records of how the queries were made (`said`: how "what the tuned model
    says" was read, the contrastive query's second term)."""
    return {"query_loss": query_loss, "loss_reduction": manifest.get("loss_reduction", "sum"),
            "index_loss": manifest.get("loss", "ce"), "activations": manifest.get("activations", "model"),
            "said": {"decoding": "greedy", "max_tokens": SAID_MAX_TOKENS, "ends_at": "eos or max_tokens"}}
