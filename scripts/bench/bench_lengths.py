"""Benchmark: rows of realistic, very different lengths; Gradian's length-aware batching side by side.

The workload (`lengths_corpus`, deterministic): prompt and completion lengths drawn from
log-normal distributions (prompt median 74 tokens, completion median 20, row total clipped to
29..497 tokens, mean about 124), text from the tiny tokenizer's synthetic corpus; a
GPT-2-small-shaped model with random weights; gradients of the 12 `mlp.c_proj`, kronecker
18 x 18 per module; float32 and bfloat16. Every tool runs in a fresh process of its own
(`scripts/peers/`, as in bench_peers.py), timed on its second build in that process:

* **gradian, length-aware**: the default batching (rows grouped by length, at most
  `--batch-size` rows and `--batch-tokens` padded tokens per batch);
* **gradian, file order**: batches of `--batch-size` consecutive rows (version 0.1's batching);
* **bergson** (if `make peers` built it): its own token batching with the same token budget
  (`--batch-tokens`, 2048 by default: of 1024, 2048 and 4096, the budget under which the
  length-aware plan ran fastest over both dtypes in an in-process sweep, docs/benchmarks.md);
* **floor, same length buckets**: forward+backward (frozen weights, activation gradients only,
  supervised logits) of exactly the batches Gradian's plan forms, with no per-example work:
  what any method batching by length must compute (its activations run as Gradian's,
  `--activations`: in 16-bit GPT-2's GELU as one fused kernel by default);
* **floor, exact-length batches**: the same with rows batched only with rows of identical
  length (no padding at all); with lengths this spread most batches hold one or two rows, so
  this is slower than the bucketed floor on two cores, and shows what padding costs against
  batch size.

**Rounds.** This machine's speed drifts by ±30% from minute to minute (other tenants), more
than the effects measured. So each tool's process runs `--rounds` times per dtype, the tools
interleaved, and the speed-ups are medians of per-round ratios (with their range); inside each
Gradian process its index (model loaded before the clock) and the floor of the same buckets
are timed alternately `--floor-rounds` times, and the floor ratio is the median of those
paired ratios.

Attribution over a JSONL task whose pairs vary in length (6 to 120 tokens) is timed too: EAP-IG
at node level on the same model with pairs grouped by length vs in file order.

    python scripts/bench/bench_lengths.py [--rows 96] [--batch-size 16] [--batch-tokens 2048] [--rounds 3]
                                    [--activations auto|model|recompute|fused]
                                    [--tools gradian,gradian-file-order,bergson] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from circuitkit.core.config import choices  # noqa: E402
from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from gradian.settings.grads import GradsConfig  # noqa: E402
from scripts.bench.bench_peers import CONCAT_TEMPLATE, THROUGHPUT, THROUGHPUT_DIM, run_worker, write_jsonl  # noqa: E402

PROMPT_MEDIAN, COMPLETION_MEDIAN, SIGMA = 74, 20, 0.7
MIN_TOKENS, MAX_TOKENS = 29, 497


def lengths_corpus(n_rows: int, tokenizer: Any, seed: int = 0) -> list[dict[str, str]]:
    """n_rows prompt/completion rows with log-normal token lengths (see the module docstring)."""
    from circuitkit.fixtures.models import synthetic_corpus

    rng = random.Random(seed)
    sentences = iter(synthetic_corpus(n_sentences=200 * n_rows, seed=seed + 1))
    rows = []
    for _ in range(n_rows):
        n_prompt = max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), SIGMA)))
        n_completion = max(1, round(rng.lognormvariate(math.log(COMPLETION_MEDIAN), SIGMA)))
        total = min(MAX_TOKENS, max(MIN_TOKENS, n_prompt + n_completion))
        n_completion = min(n_completion, total - 1)
        n_prompt = total - n_completion
        ids: list[int] = []
        while len(ids) < total:
            ids += tokenizer(" " + next(sentences), add_special_tokens=False)["input_ids"]
        rows.append({"prompt": tokenizer.decode(ids[:n_prompt]), "completion": tokenizer.decode(ids[n_prompt:total])})
    return rows


def prepare(work: Path, n_rows: int, model: str | None = None) -> dict[str, Any]:
    """The model dir (a GPT-2-small-shaped random model, or `model`'s weights beside a tokenizer
    that renders rows by concatenation) and the JSONL rows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = work / "model"
    if model is None:
        tokenizer = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32")).tokenizer
        tokenizer.model_max_length = THROUGHPUT["n_positions"]
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(**THROUGHPUT)).save_pretrained(model_dir)
        modules = [f"transformer.h.{layer}.mlp.c_proj" for layer in range(THROUGHPUT["n_layer"])]
    else:  # the real weights, linked; its own tokenizer, saved with the concatenating template
        from circuitkit.models.loading import pretrained_args

        source = Path(pretrained_args(ModelConfig(name=model))[0])
        loaded = load_model(ModelConfig(name=model, precision="float32"))
        tokenizer = loaded.tokenizer
        model_dir.mkdir()
        for f in source.iterdir():
            if not f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                (model_dir / f.name).symlink_to(f)
        modules = [name for name, _ in loaded.model.named_modules() if name.endswith("mlp.down_proj")]
    tokenizer.chat_template = CONCAT_TEMPLATE  # bergson renders rows with it: the same tokens for all
    tokenizer.save_pretrained(model_dir)
    rows = lengths_corpus(n_rows, tokenizer)
    docs = write_jsonl(work / "rows.jsonl", rows)
    queries = {"full": str(write_jsonl(work / "queries.jsonl", rows[:4]))}
    token_counts = [len(tokenizer(r["prompt"] + r["completion"])["input_ids"]) for r in rows]
    return {"model_dir": str(model_dir), "docs": str(docs), "queries": queries, "modules": modules,
            "model_label": model or "GPT-2-small shape",
            "lengths": {"min": min(token_counts), "max": max(token_counts),
                        "mean": sum(token_counts) / len(token_counts)}}


