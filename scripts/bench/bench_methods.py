"""Circuit-discovery methods side by side at head level, on one model, same pairs.

For each task, every method scores the heads on the same attribution pairs, and every ranking
is measured on the same held-out pairs (`pruning.heads.Evaluator`, corrupted ablation, MLPs and
embeddings live): the smallest head count k whose top k reach faithfulness >= 0.8 (`smallest_k`:
k = step, 2 step, ... then one by one above the last miss), f at 10 % of the heads, the wall
seconds of the attribution (plus the mask optimization where it applies) and its peak memory
(`measure_peak`: live tensor bytes plus the weights).

    exact            exact patching of every head (the oracle), ranked by |effect|
    exact-signed     the same effects ranked by signed effect
    eap-ig           EAP-IG (discovery.ig_steps, ig_rule), ranked by |score| (pruning.rank_by=abs)
    eap-ig-signed    the same scores ranked by signed score (rank_by=signed)
    eap-ig-positive  the best k positive scores only (pruning.selection=positive)
    eap-ig-mask      a head mask learned from the EAP-IG warm start (pruning.selection=mask)
    eap-gp           EAP-GP (GradPath), ranked by |score|
    acdc             ACDC at node level (discovery.acdc_threshold): its own circuit (heads scoring
                     >= the threshold) and its per-head effects as a signed ranking

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python scripts/bench/bench_methods.py --model fetched:smollm2 \\
        --tasks ioi,induction --pairs 16 --timeout-s 1200 --json /tmp/bench_methods.json

--pairs sets both the attribution and the held-out count (default: the project's data_params,
128 + 64); every other data parameter is the project's default for the task.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.table import Table

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution import run_attribution
from circuitkit.discovery.config import DataParams, DiscoveryConfig, PruningConfig, mask_steps_of
from circuitkit.discovery.pruning.heads import Evaluator, curve_count, faithfulness
from circuitkit.discovery.pruning.optimize import learn_head_mask
from circuitkit.discovery.pruning.selection import keep_top
from circuitkit.discovery.pruning.selection_ip import positive_select
from circuitkit.discovery.tasks import build_task, corruption_of
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

# method -> (the attribution it ranks, its selection rule: abs | signed | positive | mask)
METHODS = {"exact": ("exact", "abs"), "exact-signed": ("exact", "signed"), "eap-ig": ("eap-ig", "abs"),
           "eap-ig-signed": ("eap-ig", "signed"), "eap-ig-positive": ("eap-ig", "positive"),
           "eap-ig-mask": ("eap-ig", "mask"), "eap-gp": ("eap-gp", "abs"), "acdc": ("acdc", "signed")}
TARGET_F = 0.8
COMPARE_PERCENT = 10  # f at 10 % of the heads (27 of SmolLM2's 270)


class TimedOut(Exception):
    """An attribution ran past its --timeout-s."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TimedOut in the enclosed block after `seconds` (None or 0: no limit). SIGALRM: the
    main thread only; the model code returns to Python at every hook, so the cut comes within one forward."""
    if not seconds:
        yield
        return

    def fire(signum, frame):
        raise TimedOut

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def smallest_k(faith: Callable[[int], float], n_total: int, target: float = TARGET_F,
               step: int = 8) -> tuple[int | None, list[tuple[int, float]]]:
    """The smallest k with faith(k) >= target, scanning k = step, 2 step, ..., n_total, then one
    by one from the last miss + 1 up to the first coarse hit: (k or None, [(k, f) evaluated, in k order]).

    Faithfulness is not monotone in k: a k below the last coarse miss that would reach the target
    is not looked for (the answer is the first hit after the coarse grid's last miss).
    """
    seen: dict[int, float] = {}

    def f(k: int) -> float:
        if k not in seen:
            seen[k] = faith(k)
        return seen[k]

    grid = [*range(step, n_total, step), n_total]
    hit = next((k for k in grid if f(k) >= target), None)
    if hit is not None:
        below = max((k for k in grid if k < hit), default=0)
        hit = next(k for k in range(below + 1, hit + 1) if f(k) >= target)
    return hit, sorted(seen.items())


def measured(fn: Callable[[], object], adapter, timeout_s: float | None) -> tuple[object, float, int]:
    """(fn(), wall seconds, peak bytes incl. the weights); TimedOut past `timeout_s`."""
    t0 = time.perf_counter()
    with measure_peak(torch.device("cpu"), lambda: module_bytes(adapter.model)) as peak, time_limit(timeout_s):
        out = fn()
    return out, time.perf_counter() - t0, peak.peak_bytes


def chooser(rule: str, scores: torch.Tensor) -> tuple[Callable[[int], torch.Tensor], int]:
    """(k -> kept head mask (L, H), the most heads the rule can keep) for abs / signed / positive;
    `mask` ranks the learned logits by signed value, as pruning.selection=mask does."""
    if rule == "positive":
        return (lambda k: positive_select(scores, k)), int((scores > 0).sum())
    return (lambda k: keep_top(scores, k, "abs" if rule == "abs" else "signed")), scores.numel()


def run_task(adapter, attr, held, methods: list[str], batch_size: int = 4, timeout_s: float | None = None,
             step: int = 8, metric: str = "logit_diff", log: Callable[[str], None] = print) -> dict:
    """Every method of `methods` on the attribution pairs `attr`, every ranking measured on `held`.

    Returns {"m_full", "m_empty", "n_heads", "compare_k", "rows": [one dict per method]}; a row has
    method, attribution, rule, status ("ok" or "not finished in N s"), wall_s, peak_mib, k_at_target,
    f_at_k, f_at_compare, points [(k, f)], and for acdc circuit_heads, circuit_f.
    """
    evaluate = Evaluator(adapter, held, metric, "corrupted", None, batch_size)
    n_heads = adapter.n_layers * adapter.n_heads
    m_full, m_empty = evaluate(None), evaluate(torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.bool))
    compare_k = curve_count(COMPARE_PERCENT, n_heads)

    def f_of(kept: torch.Tensor) -> float:
        return faithfulness(evaluate(kept), m_full, m_empty)

    attributions: dict[str, tuple] = {}  # algorithm -> (scores or None, wall_s, peak_bytes, status)
    rows = []
    for method in methods:
        algorithm, rule = METHODS[method]
        if algorithm not in attributions:
            cfg = DiscoveryConfig(algorithm=algorithm, level="node", metric=metric, batch_size=batch_size,
                                  per_example=False)
            try:
                attributions[algorithm] = (*measured(lambda cfg=cfg: run_attribution(adapter, attr, cfg, progress=False),
                                                     adapter, timeout_s), "ok")
            except TimedOut:
                attributions[algorithm] = (None, float(timeout_s), 0, f"not finished in {timeout_s:g} s")
            log(f"{algorithm}: {attributions[algorithm][3]}, {attributions[algorithm][1]:.1f} s")
        scores, wall_s, peak_bytes, status = attributions[algorithm]
        row = {"method": method, "attribution": algorithm, "rule": rule, "status": status, "wall_s": wall_s,
               "peak_mib": peak_bytes / 2**20, "k_at_target": None, "f_at_k": None, "f_at_compare": None,
               "points": []}
        if scores is not None and rule == "mask":
            p = PruningConfig(scope="heads", selection="mask")
            try:
                theta, mask_s, mask_peak = measured(
                    lambda p=p, head=scores.head: learn_head_mask(adapter, attr, head, metric, mask_steps_of(p),
                                                                  p.mask_lr, p.mask_penalty, batch_size),
                    adapter, timeout_s)
                row.update(wall_s=wall_s + mask_s, peak_mib=max(peak_bytes, mask_peak) / 2**20, mask_s=mask_s,
                           mask_steps=mask_steps_of(p))
                ranked = theta
            except TimedOut:
                row.update(status=f"mask not finished in {timeout_s:g} s", wall_s=wall_s + timeout_s)
                scores = None
        elif scores is not None:
            ranked = scores.head
        if scores is not None:
            choose, n_max = chooser(rule, ranked)
            k, points = smallest_k(lambda k, choose=choose: f_of(choose(k)), n_max, TARGET_F, step)
            row.update(k_at_target=k, f_at_k=dict(points).get(k), f_at_compare=f_of(choose(compare_k)),
                       points=points, max_heads=n_max)
            if algorithm == "acdc":  # ACDC's own circuit: the heads it kept (score >= threshold)
                kept = scores.head >= scores.info["threshold"]
                row.update(threshold=scores.info["threshold"], circuit_heads=int(kept.sum()), circuit_f=f_of(kept),
                           acdc_nodes_kept=scores.info["kept"])
        rows.append(row)
        log(json.dumps({key: v for key, v in row.items() if key != "points"}))
    return {"m_full": m_full, "m_empty": m_empty, "n_heads": n_heads, "compare_k": compare_k, "rows": rows}


def print_table(results: dict, console: Console) -> None:
    """One rich table per task."""
    for task in results["tasks"]:
        table = Table(title=f"{task['task']}: {task['n_attr']} attribution + {task['n_eval']} held-out pairs,"
                            f" {task['seq_len']} tokens (padded); f >= {TARGET_F} on the held-out pairs")
        for col in ("method", "rule", f"smallest k (f >= {TARGET_F})", "f at k", f"f at {task['compare_k']}",
                    "wall s", "peak MiB", "note"):
            table.add_column(col, justify="right")
        for r in task["rows"]:
            note = r["status"] if r["status"] != "ok" else ""
            if "circuit_heads" in r:
                note = f"circuit (τ={r['threshold']:g}): {r['circuit_heads']} heads, f {r['circuit_f']:.3f}"
            if r["k_at_target"] is None and r["status"] == "ok":
                note = f"never reached (at most {r['max_heads']} heads)"
            table.add_row(r["method"], r["rule"], str(r["k_at_target"] or "–"),
                          "–" if r["f_at_k"] is None else f"{r['f_at_k']:.3f}",
                          "–" if r["f_at_compare"] is None else f"{r['f_at_compare']:.3f}",
                          f"{r['wall_s']:.0f}", f"{r['peak_mib']:.0f}" if r["peak_mib"] else "–", note)
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetched:smollm2")
    parser.add_argument("--tasks", default="ioi,induction")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--pairs", type=int, default=None,
                        help="attribution pairs, and as many held-out ones (default: data_params' 128 + 64)")
    parser.add_argument("--batch-size", type=int, default=DiscoveryConfig().batch_size)
    parser.add_argument("--timeout-s", type=float, default=None, help="cut off one attribution after this long")
    parser.add_argument("--step", type=int, default=8, help="coarse step of the smallest-k scan")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets the whole table
    loaded = load_model(ModelConfig(name=args.model, precision="float32"), torch.device("cpu"))
    results = {"model": args.model, "precision": "float32", "threads": torch.get_num_threads(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg(),
               "weights_mib": module_bytes(loaded.model) / 2**20,
               "args": vars(args), "tasks": []}
    for task in args.tasks.split(","):
        defaults = DataParams()
        n_attr = args.pairs or defaults.num_examples
        n_eval = args.pairs or defaults.eval_examples
        dp = DataParams(num_examples=n_attr, eval_examples=n_eval)
        data = build_task(task, loaded.tokenizer, loaded.path, dp, n_attr + n_eval, args.seed,
                          max_tokens=context_length(loaded.model.config))
        attr, held = data[:n_attr], data[n_attr:]
        console.print(f"{task}: {len(attr)} + {len(held)} pairs, {data.clean_ids.shape[1]} tokens (padded)")
        out = run_task(loaded.adapter, attr, held, methods, args.batch_size, args.timeout_s, args.step,
                       log=console.print)
        results["tasks"].append({"task": task, "corruption": corruption_of(task, dp), "n_attr": len(attr),
                                 "n_eval": len(held), "seq_len": int(data.clean_ids.shape[1]),
                                 "mean_tokens": float(data.attention_mask.sum(1).float().mean()), **out})
        results["load_end"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    print_table(results, console)


if __name__ == "__main__":
    main()
