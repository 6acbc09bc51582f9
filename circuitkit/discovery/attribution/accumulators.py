"""A stage's score and metric sums over its examples, kept on the device until the stage ends.

A batch adds to the sums with device ops only, so no pass, layer or batch makes the host wait
for the device. `to_host` copies every sum in one buffer when the stage ends: the one wait of
the stage. Per-example rows (too many to keep on the device for a whole stage) leave once per
batch through `host_copy`, a queued copy into pinned memory that overlaps the next batch's
passes; they are complete once `to_host`'s blocking copy, queued after them on the same
stream, returns.
"""

from __future__ import annotations

import torch

from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.attribution.metrics import compute_metric
from circuitkit.discovery.tasks.base import TaskData

SCORE_KEYS = ("head", "mlp", "embed", "edges")  # float32 sums that `to_host` divides


def total_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a stage's running totals (metrics, deviations) on `device`: float64, as a Python
    float adds, except on MPS, which has no float64 (float32 there)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def score_accumulators(graph: Graph, edges: bool, device: torch.device) -> dict:
    """Zeroed sums over the examples: head (L, H), mlp (L,), embed () float32; metric (2,)
    float64, the metric on clean and on corrupted inputs; and, at edge level, edges
    (n_upstream, n_downstream) float32."""
    L = graph.n_layers
    out = {"head": torch.zeros(L, graph.n_heads, device=device), "mlp": torch.zeros(L, device=device),
           "embed": torch.zeros((), device=device), "metric": torch.zeros(2, dtype=total_dtype(device), device=device)}
    if edges:
        out["edges"] = torch.zeros(len(graph.upstream), len(graph.downstream), device=device)
    return out


def add_metrics(out: dict, metric: str, clean_logits: torch.Tensor, corrupted_logits: torch.Tensor,
                batch: TaskData, clean_answer: torch.Tensor) -> torch.Tensor:
    """Add the batch's metric sums on clean and corrupted inputs to `out["metric"]`.

    clean_logits, corrupted_logits, clean_answer: (B, V). Returns the clean values (B,) float32.
    Each batch's float32 sum is added in float64, as a Python float would be.
    """
    clean = compute_metric(metric, clean_logits, batch, clean_answer)
    corrupted = compute_metric(metric, corrupted_logits, batch, clean_answer)
    out["metric"] += torch.stack([clean.sum(), corrupted.sum()]).to(out["metric"])
    return clean


def host_copy(rows: torch.Tensor) -> torch.Tensor:
    """`rows` on the host, copied without waiting (pinned memory, from an accelerator): read it
    only after `to_host` has returned. On the CPU it is `rows` itself, so it must not change after."""
    return rows.to("cpu", non_blocking=True)


def to_host(out: dict, divisor: int) -> dict[str, torch.Tensor]:
    """Every tensor of `out` on the host, in one copy: the sums of `SCORE_KEYS` divided by
    `divisor` (float32, on the device, as the scores always were), the other sums (float64:
    metric, ...) as they are, each in its own shape."""
    sums = {k: (v / divisor if k in SCORE_KEYS else v) for k, v in out.items() if isinstance(v, torch.Tensor)}
    for key, value in sums.items():
        if value.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"sum {key!r} is {value.dtype}; the stage's sums are float32 scores or float64 totals")
    # float64 sums travel as pairs of float32 words (a bit-exact view), first, so that each starts
    # at an even offset and views back
    order = sorted(sums, key=lambda k: sums[k].dtype != torch.float64)
    words = [sums[k].reshape(-1).view(torch.float32) for k in order]
    flat = torch.cat(words).cpu()
    host, start = {}, 0
    for key, part in zip(order, words, strict=True):
        piece = flat[start:start + part.numel()]
        start += part.numel()
        host[key] = piece.view(sums[key].dtype).reshape(sums[key].shape)
    return host
