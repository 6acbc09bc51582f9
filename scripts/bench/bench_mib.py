"""The issue-28 table: per method and selection, CPR, CMD, faithfulness at 10% of heads, stability,
passes and time, on one model and task, all in one process (side by side, same pairs).

Node level (heads, counterfactual ablation, |score|): the head curve over MIB's grid of shares.
Edge level: MIB's own setting (edges, counterfactual ablation, top int(share x n) by |score|).
Each method runs once (per-example scores kept), then each selection reuses its scores.

    OMP_NUM_THREADS=1 python scripts/bench/bench_mib.py --model /work/models/smollm2-135m-instruct \\
        --attr 16 --eval 32 --out .cache/exp/bench_mib.json

Runs are "node:eap", "node:eap-ig", "edge:eap-ig", "node:exact", ... (--runs); eap-ig-activations
uses --act-steps points of --act-rule. --task induction builds --seq-len token prompts.
Selections (--selections): top_k, bootstrap, edge_pruning (edge rows; `circuitkit.discovery.pruning.optimize`,
--mask-steps steps on the first --mask-pairs attribution pairs). --save-scores keeps each run's
scores (plain tensors) so a later process reruns selections on the same scores (--load-scores)
without attributing again; its rows then carry the first process's attribution time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.attribution.eap_activations import attribute_activations
from circuitkit.discovery.attribution.exact import exact_patching
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator
from circuitkit.discovery.pruning.heads import Evaluator, curve_areas, curve_count, keep_top, sparsity_curve
from circuitkit.discovery.pruning.optimize import learn_edge_mask
from circuitkit.discovery.pruning.selection import BootstrapSelector
from circuitkit.discovery.pruning.stability import stability
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model


def render(paths: list[str]) -> str:
    """The markdown table of one or more output JSONs."""
    lines = ["| level | method | selection | passes / batch | attribution s | selection s | curve s | CPR | CMD |"
             " f at 10 % | Jaccard mean / 5th pct (n kept) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for path in paths:
        for r in json.load(open(path))["rows"]:
            stab = ("–" if r["jaccard_mean"] is None
                    else f"{r['jaccard_mean']:.2f} / {r['jaccard_p5']:.2f} ({r['stability_n']})")
            lines.append(f"| {r['level']} | {r['method']} | {r['selection']} | {r['passes_per_batch']} |"
                         f" {r['attribution_s']:.0f} | {'–' if 'selection_s' not in r else format(r['selection_s'], '.0f')} | {r['curve_s']:.0f} | {r['cpr']:.3f} | {r['cmd']:.3f} |"
                         f" {r['f_at_10pct']:.3f} ({r['n_at_10pct']}) | {stab} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--seq-len", type=int, default=24, help="induction prompt length (tokens, BOS included)")
    ap.add_argument("--attr", type=int, default=16)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--act-steps", type=int, default=1)
    ap.add_argument("--act-rule", default="midpoint")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--resamples", type=int, default=100)
    ap.add_argument("--runs", default="node:eap,node:eap-ig,edge:eap-ig,node:eap-ig-activations,node:exact,edge:eap")
    ap.add_argument("--out", default=None)
    ap.add_argument("--selections", default="top_k,bootstrap",
                    help="top_k, bootstrap, edge_pruning (edge rows only: a mask warm-started from the scores)")
    ap.add_argument("--mask-steps", type=int, default=40)
    ap.add_argument("--mask-lr", type=float, default=0.05)
    ap.add_argument("--mask-penalty", type=float, default=1.0)
    ap.add_argument("--mask-pairs", type=int, default=8, help="attribution pairs the edge mask is optimized on")
    ap.add_argument("--save-scores", default=None, help="torch.save each run's scores here (reused by --load-scores)")
    ap.add_argument("--load-scores", default=None, help="reuse these saved scores instead of attributing again")
    ap.add_argument("--render", nargs="+", default=None, help="print the markdown table of these JSONs and exit")
    a = ap.parse_args()
    if a.render:
        print(render(a.render))
        return
    loaded = load_model(ModelConfig(name=a.model, precision="float32"), torch.device("cpu"))
    adapter = loaded.adapter
    data = build_task(a.task, loaded.tokenizer, loaded.path, DataParams(num_examples=a.attr, eval_examples=a.eval,
                                                                   seq_len=a.seq_len),
                      a.attr + a.eval, 0, max_tokens=context_length(loaded.model.config))
    attr, held = data[:a.attr], data[a.attr:]
    res: dict = {"model": a.model, "task": a.task, "n_attr": a.attr, "n_eval": a.eval, "rows": [],
                 "seq_len": a.seq_len if a.task == "induction" else None}
    evaluators: dict = {}
    saved = torch.load(a.load_scores, weights_only=True) if a.load_scores else {}
    to_save: dict = {}

    for run in a.runs.split(","):
        level, method = run.split(":")
        if run in saved:  # a former run's scores (--save-scores): same pairs, no new attribution
            got = saved[run]
        else:
            t = time.time()
            if method == "exact":
                scores = exact_patching(adapter, attr, level, "logit_diff", a.batch_size, progress=False,
                                        per_example=level == "node")
                scores.info["passes"] = f"{1 + scores.head.numel() + scores.mlp.numel() + 2} fwd"
            elif method == "eap-ig-activations":
                scores = attribute_activations(adapter, attr, level, "logit_diff", a.act_steps, a.batch_size, False,
                                               ig_rule=a.act_rule, per_example=True)
            else:
                steps = 1 if method == "eap" else a.ig_steps
                scores = attribute(adapter, attr, "eap-ig" if method == "eap-ig" else "eap", level, "logit_diff",
                                   steps, a.batch_size, progress=False, per_example=True)
            key = "head" if level == "node" else "edges"
            got = {"ranked": scores.head if level == "node" else scores.edges,
                   "per_ex": (scores.per_example or {}).get(key),
                   "valid": None if level == "node" else scores.graph.edge_mask(),
                   "passes": scores.info.get("passes", "exact"), "attribution_s": time.time() - t}
        if a.save_scores:  # plain tensors and numbers: torch.load(weights_only=True) reads them back
            to_save[run] = got
            torch.save(to_save, a.save_scores + ".tmp")
            os.replace(a.save_scores + ".tmp", a.save_scores)
        ranked, per_ex, valid, passes, attr_s = (got[k] for k in ("ranked", "per_ex", "valid", "passes",
                                                                  "attribution_s"))
        if level == "node":
            if "heads" not in evaluators:
                evaluators["heads"] = Evaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
            ev = evaluators["heads"]
        else:
            if "edges" not in evaluators:
                evaluators["edges"] = EdgeEvaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
            ev = evaluators["edges"]
        n_total = ranked.numel() if valid is None else int(valid.sum())
        full = torch.ones_like(ranked, dtype=torch.bool) if valid is None else valid
        m_full, m_empty = ev(full), ev(torch.zeros_like(full))
        selections = [sel for sel in a.selections.split(",")
                      if (sel != "bootstrap" or per_ex is not None) and (sel != "edge_pruning" or level == "edge")]
        for sel in selections:
            t = time.time()
            selector = BootstrapSelector(per_ex, "abs", a.resamples, 0, valid) if sel == "bootstrap" else None
            if sel == "edge_pruning":
                theta = learn_edge_mask(adapter, attr[:a.mask_pairs], ranked, valid, "logit_diff", a.mask_steps,
                                        a.mask_lr, a.mask_penalty, a.batch_size,
                                        progress=lambda st, lo, fa, de: print(f"mask step {st}: loss {lo:.4f}"
                                                                              f" faith {fa:.4f} density {de:.4f}",
                                                                              flush=True))
                selector = functools.partial(keep_top, theta, rank_by="signed", valid=valid)
            select_s = time.time() - t

            def choose(n, selector=selector, ranked=ranked, valid=valid):
                return selector(n) if selector is not None else keep_top(ranked, n, "abs", valid)
            t = time.time()
            curve = sparsity_curve(ev, ranked, "abs", m_full, m_empty, valid, choose)
            curve_s = time.time() - t
            cpr, cmd = curve_areas(curve)
            at10 = next(r for r in curve if r["percent_kept"] == 10)
            n_stab = curve_count(10 if level == "node" else 1, n_total)
            stab = (stability(per_ex, n_stab, "abs", a.resamples, 0, valid, choose(n_stab))
                    if per_ex is not None else None)
            row = {"level": level, "method": method, "selection": sel, "cpr": cpr, "cmd": cmd,
                   "f_at_10pct": at10["faithfulness"], "n_at_10pct": at10["n_kept"],
                   "stability_n": n_stab, "jaccard_mean": stab and stab["jaccard_mean"],
                   "jaccard_p5": stab and stab["jaccard_p5"], "passes_per_batch": passes,
                   "attribution_s": attr_s, "curve_s": curve_s,
                   "selection_s": select_s, "m_full": m_full, "m_empty": m_empty,
                   "curve": [(r["n_kept"], r["faithfulness"]) for r in curve]}
            if level == "node":
                row["ig_steps"] = None if method in ("exact", "eap") else (a.act_steps if "activations" in method
                                                                           else a.ig_steps)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
