"""Oracles on a real pretrained model (SmolLM2-135M-Instruct by default), independent of attribution.

1. Head detectors: every head's previous-token and induction (prefix-matching) score from its
   attention pattern on BOS + R random tokens repeated once (`head_pattern_scores`, the standard
   detectors), and the model's top-1 accuracy on the repeated copy.
2. Induction: node-level EAP-IG on the induction task; its top heads against the top
   prefix-matching heads (overlap at top-5 and top-10).
3. IOI: exact activation patching of every head (the oracle) against node-level EAP (ig_steps=1)
   and EAP-IG (ig_steps=m): Pearson and Spearman over all heads, and top-10 overlap.

    python scripts/experiments/real_model_oracles.py [--model fetched:smollm2] [--ioi 32] [--induction 32] [--json out.json]

Needs `circuitkit fetch smollm2` once. Prints rich tables; --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from circuitkit.discovery.attribution import attribute, exact_patching
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import build_task
from circuitkit.fixtures.induction import head_pattern_scores
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().double()


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return pearson(_ranks(a.flatten()), _ranks(b.flatten()))


def top_set(scores: torch.Tensor, k: int, by_abs: bool = False) -> set[tuple[int, int]]:
    flat = scores.flatten()
    order = (flat.abs() if by_abs else flat).argsort(descending=True)[:k]
    H = scores.shape[1]
    return {(int(i) // H, int(i) % H) for i in order}


def name(heads) -> str:
    return ", ".join(f"L{layer}H{head}" for layer, head in sorted(heads))


def repeated_tokens(tokenizer, n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS + `length` random tokens + the same tokens again; mask marks the second copy."""
    g = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(1000, min(len(tokenizer), 20000)) if i not in special])
    body = pool[torch.randint(len(pool), (n, length), generator=g)]
    bos = torch.full((n, 1), tokenizer.bos_token_id)
    ids = torch.cat([bos, body, body], 1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, length + 1:] = True
    return ids, mask


def head_detectors(loaded, n: int, length: int, seed: int) -> dict:
    ids, mask = repeated_tokens(loaded.tokenizer, n, length, seed)
    scores = head_pattern_scores(loaded.model, ids, induction_mask=mask)
    with torch.no_grad():
        pred = loaded.model(ids).logits.argmax(-1)
    # position i of the second copy predicts token i+1 (the next token of the first copy)
    hits = (pred[:, length + 1:-1] == ids[:, length + 2:]).float().mean()
    return {"prev_token": scores["prev_token"], "induction": scores["induction"], "repeat_top1": float(hits),
            "n_sequences": n, "repeat_length": length}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetched:smollm2")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--ioi", type=int, default=32, help="IOI pairs")
    parser.add_argument("--induction", type=int, default=32, help="induction-task pairs")
    parser.add_argument("--seq-len", type=int, default=48, help="induction-task sequence length")
    parser.add_argument("--ig-steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    console = Console()
    loaded = load_model(ModelConfig(name=args.model, precision=args.precision), torch.device("cpu"))
    adapter, tok = loaded.adapter, loaded.tokenizer
    out: dict = {"model": args.model, "precision": args.precision, "threads": torch.get_num_threads()}

    t0 = time.perf_counter()
    det = head_detectors(loaded, 16, 20, seed=0)
    out["detectors"] = {"repeat_top1": det["repeat_top1"], "wall_s": time.perf_counter() - t0,
                        "top_prev_token": sorted(top_set(det["prev_token"], 5)),
                        "top_induction": sorted(top_set(det["induction"], 10)),
                        "prev_token": det["prev_token"].tolist(), "induction": det["induction"].tolist()}

    dp = DataParams(num_examples=args.induction, seq_len=args.seq_len)
    ind_data = build_task("induction", tok, None, dp, args.induction, seed=1)
    t0 = time.perf_counter()
    ind = attribute(adapter, ind_data, "eap-ig", "node", "logit_diff", args.ig_steps, args.batch)
    ind_s = time.perf_counter() - t0
    ind_rows = {}
    for k in (5, 10):
        ours, truth = top_set(ind.head, k), top_set(det["induction"], k)
        ind_rows[k] = {"overlap": len(ours & truth), "eap_ig": sorted(ours), "prefix_matching": sorted(truth)}
    out["induction_task"] = {"n": len(ind_data), "seq_len": args.seq_len, "metric_clean": ind.metric_clean,
                             "metric_corrupted": ind.metric_corrupted, "wall_s": ind_s,
                             "spearman_vs_induction_score": spearman(ind.head, det["induction"]),
                             "top": {str(k): v for k, v in ind_rows.items()}}

    ioi = build_task("ioi", tok, None, DataParams(num_examples=args.ioi), args.ioi, seed=2)
    t0 = time.perf_counter()
    exact = exact_patching(adapter, ioi, "node", "logit_diff", args.batch)
    exact_s = time.perf_counter() - t0
    ioi_rows = {"exact": {"wall_s": exact_s}}
    for label, steps in (("eap", 1), (f"eap-ig m={args.ig_steps}", args.ig_steps)):
        t0 = time.perf_counter()
        s = attribute(adapter, ioi, "eap-ig", "node", "logit_diff", steps, args.batch)
        ioi_rows[label] = {"wall_s": time.perf_counter() - t0, "pearson": pearson(s.head, exact.head),
                           "spearman": spearman(s.head, exact.head),
                           "top10_overlap": len(top_set(s.head, 10, True) & top_set(exact.head, 10, True))}
    out["ioi"] = {"n": len(ioi), "metric_clean": exact.metric_clean, "metric_corrupted": exact.metric_corrupted,
                  "top_exact": sorted(top_set(exact.head, 10, True)), "rows": ioi_rows}

    table = Table(title=f"head detectors on {args.model} (16 x BOS + 20 random tokens repeated once)")
    table.add_column("what")
    table.add_column("value")
    table.add_row("top-1 accuracy on the repeated copy", f"{det['repeat_top1']:.3f}")
    table.add_row("top-5 previous-token heads", name(top_set(det["prev_token"], 5)))
    table.add_row("top-10 prefix-matching heads", name(top_set(det["induction"], 10)))
    console.print(table)
    table = Table(title=f"induction task ({len(ind_data)} pairs, {args.seq_len} tokens): EAP-IG m={args.ig_steps}"
                        " top heads vs prefix-matching heads")
    for col in ("k", "overlap", "EAP-IG top-k", "prefix-matching top-k"):
        table.add_column(col)
    for k, row in ind_rows.items():
        table.add_row(str(k), f"{row['overlap']}/{k}", name(row["eap_ig"]), name(row["prefix_matching"]))
    console.print(table)
    table = Table(title=f"IOI ({len(ioi)} pairs): node scores vs exact patching of all"
                        f" {exact.head.numel()} heads")
    for col in ("method", "Pearson", "Spearman", "top-10 overlap (|score|)", "wall s"):
        table.add_column(col)
    table.add_row("exact patching", "1", "1", "10/10", f"{exact_s:.1f}")
    for label, row in ioi_rows.items():
        if label != "exact":
            table.add_row(label, f"{row['pearson']:.3f}", f"{row['spearman']:.3f}", f"{row['top10_overlap']}/10",
                          f"{row['wall_s']:.1f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, default=list)


if __name__ == "__main__":
    main()
