"""Batches: rows collated and padded, with their supervision worked out on the host at collate time
(positions, counts, spans), and sent to the device without a wait."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from circuitkit.core.device import send
from gradian.data.rows import Row


@dataclass(frozen=True)
class Supervision:
    """Where a collated batch's N supervised targets are, computed on the host from the rows.

    `example` (N,), `position` (N,) (the hidden position t - 1 whose logits predict token t) and
    `target` (N,) (input_ids[example, t]) int64, in row-major order (grouped by example, in position
    order); `counts` (B,) int64 targets per example; `spans` (B,) int64 each example's last supervised
    token + 1's hidden position (what can carry a gradient); `real_tokens` the batch's non-padding tokens;
    `padded` whether any row is shorter than the batch. The capture reads these instead of asking
    the device (`gradian.capture.gradients`): no `nonzero`, `bincount` or scalar read per batch.
    """

    example: np.ndarray
    position: np.ndarray
    target: np.ndarray
    counts: np.ndarray
    spans: np.ndarray
    real_tokens: int
    padded: bool


SUPERVISION = "supervision"  # the batch key of a `Supervision`


def no_target_error(empty: list[int]) -> ValueError:
    """The error for batch positions `empty` that have no supervised token."""
    return ValueError(f"examples {empty[:10]} of the batch have no supervised token: their gradient would be zero;"
                      " drop them before indexing.")


def supervision_of(rows: Sequence[Row]) -> Supervision:
    """The `Supervision` of `rows` (as `collate` stacks them); ValueError for a row that supervises its
    first token (nothing predicts it) or none at all (its gradient would be zero)."""
    examples, positions, targets, counts, spans = [], [], [], [], []
    for b, row in enumerate(rows):
        sup = np.asarray(row.supervised, dtype=bool)
        if len(sup) and sup[0]:
            raise ValueError("supervised[:, 0] is set: the first token has no preceding position to predict it.")
        t = np.flatnonzero(sup)
        examples.append(np.full(len(t), b, dtype=np.int64))
        positions.append(t - 1)
        targets.append(np.asarray(row.input_ids, dtype=np.int64)[t])
        counts.append(len(t))
        spans.append(int(t[-1]) if len(t) else 0)  # the last target's hidden position t - 1, plus one
    counts = np.asarray(counts, dtype=np.int64)
    if (counts == 0).any():
        raise no_target_error(np.flatnonzero(counts == 0).tolist())
    lengths = [len(r.input_ids) for r in rows]
    return Supervision(np.concatenate(examples), np.concatenate(positions).astype(np.int64),
                       np.concatenate(targets), counts, np.asarray(spans, dtype=np.int64), int(sum(lengths)),
                       min(lengths) != max(lengths))


def collate(rows: Sequence[Row], pad_id: int) -> dict[str, Any]:
    """Stack rows into right-padded tensors.

    Returns ``input_ids`` (B, T) long, padded with ``pad_id``; ``attention_mask`` (B, T) long, 1 on
    real tokens; ``supervised`` (B, T) bool, False on padding; ``row_ids`` (B,) long; and
    ``supervision``, the host-side `Supervision` of the targets (where they are, how many per row).
    T is the longest row in the batch. Convention: ``supervised[b, t]`` means the logits at position t - 1
    predict token t, so the loss uses ``logits[:, :-1][supervised[:, 1:]]`` against
    ``input_ids[:, 1:][supervised[:, 1:]]``. Right padding keeps positions (and position ids)
    identical to the unpadded row. Move it to a device with `to_device`.
    """
    if not rows:
        raise ValueError("collate() needs at least one row.")
    width = max(len(r.input_ids) for r in rows)
    batch = len(rows)
    input_ids = np.full((batch, width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch, width), dtype=np.int64)
    supervised = np.zeros((batch, width), dtype=bool)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[b, :n] = row.input_ids
        attention_mask[b, :n] = 1
        supervised[b, :n] = row.supervised
    out: dict[str, Any] = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
                           "supervised": torch.from_numpy(supervised),
                           "row_ids": torch.tensor([r.row_id for r in rows], dtype=torch.long)}
    with contextlib.suppress(ValueError):  # a row the capture would refuse: it says why, with the batch
        out[SUPERVISION] = supervision_of(rows)
    return out


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The batch's tensors on `device`: pinned and copied `non_blocking` to a CUDA device (the host
    goes on at once), as they are elsewhere; other values (a `Supervision`) as they are."""
    device = torch.device(device)
    return {k: send(v, device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
