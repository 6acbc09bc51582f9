"""Benchmark: EAP-IG at node and edge level against the floor, on a GPT-2-small-shaped model or a real one.

The floor for one batch is what any EAP-IG implementation must do: 2 no-grad forwards (clean,
corrupted) plus m forward+backward passes with frozen parameters (activation gradients only).
Everything is measured in this one run, same model, batch, dtype and thread count.

    python scripts/bench/bench_attribution.py [--batch 4] [--seq 32] [--steps 5] [--repeats 3] [--json out.json]
    python scripts/bench/bench_attribution.py --model fetched:smollm2 --task ioi   # the real model, IOI pairs
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.attribution.metrics import compute_metric
from circuitkit.discovery.tasks.base import TaskData, random_pairs
from circuitkit.models.adapters import get_adapter


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    model.requires_grad_(False)
    return model


def floor_pass(model: torch.nn.Module, data: TaskData, steps: int, answer_only: bool = False) -> None:
    """2 no-grad forwards + `steps` forward+backward passes w.r.t. the input embeddings.

    answer_only: project only the answer position onto the vocabulary (what CircuitKit does),
    the tighter floor; otherwise the plain model call with logits at every position.
    """
    keep = {"logits_to_keep": data.answer_pos[:1]} if answer_only else {}
    with torch.no_grad():
        clean_embeds = model.get_input_embeddings()(data.clean_ids)
        model(inputs_embeds=clean_embeds, **keep)
        model(input_ids=data.corrupted_ids, **keep)
    for _ in range(steps):
        embeds = clean_embeds.detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, **keep).logits
        value = compute_metric("logit_diff", logits[:, -1], data).sum()
        torch.autograd.grad(value, embeds)


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median wall seconds over `repeats` runs (after one warm-up) and the peak live bytes."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    with measure_peak(torch.device("cpu")) as peak:
        fn()
    return statistics.median(times), peak.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--model", default=None, help="a model.name (e.g. fetched:smollm2); default: random GPT-2 small")
    parser.add_argument("--task", default=None, choices=("ioi", "induction"), help="with --model: real task pairs")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model is None:
        model = make_model(dtype)
        label = "GPT-2-small shape"
        data = random_pairs(args.batch, args.seq, model.config.vocab_size)
    else:
        from circuitkit.discovery.config import DataParams
        from circuitkit.discovery.tasks import build_task
        from circuitkit.models.config import ModelConfig
        from circuitkit.models.loading import load_model

        loaded = load_model(ModelConfig(name=args.model, precision=args.dtype), torch.device("cpu"))
        model, label = loaded.model, args.model
        if args.task:
            data = build_task(args.task, loaded.tokenizer, None, DataParams(seq_len=args.seq), args.batch, seed=0)
        else:
            data = random_pairs(args.batch, args.seq, model.config.vocab_size)
    adapter = get_adapter(model)
    weights = module_bytes(model)

    rows = {}
    rows["floor"] = timed(lambda: floor_pass(model, data, args.steps), args.repeats)
    rows["floor, answer logits only"] = timed(lambda: floor_pass(model, data, args.steps, True), args.repeats)
    for level in ("node", "edge"):
        rows[f"eap-ig {level}"] = timed(
            lambda level=level: attribute(adapter, data, "eap-ig", level, ig_steps=args.steps,
                                          batch_size=args.batch, progress=False), args.repeats)
    floor_s = rows["floor"][0]
    table = Table(title=f"EAP-IG on {label}, batch {args.batch} x {data.clean_ids.shape[1]} tokens, m={args.steps},"
                        f" {args.dtype}, {torch.get_num_threads()} threads")
    for col in ("run", "seconds / batch", "x floor", "peak MiB (activations, excl. weights)"):
        table.add_column(col, justify="right")
    results = {}
    for name, (secs, peak) in rows.items():
        table.add_row(name, f"{secs:.3f}", f"{secs / floor_s:.2f}", f"{peak / 2**20:.1f}")
        results[name] = {"seconds": secs, "x_floor": secs / floor_s, "peak_bytes": peak}
    Console().print(table)
    tight = rows["floor, answer logits only"][0]
    Console().print(f"weights: {weights / 2**20:.0f} MiB; targets: node <= 1.3x, edge <= 2x the floor;"
                    f" against the answer-logits floor: node {rows['eap-ig node'][0] / tight:.2f}x,"
                    f" edge {rows['eap-ig edge'][0] / tight:.2f}x")
    if args.json:
        meta = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "args": vars(args), "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