TOOL_SPECS = {  # tool -> (worker in bench_peers.TOOLS, spec entries)
    "gradian": ("gradian", {"group_by_length": True}),
    "gradian-file-order": ("gradian", {"group_by_length": False, "batch_tokens": None}),
    "bergson": ("bergson", {}),
}


def run_indexing(work: Path, data: dict[str, Any], tools: list[str], batch_size: int, batch_tokens: int,
                 timeout: float, console: Console, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                 rounds: int = 3, floor_rounds: int = 3, activations: str = "auto") -> list[dict[str, Any]]:
    """Every tool's process `rounds` times per dtype, the tools interleaved (round r starts with
    tool r mod len(tools)), so that a machine whose speed drifts over minutes slows every tool
    alike; one dict per process run, with its round. `activations`: Gradian's `grads.activations`
    (its floors run the same activations)."""
    runs = []
    for precision in dtypes:
        for r in range(rounds):
            for tool in tools[r % len(tools):] + tools[:r % len(tools)]:
                worker, own = TOOL_SPECS[tool]
                tool_work = work / f"{tool}_{precision}_{r}"
                tool_work.mkdir(parents=True, exist_ok=True)
                spec = {k: data[k] for k in ("model_dir", "docs", "queries", "modules")}
                spec.update(per_module_dim=THROUGHPUT_DIM, total_dim=THROUGHPUT_DIM * len(data["modules"]),
                            batch_size=batch_size, batch_tokens=batch_tokens, max_length=512, seed=0,
                            work_dir=str(tool_work), precision=precision, storage_dtype="float16",
                            floor=tool == "gradian", floor_rounds=floor_rounds, full_logits_floor=False,
                            padding_free_floor=tool == "gradian" and r == 0, activations=activations)
                spec.update(own)
                console.print(f"[dim]round {r + 1}/{rounds}: {tool}, {precision}...[/dim]")
                result = run_worker(worker, spec, tool_work, timeout)
                run = {"tool": tool, "precision": precision, "round": r}
                if result.get("error"):
                    runs.append({**run, "error": result["error"]})
                    continue
                run.update({k: result[k] for k in FLOOR_KEYS + ("padding_share",) if k in result})
                runs.append({**run, "n_rows": result["n_rows"], "seconds": result["index_seconds"],
                             "peak_mib": result["index_peak_bytes"] / 2**20})
    return runs


# What a Gradian worker reports besides its own index time (`worker_gradian.floor_seconds`) that
# the summary reads: the paired timings (the ratios are taken from them) and the exact-length floor.
FLOOR_KEYS = ("index_preloaded_runs", "floor_supervised_runs", "floor_padding_free_seconds")


