"""Benchmark: Gradian's indexer against a LESS-style loop and the floor, in one run.

GPT-2-small-shaped random model (float32), rows of 64 tokens of which the last 16 are
supervised, the 12 MLP output projections (`mlp.c_proj`), kronecker projection 18 x 18 = 324
per module (the scale DESIGN.md quotes for bergson).

* **gradian**: `per_example_gradients` on batches of `--batch` rows (one batched
  forward+backward, projection without forming per-example gradients).
* **LESS-style**: batch size 1, the full gradient of each selected module from autograd, then a
  dense Gaussian projection of the flattened gradient to the same 324 dims per module (matrices
  generated chunk by chunk, since 324 x 2.4M floats per module do not fit in memory).
* **floor**: one batched forward+backward of the same batches with frozen parameters
  (activation gradients only, full logits): what any per-example method has to run.

    python scripts/bench/bench_gradian.py [--rows 64] [--batch 8] [--less-rows 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.core.device import measure_peak
from circuitkit.models.adapters import get_adapter
from circuitkit.models.linear_modules import module_shapes, select_modules
from gradian.capture.gradients import per_example_gradients
from gradian.projection.projector import Projector

SEQ, SUPERVISED, DIM = 64, 16, 324


def make_batches(n_rows: int, batch: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n_rows, SEQ), generator=g)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, SEQ - SUPERVISED:] = True
    return [{"input_ids": ids[i:i + batch], "attention_mask": torch.ones_like(ids[i:i + batch]),
             "supervised": sup[i:i + batch]} for i in range(0, n_rows, batch)]


def floor(model, batches) -> None:
    """Forward + backward to the input embeddings, full logits, frozen weights."""
    for b in batches:
        embeds = model.transformer.wte(b["input_ids"]).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        loss = F.cross_entropy(logits[:, :-1][b["supervised"][:, 1:]].float(),
                               b["input_ids"][:, 1:][b["supervised"][:, 1:]], reduction="sum")
        torch.autograd.grad(loss, embeds)


def less_style(model, modules, projector: Projector, batches) -> None:
    """Batch size 1, full per-module gradients by autograd, dense projection of each."""
    weights = [m.weight for _, m in modules]
    for b in batches:
        for i in range(b["input_ids"].shape[0]):
            ids, sup = b["input_ids"][i:i + 1], b["supervised"][i:i + 1]
            for w in weights:
                w.requires_grad_(True)
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1][sup[:, 1:]].float(), ids[:, 1:][sup[:, 1:]], reduction="sum")
            grads = torch.autograd.grad(loss, weights)
            for w in weights:
                w.requires_grad_(False)
            for (name, _), g in zip(modules, grads, strict=True):
                projector.project_gradient(name, g.t().reshape(1, -1))  # Conv1D stores (in, out)


def timed(fn) -> tuple[float, int]:
    with measure_peak(torch.device("cpu")) as peak:
        t0 = time.perf_counter()
        fn()
        secs = time.perf_counter() - t0
    return secs, peak.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--less-rows", type=int, default=2, help="rows for the (slow) LESS-style loop")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257)).eval()
    model.requires_grad_(False)
    adapter = get_adapter(model)
    modules = select_modules(model, adapter, ["mlp.c_proj"])
    kron = Projector(module_shapes(modules), "kronecker", DIM, seed=0)
    dense = Projector(module_shapes(modules), "dense", DIM, seed=0)
    batches = make_batches(args.rows, args.batch, model.config.vocab_size)
    floor(model, batches[:1])  # warm-up
    results = {}
    secs, peak = timed(lambda: [per_example_gradients(model, adapter, modules, kron, b) for b in batches])
    results["gradian (kronecker 18x18)"] = (args.rows / secs, peak)
    secs, peak = timed(lambda: floor(model, batches))
    results["floor (batched fwd+bwd)"] = (args.rows / secs, peak)
    less_batches = make_batches(args.less_rows, args.less_rows, model.config.vocab_size)
    secs, peak = timed(lambda: less_style(model, modules, dense, less_batches))
    results["LESS-style (bs 1, full grad, dense)"] = (args.less_rows / secs, peak)

    ours, floor_rate = results["gradian (kronecker 18x18)"][0], results["floor (batched fwd+bwd)"][0]
    table = Table(title=f"GPT-2-small shape, {SEQ}-token rows ({SUPERVISED} supervised), 12 x mlp.c_proj,"
                        f" {DIM} dims per module, float32, {torch.get_num_threads()} threads")
    for col in ("run", "rows / s", "gradian speed-up", "peak MiB (excl. weights)"):
        table.add_column(col, justify="right")
    for name, (rate, peak) in results.items():
        table.add_row(name, f"{rate:.2f}", f"{ours / rate:.2f}x", f"{peak / 2**20:.0f}")
    Console().print(table)
    Console().print(f"gradian takes {floor_rate / ours:.2f}x the floor's time (target <= 1.5x) and is"
                    f" {ours / results['LESS-style (bs 1, full grad, dense)'][0]:.0f}x the LESS-style loop (target >= 10x)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: {"rows_per_s": r, "peak_bytes": p} for k, (r, p) in results.items()}, fh, indent=2)


if __name__ == "__main__":
    main()
