"""Circuits under several corruptions on a real model: single-corruption circuits against the joint one.

Per task (ioi: s2 + abc; induction, repeat format: swap + fresh; jsonl: the capital-city facts of
`circuitkit.discovery.tasks.capitals` as a user's rows, with the generated entity_swap + token_replace
corruptions, or --jsonl-path rows), with EAP-IG head scores and corrupted ablation on held-out pairs
(the same clean prompts under each corruption):

* the cost: attribution of the primary corruption alone against both in one pass over the clean
  runs (`attribute_corruptions`), in the same run;
* for each ranking (each corruption's own scores, the joint mean and max of gap-normalised shares),
  the faithfulness under every corruption of its top-k heads over a grid of k, all circuits of a
  corruption in batched forwards (`Evaluator.many`);
* k_single: the smallest k at which a single-corruption circuit keeps f >= 0.8 under its own
  corruption; at that k each circuit's f under every corruption; k_joint: the smallest k at which
  the joint circuit keeps f >= 0.8 under every corruption, and k_joint / k_single (the goal: <= 1.5);
* stability: the Jaccard of the kept set over bootstrap resamples of the attribution examples;
* with --mask-steps: two learned head masks (`pruning.selection: mask`) ranked by their trained
  logits, one learned under the primary corruption alone (warm-started from its scores), one under
  every corruption (`learn_head_mask(others=...)`, rule worst, warm-started from the joint mean).

    OMP_NUM_THREADS=1 python scripts/bench/bench_corruptions.py --model fetched:smollm2 --n-attr 16 --n-eval 16
    OMP_NUM_THREADS=1 python scripts/bench/bench_corruptions.py --tasks jsonl --n-attr 16 --n-eval 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from circuitkit.discovery.attribution.corruptions import combine
from circuitkit.discovery.attribution.eap import attribute, attribute_corruptions
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.corruptions import fold
from circuitkit.discovery.pruning.heads import Evaluator, faithfulness
from circuitkit.discovery.pruning.optimize import learn_head_mask
from circuitkit.discovery.pruning.selection import keep_top
from circuitkit.discovery.pruning.stability import stability
from circuitkit.discovery.stages import answer_changed
from circuitkit.discovery.tasks.capitals import COUNTRIES, TEMPLATES
from circuitkit.discovery.tasks.corruption_sets import build_corruption_set
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import context_length, load_model

TASKS = {"ioi": ("s2", "abc"), "induction": ("swap", "fresh"), "jsonl": ("entity_swap", "token_replace")}
GOAL = 0.8


def grid(n_heads: int) -> list[int]:
    return sorted({k for k in (3, 5, 8, 10, 14, 18, 22, 27, 32, 40, 48, 56, 64, 80, 100, 135, 180, n_heads)
                   if k <= n_heads})


def faithfulness_table(adapter, held_out: dict, masks: torch.Tensor, batch_size: int) -> dict[str, list[float]]:
    """{corruption: f of each mask (C, L, H)} with corrupted ablation, one batched evaluation per corruption."""
    out = {}
    for name, pairs in held_out.items():
        evaluate = Evaluator(adapter, pairs, "logit_diff", "corrupted", None, batch_size)
        full, empty, *ms = evaluate.many(torch.cat([torch.ones_like(masks[:1]), torch.zeros_like(masks[:1]), masks]))
        out[name] = [faithfulness(m, full, empty) for m in ms]
        del evaluate
    return out


def capital_rows(path: Path, tokenizer) -> Path:
    """The capitals task's facts as jsonl rows for generated corruptions: entity = the country,
    incorrect = the next country's capital (token_replace needs one on the row); the capitals that
    are one token of `tokenizer` only (a row's answers must be)."""
    facts = [(c, a) for c, a in COUNTRIES if len(tokenizer.encode(" " + a, add_special_tokens=False)) == 1]
    rows = [{"clean": t.format(country=country), "correct": " " + capital, "entity": country,
             "incorrect": " " + facts[(i + 1) % len(facts)][1]}
            for t in TEMPLATES for i, (country, capital) in enumerate(facts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def smallest(ks: list[int], fs: list[float]) -> int | None:
    return next((k for k, f in zip(ks, fs, strict=True) if f >= GOAL), None)


def run_task(adapter, tokenizer, task: str, args) -> None:
    names = TASKS[task]
    dp = DataParams(seq_len=args.seq_len, num_examples=args.n_attr, eval_examples=args.n_eval)
    check, report = None, {}
    if task == "jsonl":
        path = Path(args.jsonl_path) if args.jsonl_path else capital_rows(Path(tempfile.mkdtemp()) / "capitals.jsonl",
                                                                          tokenizer)
        dp = DataParams(num_examples=args.n_attr, eval_examples=args.n_eval, data_path=str(path))

        def check(pairs):  # the data stage's check: keep a generated pair only where the answer changes
            return answer_changed(adapter.model, pairs, args.batch_size)
    by = build_corruption_set(task, tokenizer, None, dp, list(names), args.n_attr + args.n_eval, args.seed,
                              max_tokens=context_length(adapter.model.config), pair_check=check, report=report)
    if report:
        print(f"\njsonl rows {dp.data_path}: {report['valid_under_all']} valid under every corruption ("
              + ", ".join(f"{c} {report[c]['valid_pairs']} of {report[c]['rows']}" for c in names) + ")")
    attr = {c: p[:args.n_attr] for c, p in by.items()}
    held = {c: p[args.n_attr:] for c, p in by.items()}
    kw = dict(algorithm="eap-ig", ig_steps=args.ig_steps, batch_size=args.batch_size, progress=False, per_example=True)
    t = time.perf_counter()
    attribute(adapter, attr[names[0]], **kw)
    one_s = time.perf_counter() - t
    t = time.perf_counter()
    found = attribute_corruptions(adapter, list(attr.values()), **kw)
    joint_s = time.perf_counter() - t
    scores = dict(zip(names, found, strict=True))
    rankings = {f"{c} only": scores[c] for c in names}
    rankings |= {f"joint {rule}": combine(scores, rule) for rule in ("mean", "max")}
    n_heads = adapter.n_layers * adapter.n_heads
    ks = grid(n_heads)
    masks = {r: [keep_top(s.head, k, "abs") for k in ks] for r, s in rankings.items()}
    if args.mask_steps:
        t = time.perf_counter()
        theta = learn_head_mask(adapter, attr[names[0]], scores[names[0]].head, steps=args.mask_steps,
                                batch_size=args.batch_size)
        alone_s = time.perf_counter() - t
        t = time.perf_counter()
        theta_joint = learn_head_mask(adapter, attr[names[0]], rankings["joint mean"].head, steps=args.mask_steps,
                                      batch_size=args.batch_size, others=[attr[c] for c in names[1:]], rule="worst")
        both_s = time.perf_counter() - t
        print(f"\nmask ({args.mask_steps} steps, batch {args.batch_size}): {names[0]} alone {alone_s:.1f} s, under"
              f" every corruption {both_s:.1f} s")
        for r, th in ((f"{names[0]} mask", theta), ("joint mask (worst)", theta_joint)):
            masks[r] = [keep_top(th, k, "signed") for k in ks]
            rankings[r] = None  # no per-example scores: no stability
    flat = torch.stack([m for r in rankings for m in masks[r]])
    t = time.perf_counter()
    f = faithfulness_table(adapter, held, flat, args.batch_size)
    eval_s = time.perf_counter() - t
    per = {r: {c: f[c][i * len(ks):(i + 1) * len(ks)] for c in names} for i, r in enumerate(rankings)}
    seq = int(by[names[0]].clean_ids.shape[1])
    print(f"\n## {task}: corruptions {' + '.join(names)}; {args.n_attr} attribution + {args.n_eval} held-out pairs,"
          f" {seq} tokens (padded), EAP-IG ig_steps={args.ig_steps}, corrupted ablation, {n_heads} heads")
    gaps = {c: scores[c].metric_clean - scores[c].metric_corrupted for c in names}
    print("metric gap m(clean) - m(corrupted): " + ", ".join(f"{c} {g:.3f}" for c, g in gaps.items()))
    print(f"attribution: {names[0]} alone {one_s:.1f} s; both in one pass {joint_s:.1f} s ({joint_s / one_s:.2f}x;"
          f" separately would be 2x); {len(flat)} circuits x {len(names)} corruptions evaluated in {eval_s:.1f} s")
    k_single = {c: smallest(ks, per[f"{c} only"][c]) for c in names}
    print("\nfaithfulness of the top-k heads, under each corruption (worst in brackets):")
    print("| ranking | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for r in rankings:
        cells = [" / ".join(f"{per[r][c][i]:.2f}" for c in names) + f" [{fold([per[r][c][i] for c in names], 'worst'):.2f}]"
                 for i in range(len(ks))]
        print(f"| {r} | " + " | ".join(cells) + " |")
    print("\n| circuit | heads | " + " | ".join(f"f under {c}" for c in names) + " | worst | k(worst >= 0.8) |"
          " x single | stability (Jaccard mean) |")
    print("|---|---|" + "---|" * (len(names) + 4))
    for c in names:
        for r in rankings:
            k = k_single[c]
            if k is None:
                continue
            i = ks.index(k)
            worst = [fold([per[r][x][j] for x in names], "worst") for j in range(len(ks))]
            k_all = smallest(ks, worst)
            stable = ("-" if rankings[r] is None else
                      f"{stability(rankings[r].per_example['head'], k, 'abs', args.resamples, 0)['jaccard_mean']:.3f}")
            print(f"| {r} at {c}'s size | {k} | " + " | ".join(f"{per[r][x][i]:.3f}" for x in names)
                  + f" | {worst[i]:.3f} | {k_all if k_all is not None else '> ' + str(ks[-1])} |"
                  + (f" {k_all / k:.2f}x |" if k_all is not None else " - |") + f" {stable} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetched:smollm2")
    parser.add_argument("--tasks", default="ioi,induction")
    parser.add_argument("--n-attr", type=int, default=16)
    parser.add_argument("--n-eval", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32, help="induction prompt length")
    parser.add_argument("--ig-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resamples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mask-steps", type=int, default=0, help="also learn head masks (pruning.selection=mask)"
                        " under the primary corruption and under every one, with this many steps (0 = off)")
    parser.add_argument("--jsonl-path", default=None, help="jsonl task: rows with clean, correct, entity and"
                        " incorrect (default: the capitals task's facts, written to a temporary file)")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(ModelConfig(name=args.model, precision="float32"), torch.device("cpu"))
    print(f"model {args.model}: {loaded.adapter.n_layers} layers x {loaded.adapter.n_heads} heads, float32, CPU,"
          f" torch threads {torch.get_num_threads()}")
    for task in args.tasks.split(","):
        run_task(loaded.adapter, loaded.tokenizer, task, args)


if __name__ == "__main__":
    main()
