"""Integer-programming selection (`pruning.selection=ip`) and the signed rule (`positive`)
beside top_k and bootstrap, on one model and task, in one process (same pairs, same scores).

Edge level, MIB's setting (counterfactual ablation, MIB's grid of shares of the edges), EAP-IG
m = 5 (right rule) on --attr pairs with per-example scores, faithfulness on the next --eval
pairs; the settings of the MIB edge table (`scripts/bench/bench_mib.py`), so its top_k and bootstrap
rows are reproduced here and its edge_pruning row (585-736 s of optimization) compares. Per
selection: CPR, CMD, f at 10 % and at 50 % (pruning.target_sparsity's default), the smallest n
with f >= 0.8 (the first grid share reaching it, then --bisect halvings of the gap before it,
on a log scale), the selection's own time and the curve's. --node adds the head rows (top_k,
positive) from the same run's head scores.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench/bench_selection_ip.py --model fetched:smollm2 \\
        --task ioi --out docs/data/selection_ip_ioi.json --save-scores .cache/sel_ip_ioi.pt
    python scripts/bench/bench_selection_ip.py --render docs/data/selection_ip_ioi.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator
from circuitkit.discovery.pruning.heads import Evaluator, curve_areas, faithfulness, keep_top, sparsity_curve
from circuitkit.discovery.pruning.selection import BootstrapSelector
from circuitkit.discovery.pruning.selection_ip import IPSelector, positive_select
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

TARGET = 0.8


def size_for(curve: list[dict], evaluate_n, bisect: int) -> tuple[int | None, int]:
    """(smallest n found with f >= TARGET, extra evaluations): first grid point, then log-bisection."""
    hit = next((i for i, r in enumerate(curve) if r["faithfulness"] >= TARGET), None)
    if hit is None:
        return None, 0
    hi = curve[hit]["n_kept"]
    lo = curve[hit - 1]["n_kept"] if hit > 0 else 0
    evals = 0
    for _ in range(bisect):
        mid = int(round(math.exp((math.log(max(lo, 1)) + math.log(hi)) / 2)))
        if mid <= lo or mid >= hi:
            break
        evals += 1
        if evaluate_n(mid) >= TARGET:
            hi = mid
        else:
            lo = mid
    return hi, evals


def render(paths: list[str]) -> str:
    lines = ["| task | level | selection | selection s | curve s | CPR | CMD | f at 10 % (n) | f at 50 % (n) |"
             " n for f >= 0.8 (share) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in paths:
        res = json.load(open(path))
        for r in res["rows"]:
            n08 = "not reached" if r["n_for_0.8"] is None else f"{r['n_for_0.8']} ({100 * r['n_for_0.8'] / r['n_total']:.2g} %)"
            lines.append(f"| {res['task']} | {r['level']} | {r['selection']} | {r['selection_s']:.0f} |"
                         f" {r['curve_s']:.0f} | {r['cpr']:.3f} | {r['cmd']:.3f} | {r['f10']:.3f} ({r['n10']}) |"
                         f" {r['f50']:.3f} ({r['n50']}) | {n08} |")
    return "\n".join(lines)


def paths_report(model: str, scores_path: str, time_limit_s: float) -> None:
    """Markdown rows: n, top-k edges on a kept path, |IP ∩ top-k| / n, Σ|s| of top-k's inert edges."""
    from circuitkit.discovery.attribution.eap import graph_of
    from circuitkit.discovery.pruning.heads import CURVE_PERCENTS, curve_count
    from circuitkit.discovery.pruning.selection_ip import edge_graph, on_path

    graph = graph_of(load_model(ModelConfig(name=model, precision="float32"), torch.device("cpu")).adapter)
    valid = graph.edge_mask()
    scores = torch.load(scores_path, weights_only=True)["edges"]
    eg = edge_graph(graph, valid)
    ip = IPSelector(scores, valid, graph, "abs", "path", time_limit_s)
    print("| n kept | top-k edges on a kept path | inert share of top-k's Σ\\|s\\| | IP ∩ top-k |")
    print("|---:|---:|---:|---:|")
    w = scores[valid].abs().numpy()
    for pct in CURVE_PERCENTS[:-1]:
        n = curve_count(pct, int(valid.sum()))
        top = keep_top(scores, n, "abs", valid)[valid].numpy()
        live = on_path(eg, top)
        same = int((ip(n)[valid].numpy() & top).sum())
        print(f"| {n} | {int(live.sum())} ({100 * live.sum() / n:.1f} %) |"
              f" {100 * w[top & ~live].sum() / w[top].sum():.1f} % | {same} ({100 * same / n:.1f} %) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fetched:smollm2")
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--attr", type=int, default=16)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--resamples", type=int, default=100)
    ap.add_argument("--selections", default="top_k,bootstrap,ip,positive", help="also: edge_pruning")
    ap.add_argument("--ip-time-limit", type=float, default=120.0)
    ap.add_argument("--bisect", type=int, default=3)
    ap.add_argument("--mask-steps", type=int, default=12, help="edge_pruning: the MIB edge table's 12 steps")
    ap.add_argument("--mask-lr", type=float, default=0.1)
    ap.add_argument("--mask-pairs", type=int, default=8)
    ap.add_argument("--node", action="store_true", help="also the head rows (top_k, positive)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--save-scores", default=None)
    ap.add_argument("--load-scores", default=None)
    ap.add_argument("--render", nargs="+", default=None)
    ap.add_argument("--paths", default=None, help="saved scores (--save-scores): per grid size, the top-k edges on"
                    " no kept path and the IP's overlap with top-k; no model pass")
    a = ap.parse_args()
    if a.render:
        print(render(a.render))
        return
    if a.paths:
        paths_report(a.model, a.paths, a.ip_time_limit)
        return
    loaded = load_model(ModelConfig(name=a.model, precision="float32"), torch.device("cpu"))
    adapter = loaded.adapter
    data = build_task(a.task, loaded.tokenizer, loaded.path, DataParams(num_examples=a.attr, eval_examples=a.eval,
                                                                   seq_len=a.seq_len),
                      a.attr + a.eval, 0, max_tokens=context_length(loaded.model.config))
    attr, held = data[:a.attr], data[a.attr:]
    t = time.time()
    if a.load_scores:
        saved = torch.load(a.load_scores, weights_only=True)
    else:
        s = attribute(adapter, attr, "eap-ig", "edge", "logit_diff", 5, a.batch_size, progress=False,
                      per_example=True)
        saved = {"edges": s.edges, "head": s.head, "per_edges": s.per_example["edges"],
                 "per_head": s.per_example["head"], "attribution_s": time.time() - t}
        if a.save_scores:
            torch.save(saved, a.save_scores + ".tmp")
            os.replace(a.save_scores + ".tmp", a.save_scores)
    from circuitkit.discovery.attribution.eap import graph_of

    graph = graph_of(adapter)
    valid = graph.edge_mask()
    res = {"model": a.model, "task": a.task, "n_attr": a.attr, "n_eval": a.eval, "attribution_s": saved["attribution_s"],
           "seq_len": a.seq_len if a.task == "induction" else None, "rows": []}
    print(f"attribution {saved['attribution_s']:.0f} s", flush=True)

    runs = [("edge", sel) for sel in a.selections.split(",")]
    if a.node:
        runs += [("node", "top_k"), ("node", "positive")]
    evaluators = {}
    for level, sel in runs:
        if level == "edge":
            ranked, per_ex, mask_valid = saved["edges"], saved["per_edges"], valid
            if "edge" not in evaluators:
                evaluators["edge"] = EdgeEvaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
        else:
            ranked, per_ex, mask_valid = saved["head"], saved["per_head"], None
            if "node" not in evaluators:
                evaluators["node"] = Evaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
        ev = evaluators[level]
        full = torch.ones_like(ranked, dtype=torch.bool) if mask_valid is None else mask_valid
        m_full, m_empty = ev(full), ev(torch.zeros_like(full))
        n_total = int(full.sum())
        t = time.time()
        if sel == "bootstrap":
            selector = BootstrapSelector(per_ex, "abs", a.resamples, 0, mask_valid)
        elif sel == "ip":
            selector = IPSelector(ranked, valid, graph, "abs", "path", a.ip_time_limit)
        elif sel == "edge_pruning":  # the MIB edge table's settings (docs/benchmarks.md)
            from circuitkit.discovery.pruning.optimize import learn_edge_mask

            theta = learn_edge_mask(adapter, attr[:a.mask_pairs], ranked, valid, "logit_diff", a.mask_steps, a.mask_lr,
                                    1.0, a.batch_size)

            def selector(n, theta=theta):
                return keep_top(theta, n, "signed", valid)
        elif sel == "positive":
            def selector(n, ranked=ranked, mask_valid=mask_valid):
                return positive_select(ranked, n, mask_valid)
        else:
            def selector(n, ranked=ranked, mask_valid=mask_valid):
                return keep_top(ranked, n, "abs", mask_valid)
        spent = {"select": time.time() - t, "eval": 0.0}

        def choose(n, selector=selector, spent=spent):
            t0 = time.time()
            mask = selector(n)
            spent["select"] += time.time() - t0
            return mask

        def evaluate(mask, ev=ev, spent=spent):
            t0 = time.time()
            m = ev(mask)
            spent["eval"] += time.time() - t0
            return m
        curve = sparsity_curve(evaluate, ranked, "abs", m_full, m_empty, mask_valid, choose)
        curve_s = spent["eval"]
        cpr, cmd = curve_areas(curve)
        n08, extra = size_for(curve, lambda n, lo=m_empty, hi=m_full: faithfulness(evaluate(choose(n)), hi, lo), a.bisect)
        at = {r["percent_kept"]: r for r in curve}
        row = {"level": level, "selection": sel, "cpr": cpr, "cmd": cmd, "f10": at[10]["faithfulness"],
               "n10": at[10]["n_kept"], "f50": at[50]["faithfulness"], "n50": at[50]["n_kept"], "n_for_0.8": n08,
               "bisect_evals": extra, "n_total": n_total, "selection_s": spent["select"], "curve_s": curve_s,
               "eval_s_total": spent["eval"], "m_full": m_full, "m_empty": m_empty,
               "curve": [(r["n_kept"], r["faithfulness"]) for r in curve]}
        if sel == "ip":
            row["ip_solves"] = {str(k): v for k, v in selector.solves.items()}
            got = {n: int(choose(n).sum()) for n, _ in row["curve"]}
            row["kept_sizes"] = got
        if sel == "positive":
            row["kept_sizes"] = {n: int(choose(n).sum()) for n, _ in row["curve"]}
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "ip_solves")}), flush=True)
        if a.out:
            json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
