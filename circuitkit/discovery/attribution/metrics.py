"""Metrics: one scalar per example from the logits at the answer position.

Higher always means "more like the clean behaviour", so a positive attribution score means
the component carries the clean behaviour:

    logit_diff  mean logit of the correct answers - mean logit of the incorrect ones
    prob_diff   total probability of the correct answers - that of the incorrect ones
    logprob     log of the total probability of the correct answers
    kl          -KL(p_clean || p) over the whole vocabulary (0 on the clean input)
"""

from __future__ import annotations

import torch

from circuitkit.core.config import choices
from circuitkit.discovery.config import DiscoveryConfig
from circuitkit.discovery.tasks.base import AnswerColumns, TaskData

METRICS = choices(DiscoveryConfig, "metric")


def answer_forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                   answer_pos: AnswerColumns | torch.Tensor) -> torch.Tensor:
    """Forward pass that projects only the answer positions onto the vocabulary: (B, V).

    `logits_to_keep` skips the unembedding of every other position, which saves
    B * (T - 1) * V logits (and their gradient) per pass; the values are the model's own.
    `answer_pos`: the batch's collated `AnswerColumns` (`TaskData.answers`), or the positions
    (B,), whose distinct values are then found on the device (a wait for it).
    """
    columns = answer_pos if isinstance(answer_pos, AnswerColumns) else AnswerColumns.on_device(answer_pos)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=columns.keep).logits  # (B, k, V)
    return logits[torch.arange(ids.shape[0], device=logits.device), columns.row.to(logits.device)]


def answer_logits(logits: torch.Tensor, batch: TaskData) -> torch.Tensor:
    """(B, T, V) -> (B, V) float32 logits at each example's answer position ((B, V) passes through)."""
    if logits.dim() == 2:
        return logits.float()
    idx = batch.answer_pos.to(logits.device)
    return logits[torch.arange(logits.shape[0], device=logits.device), idx].float()


def _gather(values: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (B, V), tokens (B, K) padded with -1 -> gathered (B, K) and validity mask (B, K)."""
    tokens = tokens.to(values.device)
    valid = tokens >= 0
    return values.gather(1, tokens.clamp(min=0)), valid


def compute_metric(name: str, logits: torch.Tensor, batch: TaskData,
                   clean_answer_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example metric (B,) in float32 from logits (B, T, V), or answer logits (B, V).

    `clean_answer_logits` (B, V) is needed by `kl` (the clean run's answer logits).
    """
    final = answer_logits(logits, batch)
    if name == "logit_diff":
        good, gv = _gather(final, batch.correct)
        bad, bv = _gather(final, batch.incorrect)
        return (good * gv).sum(1) / gv.sum(1) - (bad * bv).sum(1) / bv.sum(1)
    if name == "prob_diff":
        probs = final.softmax(-1)
        good, gv = _gather(probs, batch.correct)
        bad, bv = _gather(probs, batch.incorrect)
        return (good * gv).sum(1) - (bad * bv).sum(1)
    if name == "logprob":
        logp = final.log_softmax(-1)
        good, gv = _gather(logp, batch.correct)
        return torch.logsumexp(good.masked_fill(~gv, float("-inf")), dim=1)
    if name == "kl":
        if clean_answer_logits is None:
            raise ValueError("metric 'kl' needs the clean run's answer logits")
        p_clean = clean_answer_logits.float().log_softmax(-1)
        logp = final.log_softmax(-1)
        return -(p_clean.exp() * (p_clean - logp)).sum(-1)
    raise ValueError(f"Unknown metric {name!r}; choose one of {', '.join(METRICS)}.")
