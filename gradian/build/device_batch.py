"""Batches sized to the device: the largest token budget the memory estimate fits in free memory.

`grads.batch_size` (8) and `grads.batch_tokens` (batch_size x max_seq_length) are sized for a CPU,
where a batch's work dwarfs its fixed host cost. On an accelerator a batch of 8 rows is a few
milliseconds of device work against a fixed cost per batch (launches, hooks, Python), so the
device waits for the host. With `grads.device_batch: auto` the index picks, on an accelerator,
the largest budget B (tokens, padding included) whose estimated peak (`gradian.build.memory.estimate_grads`)
fits in `FREE_SHARE` of the device's free memory at both extremes of the data's lengths:

    B // longest rows of the longest length      (activations, attention, logits per token)
    B // shortest rows of the shortest length    (per-row buffers: the rows, the supervised logits)

and a row cap of B // shortest, so that the budget, not the cap, closes a batch. Neither falls
below the configured values. Rows do not depend on their batch (`gradian.capture.gradients`), so this
changes the speed and the peak, never the index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from circuitkit.core.device import free_memory_bytes
from circuitkit.preflight.memory import DEVICE_FREE_SHARE as FREE_SHARE
from circuitkit.preflight.memory import largest_fitting

# Budgets are searched in steps of this many tokens, up to MAX_STEPS of them (2M tokens).
TOKEN_STEP = 256
MAX_STEPS = 8192


@dataclass(frozen=True)
class DeviceBatch:
    """The batch limits a run uses and why: `batch_size` rows, `batch_tokens` tokens, `source`
    ("configured" or "device"), `note` a line for the log and the index summary."""

    batch_size: int
    batch_tokens: int
    source: str
    note: str

    def record(self) -> dict:
        return {"batch_size": self.batch_size, "batch_tokens": self.batch_tokens, "source": self.source,
                "note": self.note}


def device_batch(setting: str, device: torch.device, batch_size: int, batch_tokens: int, shortest: int,
                 longest: int, estimate_bytes: Callable[[int, int], int],
                 free_bytes: int | None = None) -> DeviceBatch:
    """The batch limits for `device` (module docstring). `estimate_bytes(rows, length)`: the estimated
    peak of a batch of `rows` rows of `length` tokens, less what is already on the device (the
    weights); `free_bytes`: the device's free memory (read when None)."""
    configured = DeviceBatch(batch_size, batch_tokens, "configured",
                             f"batches of at most {batch_size} rows and {batch_tokens} tokens (as configured)")
    if setting == "off" or device.type == "cpu":
        return configured
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    budget = FREE_SHARE * free

    def fits(steps: int) -> bool:
        tokens = steps * TOKEN_STEP
        return all(estimate_bytes(max(1, tokens // length), length) <= budget for length in (longest, shortest))

    tokens = largest_fitting(fits, MAX_STEPS) * TOKEN_STEP
    if tokens <= batch_tokens:
        return DeviceBatch(batch_size, batch_tokens, "configured",
                           f"batches of at most {batch_size} rows and {batch_tokens} tokens (as configured: no"
                           f" larger batch fits {FREE_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device.type})")
    rows = max(batch_size, tokens // max(shortest, 1))
    return DeviceBatch(rows, tokens, "device",
                       f"batches of at most {rows} rows and {tokens} tokens, the largest the memory estimate fits in"
                       f" {FREE_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device.type} (grads.device_batch=auto;"
                       f" configured: {batch_size} rows, {batch_tokens} tokens)")
