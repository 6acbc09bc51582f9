"""The greedy oracle and bootstrapped selection on a real model.

Reads the per-example head scores that scripts/experiments/exp_faithfulness.py saved (same model, task,
seed and split), then:

    greedy     add the head that raises the metric most (counterfactual ablation), by real
               forward passes on the first --objective attribution pairs, among the top
               --pool heads by |score|, up to --budget heads; the prefixes are then measured
               on the held-out pairs
    bootstrap  bootstrapped selection (circuitkit.discovery.pruning.selection) against top-k at a few sizes

    OMP_NUM_THREADS=1 python scripts/experiments/exp_greedy.py --model /work/models/smollm2-135m-instruct \\
        --scores .cache/exp/faith_scores.pt --out .cache/exp/greedy.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.heads import Evaluator, faithfulness, keep_top
from circuitkit.discovery.pruning.selection import bootstrap_select, greedy_heads, greedy_mask
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--scores", required=True)
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--attr", type=int, default=32)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--objective", type=int, default=8)
    ap.add_argument("--pool", type=int, default=36)
    ap.add_argument("--budget", type=int, default=27)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load_model(ModelConfig(name=a.model, precision="float32"), torch.device("cpu"))
    adapter = loaded.adapter
    dp = DataParams(num_examples=a.attr, eval_examples=a.eval)
    data = build_task(a.task, loaded.tokenizer, loaded.path, dp, a.attr + a.eval, 0,
                      max_tokens=context_length(loaded.model.config))
    held = data[a.attr:]
    saved = torch.load(a.scores, weights_only=True)
    head, per_ex = saved["head"], saved["per_example"]
    shape = tuple(head.shape)
    n_heads = head.numel()
    ev = Evaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
    full = torch.ones(shape, dtype=torch.bool)
    m_full, m_empty = ev(full), ev(~full)
    res: dict = {"m_full": m_full, "m_empty": m_empty, "pool": a.pool, "objective_pairs": a.objective}

    def f(mask):
        return faithfulness(ev(mask), m_full, m_empty)

    # bootstrapped selection vs top-k (signed and |score|), held-out faithfulness
    t = time.time()
    rows = []
    for n in (14, 27, 54):
        for rank_by in ("signed", "abs"):
            rows.append({"n_kept": n, "rank_by": rank_by, "top_k": f(keep_top(head, n, rank_by)),
                         "bootstrap": f(bootstrap_select(per_ex, n, rank_by, 100, 0))})
            print(rows[-1], flush=True)
    res["bootstrap_vs_topk"], res["bootstrap_s"] = rows, time.time() - t
    json.dump(res, open(a.out, "w"), indent=1)

    obj = Evaluator(adapter, data[:a.objective], "logit_diff", "corrupted", None, a.batch_size)
    o_full, o_empty = obj(full), obj(~full)
    pool = keep_top(head, a.pool, "abs")
    t = time.time()

    def progress(k, hd, m):
        print(f"greedy {k}: L{hd[0]}H{hd[1]} objective f={faithfulness(m, o_full, o_empty):.3f}"
              f" ({time.time() - t:.0f}s)", flush=True)
    greedy = greedy_heads(obj, shape, a.budget, pool, progress)
    res["greedy_s"] = time.time() - t
    res["greedy_passes"] = sum(a.pool - k for k in range(a.budget)) * ((a.objective + a.batch_size - 1) // a.batch_size)
    for row in greedy:
        row["objective_faithfulness"] = faithfulness(row["metric"], o_full, o_empty)
    res["greedy"] = greedy
    res["greedy_heldout"] = [{"n_kept": n, "percent_kept": 100 * n / n_heads,
                              "faithfulness": f(greedy_mask(greedy, shape, n))}
                             for n in (1, 2, 3, 5, 8, 14, 20, 27) if n <= len(greedy)]
    print(res["greedy_heldout"], flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
