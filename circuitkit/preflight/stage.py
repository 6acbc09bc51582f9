"""Memory preflight: will the selected stages fit on this device? Decided before loading weights.

Each stage declares its estimate (`Stage.memory`: `circuitkit.discovery.attribution.memory` for
attribution, `circuitkit.discovery.pruning.memory` for pruning, `gradian.build.memory` for the grads stage),
computed from the model's shape
(`conf/model/*.yaml` or its config.json, never its weights); this module imports no domain.
When one exceeds `preflight.headroom` × the device's free
memory, the stage stops with a table of the terms and the knobs that lower the peak, in the
order worth trying (the stage's `advice`: for attribution `discovery.batch_size` with the
largest value that fits, then the sequence length; for pruning the evaluation batch, the
held-out pairs it records, then the selection and scope; keys that do not change the peak, such
as num_examples or ig_steps, are never suggested for memory). A stage may add a line (`note`):
EAP-IG's time/accuracy from the measured table (`circuitkit.discovery.attribution.tradeoffs`).
On a device without native bf16 it prints one line: the default (`model.precision=auto`) runs in
float32 there, an explicit bfloat16 is kept; the line gives the measured or expected slowdown and
the key to set. The estimates read the dtype the run uses (`circuitkit.core.device.model_dtype`).
A stage whose estimate says which batch it was taken at (`MemoryEstimate.lengths`: the circuit
stages estimate at the tokenized prompts, `circuitkit.discovery.data_lengths`) gets one line
naming its length and why, also recorded in the manifest (`{stage}_lengths`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from circuitkit.core.device import free_memory_bytes, get_device, resolve_precision
from circuitkit.core.io import _atomic
from circuitkit.core.pipeline import RunContext, Stage, StageResult
from circuitkit.models.loading import check_model
from circuitkit.preflight.memory import MemoryEstimate

log = logging.getLogger(__name__)


class PreflightError(RuntimeError):
    """The estimated peak does not fit; the message holds the terms and what to change."""


def table(estimate: MemoryEstimate, free_bytes: int, headroom: float, title: str) -> Table:
    """Terms of the estimate next to the device budget."""
    t = estimate.table()
    t.title = title
    t.caption = (f"total {estimate.total_bytes / 2**30:.2f} GiB; free {free_bytes / 2**30:.2f} GiB on"
                 f" {get_device()}, usable at headroom {headroom:.0%}: {headroom * free_bytes / 2**30:.2f} GiB")
    return t


def memory_plot(estimate: MemoryEstimate, path: Path, budget_bytes: int) -> Path:
    """Horizontal bar chart of the terms, with the device budget as a line."""
    import matplotlib  # lazily: plotting is the slowest import of a run's startup

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def check(cfg: Any, stages: Sequence[Stage], console: Console | None = None) -> dict[str, MemoryEstimate]:
    """Estimate each of `stages` that declares a memory estimate, compare with free memory, and
    raise PreflightError (on_exceed=error) naming every stage that does not fit and what to change.

    Returns {stage name: estimate} for the stages that have one under `cfg`.
    """
    console = console or Console(stderr=True)
    if line := resolve_precision(cfg.model.precision).advice():
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # one line, also in a log
    free = free_memory_bytes()
    budget = int(cfg.preflight.headroom * free)
    estimates: dict[str, MemoryEstimate] = {}
    problems = []
    split = cfg.model.device_map is not None  # each device against its own free memory (_check_split)
    for stage in stages:
        if stage.memory is None or (estimate := stage.memory.estimate(cfg)) is None:
            continue
        estimates[stage.name] = estimate
        if line := estimate.lengths.get("line"):  # which batch the estimate is for, and why that length
            console.print(f"{stage.name}: {line}", markup=False, highlight=False, soft_wrap=True)
        if split or estimate.total_bytes <= budget:
            continue
        tips = stage.memory.advice(cfg, budget)
        console.print(table(estimate, free, cfg.preflight.headroom, f"{stage.name} does not fit"))
        problems.append(f"estimated {stage.name} peak {estimate.total_bytes / 2**30:.2f} GiB exceeds"
                        f" {cfg.preflight.headroom:.0%} of the {free / 2**30:.2f} GiB free on {get_device()}."
                        f" Try, in order: {'; '.join(tips)}.")
    for stage in stages:
        if stage.memory is not None and stage.memory.note is not None and (line := stage.memory.note(cfg)):
            console.print(f"time/accuracy: {line}", markup=False, highlight=False)
    if split:
        problems += _check_split(cfg, estimates, console)
    if problems and cfg.preflight.on_exceed == "error":
        raise PreflightError(" ".join(problems) + " (preflight.on_exceed=warn runs anyway.)")
    for message in problems:
        log.warning(message)
    return estimates


def _check_split(cfg: Any, estimates: dict[str, MemoryEstimate], console: Console) -> list[str]:
    """model.device_map: a table per stage of each device's share (weights it holds, the other
    terms in proportion to the layers it runs), each against that device's free memory."""
    from circuitkit.models.device_shares import per_device_estimates
    from circuitkit.models.placement import device_of

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
        if e.lengths:
            out[f"{stage}_lengths"] = dict(e.lengths)
    return out


def _preflight(ctx: RunContext) -> StageResult:
    """Estimate the peak of the selected stages from the model's shape; stop if one cannot fit."""
    estimates = check(ctx.cfg, ctx.stages, ctx.console)
    free = free_memory_bytes()
    budget = int(ctx.cfg.preflight.headroom * free)
    plots = []
    for stage, estimate in estimates.items():
        ctx.console.print(table(estimate, free, ctx.cfg.preflight.headroom, f"estimated {stage} peak"))
        plots.append(memory_plot(estimate, ctx.run_dir / f"memory_estimate_{stage}.png", budget))
    if not estimates:
        ctx.console.print("no stage with a memory estimate selected (attribution, pruning, grads)")
    out = summary(estimates, free, budget)
    if ctx.cfg.model.device_map is not None:
        from circuitkit.models.device_shares import per_device_estimates

        out["per_device_bytes"] = {stage: {dev: e.total_bytes for dev, e in per_device_estimates(ctx.cfg.model, est).items()}
                                   for stage, est in estimates.items()}
    return StageResult(plots, out)


PREFLIGHT_STAGE = Stage("preflight", ("model", "discovery", "grads", "preflight"), _preflight, cached=False,
                        check=lambda cfg: check_model(cfg.model))
