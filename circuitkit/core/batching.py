"""Batches of rows of very different lengths: which rows share a batch.

One planner for both halves: Gradian's index and queries (`gradian.data.rows`) and attribution over
a task's pairs (`circuitkit.discovery.tasks.base.TaskData.length_batches`). A batch is right-padded to its
longest row, so a batch of rows of similar length computes little padding; the plan depends
only on the lengths, so it is the same on every run, every resume and every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# What one more batch costs beyond its tokens, in tokens: the per-layer work that does not grow
# with a batch (kernel launches, hook calls, the per-batch projections and copies). The length
# planner weighs it against padding: it splits the length-sorted rows where that saves more
# than this many padded tokens. A constant per device type, so that the plan depends on the
# lengths (and where it runs) alone. `scripts/bench/calibrate_device.py` measures it on the device
# it runs on (one index batch timed over rows x lengths, fitted as a + b x tokens: a / b tokens).
# On an accelerator a token is cheap and a launch is not, so another batch costs many tokens'
# worth (256: not yet measured on one; the GPU benchmark runs the calibration). On a CPU a token
# of a real model costs milliseconds and another batch almost nothing: the fit on SmolLM2-135M's
# shape (float32, one thread, 1-8 rows x 64-256 tokens, hooks registered once per run) gives 7
# tokens at its 30 layers and 36 at 2 (an earlier fit: a within noise of 0), so 256 there made
# the plan compute padding that cost more than the batches it saved (13.4% padding on the 48-row
# benchmark against 3.1% at 32).
BATCH_OVERHEAD_TOKENS = 256
CPU_BATCH_OVERHEAD_TOKENS = 32


def batch_overhead_tokens(device: object = None) -> int:
    """The planner's per-batch cost in tokens for a device (torch.device, or its type as a string)."""
    kind = getattr(device, "type", device)
    return CPU_BATCH_OVERHEAD_TOKENS if kind == "cpu" else BATCH_OVERHEAD_TOKENS


def plan_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int | None = None,
                 group_by_length: bool = True, overhead_tokens: int = BATCH_OVERHEAD_TOKENS) -> list[list[int]]:
    """Indices into `lengths`, grouped into batches; every index appears exactly once.

    Both limits hold for every batch: at most `batch_size` rows, and a padded size (rows x its
    longest row) within `batch_tokens` (a row longer than the budget gets a batch of its own).

    With `group_by_length`, rows are sorted longest first (ties: lower index first) and cut into
    consecutive batches that minimise padded tokens + `overhead_tokens` per batch, exactly
    (dynamic programming over the sorted rows): a batch closes early where its next rows would
    be mostly padding, and stays whole where padding is cheaper than another batch. The padding
    is never more than filling each batch greedily gives. Without it, batches are consecutive
    runs in source order, each filled as far as the two limits allow. The plan depends only on
    the lengths, so it is the same on every run and every worker.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; it must be >= 1.")
    if batch_tokens is not None and batch_tokens < 1:
        raise ValueError(f"batch_tokens={batch_tokens}; it must be >= 1 (or null).")
    if group_by_length:
        return _plan_by_length(lengths, batch_size, batch_tokens, overhead_tokens)
    plan: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for i in range(len(lengths)):
        width = max(widest, lengths[i])
        if current and len(current) + 1 > rows_within_budget(batch_size, batch_tokens, width):
            plan.append(current)
            current, width = [], lengths[i]
        current.append(i)
        widest = width
    if current:
        plan.append(current)
    return plan


def rows_within_budget(batch_size: int, batch_tokens: int | None, row_length: int) -> int:
    """The token budget rule, in one place: at most `batch_size` rows of `row_length` tokens,
    and at most `batch_tokens` tokens in all (but at least one row)."""
    if batch_tokens is None:
        return batch_size
    return max(1, min(batch_size, batch_tokens // row_length))


def _plan_by_length(lengths: Sequence[int], batch_size: int, batch_tokens: int | None,
                    overhead_tokens: int) -> list[list[int]]:
    """The length-sorted rows cut at the least padded tokens + `overhead_tokens` per batch.

    Sorted longest first, a batch starting at sorted row i is padded to row i's length, so a
    batch of rows i..j-1 costs (j - i) * s[i] + overhead. best[i], the least cost of rows i.., is
    min over the allowed j of that plus best[j], from the end backwards; the allowed j are at most
    `batch_size` rows on, and within the token budget (at least one row). Ties go to the longer
    batch. O(rows x batch rows), vectorised over j.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    if n == 0:
        return []
    s = np.asarray([lengths[i] for i in order], dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        rows = rows_within_budget(min(batch_size, n - i), batch_tokens, int(s[i]))
        sizes = np.arange(1, rows + 1)
        costs = sizes * s[i] + overhead_tokens + best[i + 1:i + rows + 1]
        k = rows - int(np.argmin(costs[::-1]))  # the largest size among the cheapest
        best[i], cut[i] = costs[k - 1], i + k
    plan, i = [], 0
    while i < n:
        plan.append(order[i:int(cut[i])])
        i = int(cut[i])
    return plan


def padded_tokens(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> int:
    """Tokens a plan computes: per batch, its rows x its longest row."""
    return sum(len(b) * max(lengths[i] for i in b) for b in plan)
