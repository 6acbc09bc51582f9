"""The two per-device constants of the index loop, measured on the device it runs on.

* **The length planner's per-batch overhead** (`circuitkit.core.batching.batch_overhead_tokens`): one
  index batch (Gradian's capture: collate, copy, forward, backward, rows and K-FAC sums; a device sync
  after each) timed over a grid of rows x lengths, fitted as seconds = a + b x padded tokens by least
  squares; a / b is what one more batch costs in tokens, the planner's constant.
* **A 16-bit input's projection** (CUDA only): today's float32 copy of x against `mm(..., out_dtype=float32)`
  and a 16-bit matmul, time and error (the data for dropping the copy).
* **The logit chunk** (`gradian.capture.gradients.logit_chunk_rows`): the supervised positions'
  unembedding, loss and backward (`supervised_loss_grad`) over N positions at chunks of 2^20-2^26
  elements, each timed with a sync; the fastest, and each size's time over the one in use.

Run by `scripts/bench/bench_gpu.py` (its "per-device constants" table; on a lent GPU that is the
measurement the constants' comments ask for), or alone:

    OMP_NUM_THREADS=1 python scripts/bench/calibrate_device.py [--model smollm2] [--layers 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import gradian.capture.gradients as gradients
from circuitkit.core.batching import batch_overhead_tokens
from circuitkit.models.linear_modules import module_shapes, select_modules
from gradian.capture.consumers import RowsConsumer
from gradian.capture.gradients import Capture, LossSettings, logit_chunk_rows, supervised_loss_grad
from gradian.curvature.consumers import FactorSumsConsumer
from gradian.curvature.factors import FactorSums
from gradian.data.batch import collate, to_device
from gradian.data.rows import Row
from gradian.projection.projector import Projector

CHUNK_EXPONENTS = (20, 22, 24, 26)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, run, repeats: int) -> float:
    """The median wall seconds of `run()` (a sync before and after each), after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def batch_overhead(loaded, grads, grid_rows=(1, 2, 4, 8), grid_lengths=(64, 128, 256), repeats: int = 3,
                   seed: int = 0) -> dict[str, Any]:
    """Seconds per index batch over the grid, the fit a + b x tokens, and a / b in tokens (module docstring)."""
    model, adapter, device = loaded.model, loaded.adapter, loaded.device
    modules = select_modules(model, adapter, grads.module_filter)
    names = [name for name, _ in modules]
    projector = Projector(module_shapes(modules), grads.projection, grads.projection_dim, grads.projection_seed)
    settings = LossSettings(grads.loss_reduction, grads.loss, "auto")
    vocab = int(adapter.config.vocab_size)
    rng = np.random.default_rng(seed)
    points = []
    with Capture(model, adapter, modules, projector, settings) as capture:  # as the index loop: hooks once per run
        for length in grid_lengths:
            for n_rows in grid_rows:
                supervised = [t >= length - max(1, length // 4) for t in range(length)]  # the last quarter
                rows = [Row(row_id=i, line=i, input_ids=rng.integers(0, vocab, length).tolist(),
                            supervised=supervised, preview="") for i in range(n_rows)]

                def one_batch(rows=rows):
                    batch = to_device(collate(rows, 0), device)
                    capture.batch(batch, [RowsConsumer(projector, names),
                                          FactorSumsConsumer(FactorSums(projector.names))])
                points.append((n_rows * length, _timed(device, one_batch, repeats)))
    tokens = np.array([p[0] for p in points], dtype=np.float64)
    seconds = np.array([p[1] for p in points], dtype=np.float64)
    b, a = np.polyfit(tokens, seconds, 1)
    return {"points": points, "a_s": float(a), "b_s_per_token": float(b),
            "overhead_tokens": float(a / b) if b > 0 else None, "in_use": batch_overhead_tokens(device)}


def logit_chunk(loaded, n_positions: int = 1024, repeats: int = 3, loss: str = "margin",
                exponents=CHUNK_EXPONENTS) -> dict[str, Any]:
    """`supervised_loss_grad` over `n_positions` at each chunk size (module docstring)."""
    adapter, device = loaded.adapter, loaded.device
    dtype = next(loaded.model.parameters()).dtype
    vocab, d = int(adapter.config.vocab_size), int(adapter.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_positions, d, generator=g).to(device, dtype)
    targets = torch.randint(0, vocab, (n_positions,), generator=g).to(device)
    weights = torch.ones(n_positions, device=device)
    kind = device.type
    seconds = {}
    for e in exponents:
        with mock.patch.dict(gradients.LOGIT_CHUNK_ELEMENTS, {kind: 2**e}):
            seconds[e] = _timed(device, lambda: supervised_loss_grad(adapter, h, targets, weights, loss), repeats)
    in_use = logit_chunk_rows(vocab, device) * vocab
    best = min(seconds, key=seconds.get)
    closest = min(seconds, key=lambda e: abs(2**e - in_use))
    return {"positions": n_positions, "vocab": vocab, "seconds": seconds, "best_exponent": best,
            "in_use_elements": in_use, "over_in_use": {e: s / seconds[closest] for e, s in seconds.items()}}


def input_projection(loaded, grads, tokens: int = 32768, repeats: int = 10) -> dict[str, Any] | None:
    """A 16-bit model's module input projected three ways, on CUDA (None elsewhere: the CPU has no
    `mm` with `out_dtype`): today's float32 copy of x then a float32 matmul; `mm(x, P_in,
    out_dtype=float32)` with P_in rounded to x's dtype (no copy of x, float32 accumulation and
    output); and a 16-bit matmul cast after. Seconds per call and the relative error of each
    against float64, for the first module's shape at `tokens` positions."""
    device, dtype = loaded.device, next(loaded.model.parameters()).dtype
    if device.type != "cuda" or torch.finfo(dtype).bits != 16:
        return None
    modules = select_modules(loaded.model, loaded.adapter, grads.module_filter)
    name = modules[0][0]
    projector = Projector(module_shapes(modules), grads.projection, grads.projection_dim, grads.projection_seed)
    p_in = projector.kronecker_matrices(name, device)[1]  # (k_i, d_in) float32
    x = torch.randn(tokens, p_in.shape[1], device=device).to(dtype)
    exact = x.double() @ p_in.double().T
    ways = {"float32 copy": lambda: x.float() @ p_in.T,
            "mm out_dtype": lambda: torch.mm(x, p_in.T.to(dtype), out_dtype=torch.float32),
            "16-bit, cast after": lambda: (x @ p_in.T.to(dtype)).float()}
    out: dict[str, Any] = {"module": name, "tokens": tokens, "shape": list(p_in.shape)}
    for label, run in ways.items():
        try:
            error = float((run().double() - exact).norm() / exact.norm())
            out[label] = {"seconds": _timed(device, run, repeats), "relative_error": error}
        except Exception as exc:  # an op this build lacks: said in the table, the rest still runs
            out[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def calibrate(loaded, grads, small: bool = False) -> dict[str, Any]:
    """Both constants (and, on CUDA with a 16-bit model, `input_projection`); `small`: a grid and a
    position count for a CPU smoke run."""
    grid = dict(grid_rows=(1, 2, 4), grid_lengths=(32, 96)) if small else {}
    positions = 256 if small else (4096 if loaded.device.type != "cpu" else 1024)
    return {"device": str(loaded.device), "overhead": batch_overhead(loaded, grads, **grid),
            "chunk": logit_chunk(loaded, positions, loss=grads.loss), "projection": input_projection(loaded, grads)}


def markdown(cal: dict[str, Any]) -> str:
    o, c = cal["overhead"], cal["chunk"]
    overhead = "n/a" if o["overhead_tokens"] is None else f"{o['overhead_tokens']:,.0f}"
    lines = [f"Per-device constants on {cal['device']} (scripts/bench/calibrate_device.py):", "",
             "| constant | measured | in use |", "|---|---|---|",
             f"| planner overhead per batch (tokens; fit over {len(o['points'])} batch shapes: a = {1e3 * o['a_s']:.2f} ms,"
             f" b = {1e6 * o['b_s_per_token']:.2f} us/token) | {overhead} | {o['in_use']} |",
             f"| logit chunk (elements; {c['positions']} positions, V {c['vocab']:,}) | 2^{c['best_exponent']}"
             f" ({'; '.join(f'2^{e}: {r:.2f}x' for e, r in c['over_in_use'].items())} the time in use)"
             f" | {c['in_use_elements']:,} |"]
    proj = cal.get("projection")
    if proj:
        lines += ["", f"A 16-bit input projected ({proj['module']}, {proj['tokens']} positions, P_in {proj['shape']}):", "",
                  "| way | s / call | relative error vs float64 |", "|---|---|---|"]
        for label, r in proj.items():
            if isinstance(r, dict):
                lines.append(f"| {label} | {r['error']} | - |" if "error" in r else
                             f"| {label} | {r['seconds'] * 1e6:.1f} us | {r['relative_error']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from circuitkit.core.device import get_device
    from circuitkit.models.loading import load_model
    from scripts.bench.bench_gpu import Setting, conf_shape, configs, model_dir  # the same model and config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "llama1b"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--small", action="store_true", help="a small grid (a CPU check)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = get_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = conf_shape(args.model)
    if args.layers:
        shape["n_layers"] = args.layers
    path = model_dir(shape, dtype, device, Path(__file__).resolve().parents[2] / ".cache" / "bench_gpu")
    setting = Setting("calibration", shape, 1, 0, 1)
    rows = path / "calibration-rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "completion": " b"}) + "\n")
    model_cfg, grads = configs(path, rows, str(dtype).removeprefix("torch."), setting)
    cal = calibrate(load_model(model_cfg, device, keep_adapter=True), grads, small=args.small)
    print(markdown(cal))
    if args.json:
        Path(args.json).write_text(json.dumps(cal, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
