"""Stability of edge circuits (Meloux et al.'s Jaccard >= 0.8 over 100 resamples)
against the levers the field names, on one model and task, from one set of per-example scores.

Edge level, the settings of the MIB edge table (`scripts/bench/bench_mib.py`): EAP-IG m = 5 (right
rule), logit difference, counterfactual ablation, |score|, MIB's grid of shares for CPR / CMD.
The evaluation pairs are fixed for every row: pairs 16..31 of seed 0 (the table's held-out
pairs); the attribution pool is pairs 0..15 (the table's attribution pairs) then 32, 33, ...,
so the 16-pair rows reproduce the table's. `--attribute` scores the pool in chunks of 16 pairs
(per-example scores, saved after each chunk, so a cut run keeps its chunks).

A row = a selector applied to the first N pairs. Its Jaccard is the selector's own stability:
the selector rerun on each of R bootstrap resamples of the N pairs (`selection.bootstrap_weights`,
seed 0) against its set on all N (`stability.selector_stability`), at 1 % (706 edges, the
table's size), 10 % (7,065) and 50 % (35,325, pruning.target_sparsity's default). "select s": the rule built and one kept set chosen (mean over the sizes).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/experiments/exp_edge_stability.py --attribute --pool 128 \\
        --scores .cache/edge_stab_scores.pt
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/experiments/exp_edge_stability.py --scores .cache/edge_stab_scores.pt \\
        --pairs 16,32,64,128 --selections top_k,bootstrap,mean_rank,lcb --curves top_k@16,mean_rank@64 \\
        --out docs/data/edge_stability_ioi.json
    python scripts/experiments/exp_edge_stability.py --render docs/data/edge_stability_ioi.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from circuitkit.discovery.attribution.eap import attribute, graph_of
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator
from circuitkit.discovery.pruning.heads import curve_areas, keep_top, sparsity_curve
from circuitkit.discovery.pruning.selection import BootstrapSelector, RankSelector
from circuitkit.discovery.pruning.stability import selector_stability
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

N_EVAL = 16
FIRST = 16  # the table's attribution pairs come first in the pool


def load(model: str):
    loaded = load_model(ModelConfig(name=model, precision="float32"), torch.device("cpu"))
    return loaded


def build(loaded, task: str, n_total: int):
    return build_task(task, loaded.tokenizer, loaded.path, DataParams(num_examples=n_total, eval_examples=N_EVAL),
                      n_total, 0, max_tokens=context_length(loaded.model.config))


def pool_indices(pool: int) -> list[int]:
    """Attribution pool: pairs 0..15, then 32.. (16..31 are the fixed evaluation pairs)."""
    return list(range(FIRST)) + list(range(FIRST + N_EVAL, FIRST + N_EVAL + pool - FIRST))


def run_attribution(a) -> None:
    loaded = load(a.model)
    idx = pool_indices(a.pool)
    data = build(loaded, a.task, max(idx) + 1)
    saved = torch.load(a.scores, weights_only=True) if os.path.exists(a.scores) else {"chunks": [], "chunk_s": []}
    for c in range(len(saved["chunks"]), a.pool // 16):
        rows = torch.tensor(idx[16 * c:16 * (c + 1)])
        t = time.time()
        s = attribute(loaded.adapter, data[rows], "eap-ig", "edge", "logit_diff", 5, a.batch_size, progress=False,
                      per_example=True)
        saved["chunks"].append(s.per_example["edges"].clone())
        saved["chunk_s"].append(time.time() - t)
        torch.save(saved, a.scores + ".tmp")
        os.replace(a.scores + ".tmp", a.scores)
        print(f"chunk {c}: pairs {idx[16 * c]}.. {saved['chunk_s'][-1]:.0f} s", flush=True)


def selectors(per_ex: torch.Tensor, valid: torch.Tensor, resamples: int) -> dict:
    """name -> make(rows) -> choose(n) -> mask: the rule on the examples `rows` (indices, repeats
    allowed), at any size n. Per-example ranks are computed once for all resamples."""
    ranks = {rule: RankSelector(per_ex, rule, "abs", valid) for rule in ("mean_rank", "vote")}

    def on_mean(key_of):
        def make(rows):
            key = key_of(per_ex[rows].float())
            return lambda n: keep_top(key, n, "signed", valid)
        return make
    return {
        "top_k": on_mean(lambda p: p.mean(0).abs()),
        "bootstrap": lambda rows: BootstrapSelector(per_ex[rows], "abs", resamples, 0, valid),
        "mean_rank": lambda rows: (lambda n: ranks["mean_rank"](n, rows)),
        "vote": lambda rows: (lambda n: ranks["vote"](n, rows)),
        "lcb": on_mean(lambda p: lower_bound(p, 1.0)),
        "lcb2": on_mean(lambda p: lower_bound(p, 2.0)),
    }


def lower_bound(p: torch.Tensor, z: float) -> torch.Tensor:
    """|mean| - z * standard error of the mean over the rows (a lower confidence bound on |score|)."""
    p = p.float()
    return p.mean(0).abs() - z * p.std(0) / p.shape[0] ** 0.5


def render(paths: list[str]) -> str:
    order = ["top_k", "bootstrap", "mean_rank", "vote", "lcb", "lcb2"]
    rows = sorted((r for path in paths for r in json.load(open(path))["rows"]),
                  key=lambda r: (r["pairs"], order.index(r["selection"])))
    sizes = sorted({int(k[1:-5]) for r in rows for k in r if k.startswith("j") and k.endswith("_mean")})
    lines = ["| pairs | selection | " + " | ".join(f"Jaccard mean / 5th pct at {n}" for n in sizes)
             + " | select s | stability s | CPR | CMD | f at 10 % | f at 50 % |",
             "|---:|---|" + "---|" * len(sizes) + "---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.get("curve_row") or {}

        def cell(k, c=c):
            return f"{c[k]:.3f}" if k in c else "–"
        jac = " | ".join(f"{r[f'j{n}_mean']:.2f} / {r[f'j{n}_p5']:.2f}" if f"j{n}_mean" in r else "–" for n in sizes)
        lines.append(f"| {r['pairs']} | {r['selection']} | {jac} | {r['select_s']:.1f} | {r['stability_s']:.0f} |"
                     f" {cell('cpr')} | {cell('cmd')} | {cell('f10')} | {cell('f50')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fetched:smollm2")
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--pool", type=int, default=128)
    ap.add_argument("--scores", default=".cache/edge_stab_scores.pt")
    ap.add_argument("--attribute", action="store_true")
    ap.add_argument("--pairs", default="16,32,64,128")
    ap.add_argument("--selections", default="top_k,bootstrap,mean_rank,vote,lcb")
    ap.add_argument("--sizes", default="706,7065,35325")
    ap.add_argument("--resamples", type=int, default=100)
    ap.add_argument("--curves", default="", help="selection@pairs,... rows that also get the faithfulness curve")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render", nargs="+", default=None)
    a = ap.parse_args()
    if a.render:
        print(render(a.render))
        return
    if a.attribute:
        run_attribution(a)
        return
    saved = torch.load(a.scores, weights_only=True)
    per_all = torch.cat(saved["chunks"])
    curves = set(filter(None, a.curves.split(",")))
    loaded = load(a.model) if curves else None
    graph = graph_of(loaded.adapter) if loaded else None
    if graph is None:  # the graph without the weights' evaluation: shapes only
        loaded_graph = load(a.model)
        graph = graph_of(loaded_graph.adapter)
        del loaded_graph
    valid = graph.edge_mask()
    sizes = [int(s) for s in a.sizes.split(",")]
    res = json.load(open(a.out)) if a.out and os.path.exists(a.out) else {"rows": []}
    res.update({"model": a.model, "task": a.task, "n_eval": N_EVAL, "chunk_s": saved["chunk_s"],
                "n_total": int(valid.sum())})
    ev = m_full = m_empty = None
    for pairs in [int(p) for p in a.pairs.split(",")]:
        if pairs > per_all.shape[0]:
            print(f"skip {pairs} pairs: {per_all.shape[0]} scored", flush=True)
            continue
        per_ex = per_all[:pairs]
        builders = selectors(per_ex, valid, a.resamples)
        for sel in a.selections.split(","):
            build_sel = builders[sel]
            t = time.time()
            everything = torch.arange(pairs)
            select = build_sel(everything)
            kept = {n: select(n) for n in sizes}
            select_s = time.time() - t
            t = time.time()
            def select_sizes(rows, build_sel=build_sel):
                one = build_sel(rows)
                return [one(n) for n in sizes]
            stab = dict(zip(sizes, selector_stability(pairs, select_sizes, [kept[n] for n in sizes], a.resamples, 0),
                            strict=True))
            row = {"pairs": pairs, "selection": sel, "select_s": select_s / len(sizes), "stability_s": time.time() - t}
            for n in sizes:
                row[f"j{n}_mean"], row[f"j{n}_p5"] = stab[n]["jaccard_mean"], stab[n]["jaccard_p5"]
            if f"{sel}@{pairs}" in curves:
                if ev is None:
                    data = build(loaded, a.task, FIRST + N_EVAL)
                    ev = EdgeEvaluator(loaded.adapter, data[FIRST:FIRST + N_EVAL], "logit_diff", "corrupted", None,
                                       a.batch_size)
                    m_full, m_empty = ev(valid), ev(torch.zeros_like(valid))
                ranked = per_ex.float().mean(0)
                t = time.time()
                curve = sparsity_curve(ev, ranked, "abs", m_full, m_empty, valid, select)
                cpr, cmd = curve_areas(curve)
                at = {r["percent_kept"]: r for r in curve}
                row["curve_row"] = {"cpr": cpr, "cmd": cmd, "f10": at[10]["faithfulness"], "f50": at[50]["faithfulness"],
                                    "curve_s": time.time() - t, "m_full": m_full, "m_empty": m_empty,
                                    "curve": [(r["n_kept"], r["faithfulness"]) for r in curve]}
            for r in res["rows"]:  # a rerun without the curve keeps the earlier curve
                if (r["pairs"], r["selection"]) == (pairs, sel) and "curve_row" in r and "curve_row" not in row:
                    row["curve_row"] = r["curve_row"]
            res["rows"] = [r for r in res["rows"] if (r["pairs"], r["selection"]) != (pairs, sel)] + [row]
            print(json.dumps({k: v for k, v in row.items() if k != "curve_row"}
                             | {k: v for k, v in (row.get("curve_row") or {}).items() if k != "curve"}), flush=True)
            if a.out:
                json.dump(res, open(a.out + ".tmp", "w"), indent=1)
                os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
