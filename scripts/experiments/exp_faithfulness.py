"""Why is the head-level faithfulness curve on a real model low and not monotone?

One process, one model load, one attribution (per-example scores kept), then every variant
evaluated on the same held-out pairs:

    ablation   mean (position-wise mean of z over the attribution pairs) vs corrupted (patching)
    ranking    |score| vs signed score
    pairs      scores from the first n attribution pairs (per-example rows, no new pass)

Writes a JSON with every curve. Example (SmolLM2-135M, IOI):

    OMP_NUM_THREADS=1 python scripts/experiments/exp_faithfulness.py --model /work/models/smollm2-135m-instruct \\
        --attr 32 --eval 32 --out /tmp/exp_faith.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.heads import Evaluator, faithfulness, keep_top, mean_z
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

DENSE = (1, 2, 3, 5, 8, 14, 20, 27, 40, 54, 81, 108, 135, 189, 243)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="ioi")
    ap.add_argument("--attr", type=int, default=32)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--pairs", default="8,16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    loaded = load_model(ModelConfig(name=a.model, precision="float32"), torch.device("cpu"))
    adapter = loaded.adapter
    dp = DataParams(num_examples=a.attr, eval_examples=a.eval)
    data = build_task(a.task, loaded.tokenizer, loaded.path, dp, a.attr + a.eval, 0,
                      max_tokens=context_length(loaded.model.config))
    attr, held = data[:a.attr], data[a.attr:]
    result: dict = {"model": a.model, "task": a.task, "n_attr": a.attr, "n_eval": a.eval, "ig_steps": a.ig_steps}
    t = time.time()
    scores = attribute(adapter, attr, "eap-ig", "node", "logit_diff", a.ig_steps, a.batch_size, progress=False,
                       per_example=True)
    result["attribution_s"] = time.time() - t
    per_ex = scores.per_example["head"]  # (N, L, H)
    torch.save({"head": scores.head, "per_example": per_ex}, a.out.replace(".json", "_scores.pt"))
    result["metric_clean"], result["metric_corrupted"] = scores.metric_clean, scores.metric_corrupted
    n_heads = scores.head.numel()
    evaluators = {}
    t = time.time()
    evaluators["mean"] = Evaluator(adapter, held, "logit_diff", "mean", mean_z(adapter, attr, a.batch_size),
                                   a.batch_size)
    evaluators["corrupted"] = Evaluator(adapter, held, "logit_diff", "corrupted", None, a.batch_size)
    result["evaluator_setup_s"] = time.time() - t

    def curve(ev, ranked, rank_by, m_full, m_empty, points=DENSE):
        rows = []
        for n_keep in points:
            t1 = time.time()
            m = ev(keep_top(ranked, n_keep, rank_by))
            rows.append({"n_kept": n_keep, "percent_kept": 100 * n_keep / n_heads, "metric": m,
                         "faithfulness": faithfulness(m, m_full, m_empty), "s": time.time() - t1})
            print(f"  n={n_keep} f={rows[-1]['faithfulness']:.3f} ({rows[-1]['s']:.1f}s)", flush=True)
        return rows

    full = torch.ones(scores.head.shape, dtype=torch.bool)
    for abl, ev in evaluators.items():
        m_full, m_empty = ev(full), ev(~full)
        result[f"{abl}_full"], result[f"{abl}_empty"] = m_full, m_empty
        print(f"{abl}: full {m_full:.3f} empty {m_empty:.3f}", flush=True)
        for rank_by in ("abs", "signed"):
            print(f"{abl} {rank_by}", flush=True)
            rows = curve(ev, scores.head, rank_by, m_full, m_empty)
            result[f"{abl}_{rank_by}"] = rows
            json.dump(result, open(a.out, "w"), indent=1)
    # number of pairs: scores from the first n per-example rows, corrupted ablation, signed ranking
    ev = evaluators["corrupted"]
    for n in [int(x) for x in a.pairs.split(",") if x]:
        print(f"pairs {n}", flush=True)
        sub = per_ex[:n].mean(0)
        rows = curve(ev, sub, "signed", result["corrupted_full"], result["corrupted_empty"], (14, 27, 54))
        result[f"pairs{n}_corrupted_signed"] = rows
        json.dump(result, open(a.out, "w"), indent=1)
    result["total_s"] = time.time() - t0
    json.dump(result, open(a.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main()
