"""Memory preflight: will the selected stages fit on this device? Decided before loading weights.

The estimate comes from `circuitkit.memory` (the model's shape from `conf/model/*.yaml` or its
config.json, never its weights). When it exceeds `preflight.headroom` × the device's free
memory, the stage stops with a table of the terms and the knobs that lower the peak, in the
order worth trying: `discovery.batch_size` (with the largest value that fits), then the
sequence length. Keys that do not change the peak (num_examples, ig_steps: passes run one
after another) are never suggested for memory. For time, EAP-IG gets one line from the measured
speed/accuracy table (`circuitkit.attribution.tradeoffs`): the current ig_rule / ig_steps'
estimated score error and the cheapest measured setting within `preflight.ig_error_budget`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from circuitkit.config import AppConfig
from circuitkit.device import free_memory_bytes, get_device
from circuitkit.memory import (
    MemoryEstimate,
    circuit_module_shapes,
    estimate_attribution,
    estimate_grads,
    linear_module_shapes,
    shape_for,
)
from circuitkit.models.loading import DTYPES

log = logging.getLogger(__name__)


class PreflightError(RuntimeError):
    """The estimated peak does not fit; the message holds the terms and what to change."""


def attribution_estimate(cfg: AppConfig, batch_size: int | None = None, seq_len: int | None = None) -> MemoryEstimate:
    """Estimated peak of the attribution stage for `cfg` (optionally another batch size / length).

    The sequence length is `discovery.data_params.seq_len`: the induction task's length, and the
    length assumed for tasks whose prompts are only known after tokenizing.
    """
    d = cfg.discovery
    shape = shape_for(cfg.model)
    dtype_bytes = torch.finfo(DTYPES[cfg.model.precision]).bits // 8
    return estimate_attribution(shape, dtype_bytes, batch_size or d.batch_size, seq_len or d.data_params.seq_len,
                                d.algorithm, d.level, d.ig_steps)


def grads_estimate(cfg: AppConfig, batch_size: int | None = None, seq_len: int | None = None,
                   supervised: int | None = None, n_rows: int = 0) -> MemoryEstimate:
    """Estimated peak of gradient indexing. Before the data is read, rows are assumed as long
    as `grads.max_seq_length` and fully supervised (the worst case the settings allow); a batch
    holds at most `grads.batch_tokens` tokens, so at most batch_tokens // max_seq_length such rows."""
    g = cfg.grads
    shape = shape_for(cfg.model)
    seq = seq_len or g.max_seq_length
    modules = linear_module_shapes(shape, g.module_filter) if g.circuit is None else _circuit_shapes(cfg, shape)
    rows = batch_size or g.batch_size
    if g.batch_tokens is not None:
        rows = max(1, min(rows, g.batch_tokens // seq))
    return estimate_grads(shape, torch.finfo(DTYPES[cfg.model.precision]).bits // 8, rows, seq,
                          supervised or seq, modules, g.projection, g.projection_dim,
                          torch.finfo(DTYPES[g.storage_dtype]).bits // 8, n_rows)


def _circuit_shapes(cfg: AppConfig, shape) -> dict[str, tuple[int, int]]:
    """Sites of a grads.circuit-restricted index: from the circuit file when it exists already,
    else (grads.circuit=run before pruning has run) every head and MLP, an upper bound."""
    from circuitkit.circuit import kept_components, load_circuit

    path = cfg.grads.circuit if cfg.grads.circuit != "run" else cfg.output_path
    heads = mlps = None
    if path is not None and Path(path).is_file():
        heads, mlps = kept_components(load_circuit(Path(path)))
    if cfg.grads.circuit_mlps == "none":
        mlps = [False] * int(shape["n_layers"])
    return circuit_module_shapes(shape, heads, mlps)


def _largest(fits, limit: int = 1024) -> int:
    """Largest n in 1..limit with fits(n) (fits is monotone), 0 if none."""
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


def grads_advice(cfg: AppConfig, budget_bytes: int) -> list[str]:
    """grads.batch_size first, then grads.max_seq_length: the two settings that move the peak."""
    g = cfg.grads
    best = _largest(lambda b: grads_estimate(cfg, batch_size=b).total_bytes <= budget_bytes, g.batch_size)
    if best:
        return [f"grads.batch_size={best}"]
    seq = _largest(lambda n: grads_estimate(cfg, batch_size=1, seq_len=n).total_bytes <= budget_bytes,
                   g.max_seq_length)
    tips = [f"grads.batch_size=1 with grads.max_seq_length={seq}"] if seq >= 2 else []
    return tips + ["a device with more memory, or a smaller model (storage_dtype, module_filter and"
                   " projection_dim only shrink the index on disk)"]


def largest_fitting_batch(cfg: AppConfig, budget_bytes: int, limit: int = 1024) -> int:
    """The largest discovery.batch_size whose estimate fits `budget_bytes` (0 if even 1 does not)."""
    return _largest(lambda b: attribution_estimate(cfg, batch_size=b).total_bytes <= budget_bytes, limit)


def advice(cfg: AppConfig, budget_bytes: int) -> list[str]:
    """Knobs that bring the attribution peak under `budget_bytes`, in the order to try them."""
    tips = []
    best = largest_fitting_batch(cfg, budget_bytes)
    if 0 < best < cfg.discovery.batch_size:
        tips.append(f"discovery.batch_size={best} (largest that fits; scores do not depend on the batch size)")
    elif best == 0:
        seq = cfg.discovery.data_params.seq_len
        while seq > 8 and attribution_estimate(cfg, batch_size=1, seq_len=seq).total_bytes > budget_bytes:
            seq //= 2
        if attribution_estimate(cfg, batch_size=1, seq_len=seq).total_bytes <= budget_bytes:
            tips.append(f"discovery.batch_size=1 with discovery.data_params.seq_len={seq} (shorter prompts)")
        if cfg.discovery.level == "edge":
            tips.append("discovery.level=node (no per-edge Δ and gradient buffers)")
        if cfg.model.precision == "float32":
            tips.append("model.precision=bfloat16 (half the weight and activation bytes)")
        tips.append("a device with more memory, or a smaller model")
    return tips


def ig_advice(cfg: AppConfig) -> str | None:
    """The speed/accuracy line for EAP-IG (None for other algorithms or without a measured table)."""
    from circuitkit.attribution.tradeoffs import advice_line

    d = cfg.discovery
    return advice_line(d.algorithm, d.level, d.ig_steps, d.ig_rule, cfg.preflight.ig_error_budget)


def table(estimate: MemoryEstimate, free_bytes: int, headroom: float, title: str) -> Table:
    """Terms of the estimate next to the device budget."""
    t = estimate.table()
    t.title = title
    t.caption = (f"total {estimate.total_bytes / 2**30:.2f} GiB; free {free_bytes / 2**30:.2f} GiB on"
                 f" {get_device()}, usable at headroom {headroom:.0%}: {headroom * free_bytes / 2**30:.2f} GiB")
    return t


def memory_plot(estimate: MemoryEstimate, path: Path, budget_bytes: int) -> Path:
    """Horizontal bar chart of the terms, with the device budget as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from circuitkit.io import _atomic

    names = list(estimate.terms)
    values = [estimate.terms[n] / 2**20 for n in names]
    fig, ax = plt.subplots(figsize=(6.5, 0.4 * len(names) + 1.5))
    ax.barh(names, values)
    ax.set_xlabel("MiB")
    ax.set_title(f"estimated peak {estimate.total_bytes / 2**20:.0f} MiB (budget {budget_bytes / 2**20:.0f} MiB)",
                 fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    _atomic(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return Path(path)


def check(cfg: AppConfig, console: Console | None = None) -> dict[str, MemoryEstimate]:
    """Estimate each selected stage that has an estimate, compare with free memory, and raise
    PreflightError (on_exceed=error) naming every stage that does not fit and what to change.

    Returns {stage: estimate} for attribution and grads when selected.
    """
    console = console or Console(stderr=True)
    free = free_memory_bytes()
    budget = int(cfg.preflight.headroom * free)
    estimates: dict[str, MemoryEstimate] = {}
    if "attribution" in cfg.stages:
        estimates["attribution"] = attribution_estimate(cfg)
    if "grads" in cfg.stages and cfg.grads.enabled:
        estimates["grads"] = grads_estimate(cfg)
    problems = []
    # model.device_map: each device against its own free memory, not the whole model against one
    split = _check_split(cfg, estimates, console) if cfg.model.device_map is not None else None
    for stage, estimate in estimates.items():
        if split is not None or estimate.total_bytes <= budget:
            continue
        tips = advice(cfg, budget) if stage == "attribution" else grads_advice(cfg, budget)
        console.print(table(estimate, free, cfg.preflight.headroom, f"{stage} does not fit"))
        problems.append(f"estimated {stage} peak {estimate.total_bytes / 2**30:.2f} GiB exceeds"
                        f" {cfg.preflight.headroom:.0%} of the {free / 2**30:.2f} GiB free on {get_device()}."
                        f" Try, in order: {'; '.join(tips)}.")
    if "attribution" in cfg.stages and (line := ig_advice(cfg)):
        console.print(f"time/accuracy: {line}", markup=False, highlight=False)
    problems += split or []
    if problems and cfg.preflight.on_exceed == "error":
        raise PreflightError(" ".join(problems) + " (preflight.on_exceed=warn runs anyway.)")
    for message in problems:
        log.warning(message)
    return estimates


def _check_split(cfg: AppConfig, estimates: dict[str, MemoryEstimate], console: Console) -> list[str]:
    """model.device_map: a table per stage of each device's share (weights it holds, the other
    terms in proportion to the layers it runs), each against that device's free memory."""
    from circuitkit.models.placement import device_of, per_device_estimates

    problems = []
    for stage, estimate in estimates.items():
        per_device = per_device_estimates(cfg.model, estimate)
        out = Table(title=f"estimated {stage} peak per device (model.device_map)")
        for col in ("device", "weights MiB", "other MiB", "total MiB", "free MiB", "fits"):
            out.add_column(col, justify="right")
        for device, est in per_device.items():
            free = None if device == "disk" else free_memory_bytes(device_of(device))
            fits = free is None or est.total_bytes <= cfg.preflight.headroom * free
            weights = est.terms["weights"]
            out.add_row(device, f"{weights / 2**20:.1f}", f"{(est.total_bytes - weights) / 2**20:.1f}",
                        f"{est.total_bytes / 2**20:.1f}", "-" if free is None else f"{free / 2**20:.1f}",
                        "yes" if fits else "NO")
            if not fits:
                problems.append(f"estimated {stage} share of {device} {est.total_bytes / 2**30:.2f} GiB exceeds"
                                f" {cfg.preflight.headroom:.0%} of its {free / 2**30:.2f} GiB free: give it less"
                                " with model.max_memory, or lower discovery.batch_size / grads.batch_size.")
        console.print(out)
    return problems


def summary(estimates: dict[str, MemoryEstimate], free: int, budget: int) -> dict:
    """Headline numbers of the preflight for the manifest."""
    out: dict = {"free_bytes": free, "fits": all(e.total_bytes <= budget for e in estimates.values())}
    for stage, e in estimates.items():
        out[f"{stage}_estimated_bytes"] = e.total_bytes
        out[f"{stage}_terms"] = dict(e.terms)
    return out

