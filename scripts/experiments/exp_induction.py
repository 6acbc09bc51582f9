"""Induction on the real model at real scale: the smallest faithful circuit.

For one induction format (`discovery.data_params.induction_format`) on a model, it measures:

* the task itself: m(full), m(corrupted), how often the answer is the model's top-1 token;
* per attribution method (eap, eap-ig, eap-ig-activations, exact) and per selection (top_k,
  bootstrap, mean_rank, vote, and `mask`: heads ranked by a learned soft head mask,
  `circuitkit.discovery.pruning.optimize.learn_head_mask`), the smallest number of heads whose circuit keeps
  faithfulness >= --threshold on the held-out pairs (counterfactual ablation, the pruning stage's
  own evaluator), scanning sizes from 1 up;
* the exact greedy oracle (`circuitkit.discovery.pruning.selection.greedy_heads`: add the head whose addition raises
  the metric most, by real forward passes on --objective attribution pairs, from a pool of the
  union of every method's top --pool-each heads), each prefix measured on the held-out pairs;
* exact backward elimination (--backward-from METHOD:SELECTION): from that row's smallest faithful
  set, drop one head at a time, the one whose removal keeps faithfulness on the --objective pairs
  highest, while it stays >= --threshold; each set measured on the held-out pairs;
* at edge level (--edges): EAP-IG edge scores with top_k / bootstrap / vote, the smallest edge
  count reaching the threshold on a log grid.

Every attribution is cached under --work (same model, format, pairs), so reruns only add rows.

    OMP_NUM_THREADS=1 python scripts/experiments/exp_induction.py --model ~/.cache/circuitkit/models/smollm2-135m-instruct \\
        --format repeat --attr 32 --eval 32 --out docs/data/induction_repeat.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from circuitkit.discovery.attribution import graph_of
from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.attribution.eap_activations import attribute_activations
from circuitkit.discovery.attribution.exact import exact_patching
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator
from circuitkit.discovery.pruning.heads import Evaluator, faithfulness, keep_top
from circuitkit.discovery.pruning.optimize import learn_edge_mask, learn_head_mask
from circuitkit.discovery.pruning.selection import BootstrapSelector, RankSelector, greedy_heads, greedy_mask
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

NODE_GRID = list(range(1, 31)) + list(range(32, 61, 2)) + list(range(64, 137, 8)) + list(range(150, 271, 20))


def edge_grid(n_total: int) -> list[int]:
    """Edge counts from 8 up, ~12 per decade, then all of them."""
    out, k = [], 0
    while True:
        n = int(round(8 * 10 ** (k / 12)))
        if n >= n_total:
            return sorted(set(out)) + [n_total]
        out.append(n)
        k += 1


def heads_subgraph(g, heads: torch.Tensor) -> torch.Tensor:
    """(n_up, n_down) bool: the edges whose ends are the embedding, an MLP, the logits or a head in `heads`
    (L, H) bool (a k / v input: a kept head of its group)."""
    up = torch.zeros(len(g.upstream), dtype=torch.bool)
    up[0] = True
    down = torch.zeros(len(g.downstream), dtype=torch.bool)
    down[g.logits_column] = True
    group = g.n_heads // g.n_kv_heads
    for layer in range(g.n_layers):
        up[g.mlp_index(layer)] = True
        cols = g.layer_columns(layer)
        down[cols.stop - 1] = True
        for h in range(g.n_heads):
            if heads[layer, h]:
                up[g.head_index(layer, h)] = True
                down[cols.start + h] = True
                for kv in (g.n_heads + h // group, g.n_heads + g.n_kv_heads + h // group):
                    down[cols.start + kv] = True
    return up[:, None] & down[None, :]


def task_stats(model, data) -> dict:
    """m(full) and m(corrupted) by logit difference, top-1 rate of the answer, mean p(answer)."""
    with torch.no_grad():
        clean = answer_forward(model, data.clean_ids, data.attention_mask, data.answer_pos).float()
        corr = answer_forward(model, data.corrupted_ids, data.attention_mask, data.answer_pos).float()
    rows = torch.arange(len(data))
    good = data.correct[:, 0]
    return {"m_full": compute_metric("logit_diff", clean, data).mean().item(),
            "m_corrupted": compute_metric("logit_diff", corr, data).mean().item(),
            "top1": (clean.argmax(-1) == good).float().mean().item(),
            "p_answer": clean.softmax(-1)[rows, good].mean().item()}


def smallest(evaluate, grid: list[int], choose, threshold: float, m_full: float, m_empty: float,
             also: tuple[int, ...] = ()) -> dict:
    """Scan `grid` upwards: the first n whose chosen set keeps faithfulness >= threshold, f along the way."""
    seen, first = {}, None
    for n in grid:
        seen[n] = faithfulness(evaluate(choose(n)), m_full, m_empty)
        if seen[n] >= threshold:
            first = n
            break
    for n in also:
        if n not in seen:
            seen[n] = faithfulness(evaluate(choose(n)), m_full, m_empty)
    return {"n_min": first, "f_at_n_min": seen.get(first), "curve": sorted(seen.items())}


def attribution(adapter, attr, level: str, method: str, batch_size: int, cache: Path) -> dict:
    if cache.is_file():
        return torch.load(cache, weights_only=True)
    t = time.time()
    if method == "exact":
        s = exact_patching(adapter, attr, level, "logit_diff", batch_size, progress=False, per_example=True)
    elif method == "eap-ig-activations":
        s = attribute_activations(adapter, attr, level, "logit_diff", 1, batch_size, False, ig_rule="midpoint",
                                  per_example=True)
    else:
        s = attribute(adapter, attr, method, level, "logit_diff", 1 if method == "eap" else 5, batch_size,
                      progress=False, per_example=True)
    key = "head" if level == "node" else "edges"
    got = {"ranked": s.head if level == "node" else s.edges, "per_ex": (s.per_example or {}).get(key),
           "valid": torch.ones(0) if level == "node" else s.graph.edge_mask(), "seconds": time.time() - t}
    torch.save(got, str(cache) + ".tmp")
    os.replace(str(cache) + ".tmp", cache)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", default="single", choices=("single", "repeat"))
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--attr", type=int, default=32)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--methods", default="eap,eap-ig,eap-ig-activations,exact")
    ap.add_argument("--selections", default="top_k,bootstrap,mean_rank,vote,mask")
    ap.add_argument("--greedy", action="store_true", help="run the exact greedy oracle")
    ap.add_argument("--objective", type=int, default=16, help="attribution pairs the greedy oracle maximizes on")
    ap.add_argument("--pool-each", type=int, default=20, help="greedy pool: union of each method's top heads")
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--mask-steps", type=int, default=40)
    ap.add_argument("--mask-lr", type=float, default=0.1)
    ap.add_argument("--backward-from", default=None,
                    help="METHOD:SELECTION of a row in --out: exact backward elimination from its smallest faithful set")
    ap.add_argument("--edges", action="store_true", help="also EAP-IG at edge level")
    ap.add_argument("--edge-selections", default="top_k,bootstrap,vote",
                    help="also mask (edge_pruning) and within_mask (EAP-IG edges among the head mask's --within-heads)")
    ap.add_argument("--edge-mask-steps", type=int, default=12)
    ap.add_argument("--within-heads", type=int, default=24)
    ap.add_argument("--work", type=Path, default=Path(".cache/exp_induction"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    a.work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(ModelConfig(name=a.model, precision="float32"), torch.device("cpu"))
    adapter = loaded.adapter
    dp = DataParams(num_examples=a.attr, eval_examples=a.eval, seq_len=a.seq_len, induction_format=a.format)
    data = build_task("induction", loaded.tokenizer, loaded.path, dp, a.attr + a.eval, 0,
                      max_tokens=context_length(loaded.model.config))
    attr, held = data[:a.attr], data[a.attr:]
    tag = f"{Path(a.model).name}-{a.format}-T{a.seq_len}-a{a.attr}"
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.update({"model": a.model, "format": a.format, "seq_len": a.seq_len, "n_attr": a.attr, "n_eval": a.eval,
                "threshold": a.threshold, "task_attr": task_stats(loaded.model, attr),
                "task_held": task_stats(loaded.model, held)})
    res.setdefault("rows", [])

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    def add(row: dict) -> None:
        res["rows"] = [r for r in res["rows"] if (r["level"], r["method"], r["selection"])
                       != (row["level"], row["method"], row["selection"])] + [row]
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
        save()

    print(json.dumps(res["task_held"]), flush=True)
    ev = Evaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
    shape = (adapter.n_layers, adapter.n_heads)
    m_full, m_empty = ev(torch.ones(shape, dtype=torch.bool)), ev(torch.zeros(shape, dtype=torch.bool))
    res.update({"m_full": m_full, "m_empty": m_empty})
    scores = {}
    for method in [m for m in a.methods.split(",") if m]:
        got = attribution(adapter, attr, "node", method, a.batch_size, a.work / f"{tag}-node-{method}.pt")
        scores[method] = got
        for sel in a.selections.split(","):
            t = time.time()
            if sel == "top_k":
                def choose(n, r=got["ranked"]):
                    return keep_top(r, n, "abs")
            elif sel == "bootstrap":
                choose = BootstrapSelector(got["per_ex"], "abs", 100, 0)
            elif sel in ("mean_rank", "vote"):
                choose = RankSelector(got["per_ex"], sel, "abs")
            elif sel == "mask":
                theta = learn_head_mask(adapter, attr, got["ranked"], "logit_diff", a.mask_steps, a.mask_lr,
                                        batch_size=a.batch_size)

                def choose(n, th=theta):
                    return keep_top(th, n, "signed")
            select_s = time.time() - t
            t = time.time()
            found = smallest(ev, NODE_GRID, choose, a.threshold, m_full, m_empty, also=(27,))
            add({"level": "node", "method": method, "selection": sel, "attribution_s": got["seconds"],
                 "selection_s": select_s, "scan_s": time.time() - t, **found})

    if a.greedy:
        pool = torch.zeros(shape, dtype=torch.bool)
        for got in scores.values():
            pool |= keep_top(got["ranked"], a.pool_each, "abs")
        ev_obj = Evaluator(adapter, attr[:a.objective], "logit_diff", "corrupted", None, a.batch_size)
        t, calls = time.time(), [0]

        def objective(mask):
            calls[0] += 1
            return ev_obj(mask)
        held_f = []

        def progress(k, head, m):
            f = faithfulness(ev(greedy_mask(rows_so_far, shape, k)), m_full, m_empty) if rows_so_far else math.nan
            held_f.append(f)
            print(f"greedy {k}: L{head[0]}H{head[1]} objective {m:.3f} held-out f {f:.3f}", flush=True)
        rows_so_far: list = []

        def tracked(k, head, m):
            rows_so_far.append({"n_kept": k, "head": list(head), "metric": m})
            progress(k, head, m)
        greedy_heads(objective, shape, a.budget, candidates=pool, progress=tracked)
        first = next((i + 1 for i, f in enumerate(held_f) if f >= a.threshold), None)
        add({"level": "node", "method": "greedy oracle", "selection": "greedy", "pool": int(pool.sum()),
             "objective_pairs": a.objective, "forwards": calls[0], "seconds": time.time() - t,
             "heads": [r["head"] for r in rows_so_far], "n_min": first,
             "f_at_n_min": held_f[first - 1] if first else None,
             "curve": [(i + 1, f) for i, f in enumerate(held_f)]})

    if a.backward_from:
        # Exact backward elimination from a selection's smallest faithful set: drop the head whose
        # removal keeps the objective pairs' faithfulness highest, while it stays >= threshold.
        method, sel = a.backward_from.split(":")
        start = next(r for r in res["rows"] if (r["method"], r["selection"]) == (method, sel))
        got = scores.get(method) or attribution(adapter, attr, "node", method, a.batch_size,
                                                a.work / f"{tag}-node-{method}.pt")
        theta = learn_head_mask(adapter, attr, got["ranked"], "logit_diff", a.mask_steps, a.mask_lr,
                                batch_size=a.batch_size) if sel == "mask" else got["ranked"]
        kept = keep_top(theta, start["n_min"], "signed" if sel == "mask" else "abs")
        ev_obj = Evaluator(adapter, attr[:a.objective], "logit_diff", "corrupted", None, a.batch_size)
        o_full, o_empty = ev_obj(torch.ones(shape, dtype=torch.bool)), ev_obj(torch.zeros(shape, dtype=torch.bool))
        t, calls, steps = time.time(), 0, [(int(kept.sum()), faithfulness(ev(kept), m_full, m_empty))]
        while kept.sum() > 1:
            best, best_f = None, -math.inf
            for layer, head in kept.nonzero().tolist():
                trial = kept.clone()
                trial[layer, head] = False
                f = faithfulness(ev_obj(trial), o_full, o_empty)
                calls += 1
                if f > best_f:
                    best, best_f = (layer, head), f
            if best_f < a.threshold:
                break
            kept[best] = False
            steps.append((int(kept.sum()), faithfulness(ev(kept), m_full, m_empty)))
            print(f"backward: drop L{best[0]}H{best[1]}, objective f {best_f:.3f}, held-out f {steps[-1][1]:.3f}",
                  flush=True)
        ok = [n for n, f in steps if f >= a.threshold]
        add({"level": "node", "method": "backward oracle", "selection": f"from {method} {sel}",
             "objective_pairs": a.objective, "forwards": calls, "seconds": time.time() - t,
             "heads": kept.nonzero().tolist(), "n_min": min(ok) if ok else None,
             "f_at_n_min": dict(steps)[min(ok)] if ok else None, "curve": steps})

    if a.edges:
        got = attribution(adapter, attr, "edge", "eap-ig", a.batch_size, a.work / f"{tag}-edge-eap-ig.pt")
        valid = got["valid"]
        eev = EdgeEvaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
        e_full, e_empty = eev(valid), eev(torch.zeros_like(valid))
        grid = edge_grid(int(valid.sum()))
        for sel in a.edge_selections.split(","):
            t = time.time()
            if sel == "top_k":
                def choose(n, r=got["ranked"]):
                    return keep_top(r, n, "abs", valid)
            elif sel == "bootstrap":
                choose = BootstrapSelector(got["per_ex"], "abs", 100, 0, valid)
            elif sel == "mask":  # edge_pruning: an edge mask optimized on the attribution pairs
                theta = learn_edge_mask(adapter, attr, got["ranked"], valid, "logit_diff", a.edge_mask_steps, a.mask_lr,
                                        1.0, a.batch_size)

                def choose(n, th=theta):
                    return keep_top(th, n, "signed", valid)
            elif sel == "within_mask":  # edges among the head mask's smallest faithful head set (+ MLPs)
                node = attribution(adapter, attr, "node", "eap-ig", a.batch_size, a.work / f"{tag}-node-eap-ig.pt")
                theta = learn_head_mask(adapter, attr, node["ranked"], "logit_diff", a.mask_steps, a.mask_lr,
                                        batch_size=a.batch_size)
                inside = valid & heads_subgraph(graph_of(adapter), keep_top(theta, a.within_heads, "signed"))

                def choose(n, inside=inside):
                    return keep_top(got["ranked"], min(n, int(inside.sum())), "abs", inside)
                grid = [n for n in grid if n < int(inside.sum())] + [int(inside.sum())]
            else:
                choose = RankSelector(got["per_ex"], sel, "abs", valid)
            found = smallest(eev, grid, choose, a.threshold, e_full, e_empty)
            grid = edge_grid(int(valid.sum()))
            add({"level": "edge", "method": "eap-ig", "selection": sel, "attribution_s": got["seconds"],
                 "scan_s": time.time() - t, "n_total": int(valid.sum()), **found})
    save()


if __name__ == "__main__":
    main()