def summarize_indexing(runs: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
    """One line per tool at `precision`, plus the floors: median seconds and peak over the rounds,
    and Gradian's speed-up as the median (and range) of the per-round ratios tool / Gradian."""
    ok = [r for r in runs if r["precision"] == precision and not r.get("error")]
    ours = {r["round"]: r for r in ok if r["tool"] == "gradian"}
    lines = []
    for tool in dict.fromkeys(r["tool"] for r in runs if r["precision"] == precision):
        mine = [r for r in ok if r["tool"] == tool]
        if not mine:
            err = next(r["error"] for r in runs if r["precision"] == precision and r["tool"] == tool)
            lines.append({"tool": tool, "error": err})
            continue
        ratios = [r["seconds"] / ours[r["round"]]["seconds"] for r in mine if r["round"] in ours]
        lines.append({"tool": tool, "n_rows": mine[0]["n_rows"], "rounds": len(mine),
                      "seconds": statistics.median(r["seconds"] for r in mine),
                      "seconds_each": [round(r["seconds"], 1) for r in mine],
                      "peak_mib": statistics.median(r["peak_mib"] for r in mine),
                      "padding_share": mine[0].get("padding_share"),
                      "speedup": statistics.median(ratios) if ratios else None,
                      "speedup_range": (min(ratios), max(ratios)) if ratios else None})
    gradian = [r for r in ok if r["tool"] == "gradian" and "index_preloaded_runs" in r]
    if gradian:
        n_rows, padding = gradian[0]["n_rows"], gradian[0].get("padding_share")
        pre = [s for r in gradian for s in r["index_preloaded_runs"]]
        floor = [s for r in gradian for s in r["floor_supervised_runs"]]
        ratios = [a / b for r in gradian for a, b in zip(r["index_preloaded_runs"], r["floor_supervised_runs"],
                                                         strict=True)]
        lines.append({"tool": "gradian, model loaded before the clock (as the floors)", "n_rows": n_rows,
                      "rounds": len(pre), "seconds": statistics.median(pre), "padding_share": padding})
        lines.append({"tool": "floor: fwd+bwd of the same length buckets", "n_rows": n_rows, "rounds": len(floor),
                      "seconds": statistics.median(floor), "padding_share": padding,
                      "floor_ratio": statistics.median(ratios), "floor_ratio_range": (min(ratios), max(ratios))})
    free = [r["floor_padding_free_seconds"] for r in ok if "floor_padding_free_seconds" in r]
    if free:
        lines.append({"tool": "floor: exact-length batches, no padding at all", "n_rows": ok[0]["n_rows"],
                      "rounds": len(free), "seconds": statistics.median(free), "padding_share": 0.0})
    for line in lines:
        if "seconds" in line:
            line["examples_per_s"] = line["n_rows"] / line["seconds"]
    return lines


def attribution_pairs(n: int, seed: int = 0) -> list[tuple[list[int], list[int], int, int]]:
    """n (clean ids, corrupted ids, correct, incorrect) of 6..120 tokens (log-normal lengths)."""
    rng = random.Random(seed)
    vocab = list(range(300, 1000))
    pairs = []
    for _ in range(n):
        length = min(120, max(6, round(rng.lognormvariate(math.log(30), 0.8))))
        ids = [rng.choice(vocab) for _ in range(length)]
        other = list(ids)
        other[rng.randrange(length - 1)] = rng.choice(vocab)
        pairs.append((ids, other, rng.choice(vocab), rng.choice(vocab)))
    return pairs


def run_attribution(data: dict[str, Any], n_pairs: int, batch_size: int, console: Console) -> list[dict[str, Any]]:
    """EAP-IG node scores over pairs of varied length: grouped by length vs file order, same process."""
    from circuitkit.discovery.attribution import attribute
    from circuitkit.discovery.tasks.base import from_token_lists

    loaded = load_model(ModelConfig(name=data["model_dir"], precision="float32"))
    pairs = attribution_pairs(n_pairs)
    task = from_token_lists([p[0] for p in pairs], [p[1] for p in pairs], [[p[2]] for p in pairs],
                            [[p[3]] for p in pairs], pad_id=0)
    real = int(task.attention_mask.sum())
    out, scores = [], {}
    for grouped in (True, False, True):  # the first run warms up
        t0 = time.perf_counter()
        scores[grouped] = attribute(loaded.adapter, task, "eap-ig", "node", ig_steps=3, batch_size=batch_size,
                                    progress=False, group_by_length=grouped)
        seconds = time.perf_counter() - t0
        computed = sum(b.clean_ids.numel() for b in task.length_batches(batch_size, grouped))
        out.append({"batching": "length-aware" if grouped else "file order", "seconds": seconds,
                    "padding_share": 1 - real / computed})
    out = out[1:]
    diff = (scores[True].head - scores[False].head).abs().max() / scores[False].head.abs().max()
    console.print(f"attribution: head scores grouped vs file order, max relative difference {diff:.1e}")
    return out


def print_tables(report: dict[str, Any], console: Console) -> None:
    for precision, lines in report["summary"].items():
        table = Table(title=f"gradient indexing, {precision}, {report['n_rows']} rows of {report['lengths']['min']}.."
                            f"{report['lengths']['max']} tokens (mean {report['lengths']['mean']:.0f}),"
                            f" {report.get('model', 'GPT-2-small shape')}, {report.get('n_modules', 12)} MLP output"
                            f" projections, 18 x 18; batch <= {report['batch_size']} rows,"
                            f" <= {report['batch_tokens']} tokens; grads.activations={report.get('activations', 'auto')};"
                            f" medians of {report['rounds']} interleaved rounds")
        for col in ("tool", "examples/s", "Gradian's speed-up (range)", "peak MiB", "padding share", "s (each round)"):
            table.add_column(col, justify="left" if col == "tool" else "right")
        for r in lines:
            if r.get("error"):
                table.add_row(r["tool"], "-", "-", "-", "-", f"[red]{r['error']}[/red]")
                continue
            if r.get("speedup_range"):
                lo, hi = r["speedup_range"]
                ratio = f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f})"
            elif "floor_ratio" in r:
                lo, hi = r["floor_ratio_range"]
                ratio = f"preloaded Gradian takes {r['floor_ratio']:.2f}x ({lo:.2f}-{hi:.2f})"
            else:
                ratio = "-"
            peak = "-" if "peak_mib" not in r else f"{r['peak_mib']:.0f}"
            pad = "-" if r.get("padding_share") is None else f"{100 * r['padding_share']:.1f}%"
            each = f" ({', '.join(map(str, r['seconds_each']))})" if r.get("seconds_each") else ""
            table.add_row(r["tool"], f"{r['examples_per_s']:.2f}", ratio, peak, pad, f"{r['seconds']:.1f}{each}")
        console.print(table)
    if report.get("attribution"):
        table = Table(title=f"attribution, EAP-IG node level (m=3), {report['n_pairs']} pairs of 6..120 tokens")
        for col in ("batching", "seconds", "padding share", "speed-up"):
            table.add_column(col)
        in_order = next(r for r in report["attribution"] if r["batching"] == "file order")["seconds"]
        for r in report["attribution"]:  # speed-up over the file-order run
            table.add_row(r["batching"], f"{r['seconds']:.1f}", f"{100 * r['padding_share']:.1f}%",
                          f"{in_order / r['seconds']:.2f}x")
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=2048,
                   help="token budget of a batch, for gradian and bergson alike")
    p.add_argument("--tools", default="gradian,gradian-file-order,bergson")
    p.add_argument("--pairs", type=int, default=48, help="attribution pairs (0 skips attribution)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="processes per tool and dtype, interleaved")
    p.add_argument("--floor-rounds", type=int, default=3,
                   help="in each Gradian process, its index and the floor timed alternately this many times")
    p.add_argument("--activations", default="auto", choices=choices(GradsConfig, "activations"),
                   help="Gradian's grads.activations (auto: fused in 16-bit, the model's ops in float32)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--model", default=None,
                   help="a model.name with real weights (e.g. fetched:smollm2); default: random GPT-2-small shape")
    args = p.parse_args(argv)
    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)
    console = Console(width=160)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lengths_") as tmp:
        work = Path(tmp)
        data = prepare(work, args.rows, args.model)
        report: dict[str, Any] = {
            "date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch"
            f" {torch.__version__}, {torch.get_num_threads()} threads", "n_rows": args.rows,
            "batch_size": args.batch_size, "batch_tokens": args.batch_tokens, "lengths": data["lengths"],
            "n_pairs": args.pairs, "rounds": args.rounds, "activations": args.activations,
            "model": data["model_label"], "n_modules": len(data["modules"])}
        dtypes = tuple(d.strip() for d in args.dtypes.split(","))
        report["indexing"] = run_indexing(work, data, tools, args.batch_size, args.batch_tokens, args.timeout, console,
                                          dtypes, args.rounds, args.floor_rounds, args.activations)
        report["summary"] = {d: summarize_indexing(report["indexing"], d) for d in dtypes}
        if args.pairs:
            report["attribution"] = run_attribution(data, args.pairs, args.batch_size, console)
    report["wall_s"] = time.perf_counter() - start
    print_tables(report, console)
    console.print(f"{report['machine']}; wall time {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
