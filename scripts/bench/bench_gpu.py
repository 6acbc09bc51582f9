"""Benchmark: the device-first hot paths side by side with their floors, in one run, on a GPU when one is lent.

Model: a random LlamaForCausalLM with SmolLM2-135M's shape (conf/model/smollm2.yaml; `--model llama1b`:
Llama-3.2-1B's), the fixture tokenizer (circuitkit.fixtures.models), bfloat16 on CUDA, float32 on the CPU.
Rows: `--rows` prompt/completion rows (JSONL), 60-460 tokens each, 15-35 % of each row (a quarter on
average) in the completion, seeded. Modules: every linear module of the blocks (SmolLM2: 7 x 30 = 210).
Measured side by side, in this process:

* **floor**: a hand-written loop over exactly the batches Gradian formed (recorded from its run): one
  forward+backward with frozen weights, the loss on supervised tokens only (Gradian's `token_losses`), the same
  Kronecker-projected rows (P_out δ)ᵀ(P_in x) per module from plain hooks, cast to the storage dtype
  and copied to the host once per batch (one wait per batch);
* **gradian, defaults**: `gradian.build.indexer.build_index` at the grads defaults (K-FAC sums included);
* **gradian, device-sized**: the same with `grads.batch_tokens=--device-tokens` (rows capped by tokens);
* **bergson** at the same model, rows, precision, modules and width, if a Python here imports it
  (this interpreter, .venv-peers or .venv-bergson; scripts/peers/worker_bergson.py, its timed build
  includes the model load), else "not installed"; off in --smoke and --depth-proxy unless --bergson;
* **EAP-IG** node and edge against its floor (scripts/bench/bench_attribution.py's `floor_pass`);
* **the per-device constants** (scripts/bench/calibrate_device.py): the length planner's per-batch
  overhead in tokens and the fastest logit chunk, measured on this device, beside the values in use.

Figures: rows/s and real (unpadded) tokens/s of each loop; the loop's CPU seconds; the index's wall
time (loop + the writes still pending at its end) over the loop alone; GPU busy share (NVML
utilisation sampled every 0.2 s during each loop); peak memory (CUDA max_memory_allocated; on the
CPU the live-tensor tracker, in the counting run) against the index's estimate; blocking calls per
batch (`circuitkit.core.syncs.BlockingCalls`, in a separate counting run over `--count-rows` rows)
and, on CUDA, sync warnings per batch under torch.cuda.set_sync_debug_mode("warn").

Goals the table is read against: CPU time <= 1.2x the floor at SmolLM2's depth (`--depth-proxy`); the
index's wall time <= 1.05x its loop (writes hidden); on a GPU: >= 1.0x bergson's tokens/s, >= 0.5x
the floor's, GPU busy >= 70 % at device-sized batches, EAP-IG <= 1.3x (node) / 2x (edge) its floor,
the estimate within [0.95, 1.10] of the measured CUDA peak.

    python scripts/bench/bench_gpu.py [--rows 2000] [--model smollm2|llama1b] [--device-tokens 32768] [--rounds 1]
                                      [--grads grads.KEY=VALUE] [--[no-]bergson] [--no-eap] [--no-calibrate] [--out R.md] [--json R.json]
    OMP_NUM_THREADS=1 python scripts/bench/bench_gpu.py --smoke          # SmolLM2 widths, 2 layers, 16 rows (CPU)
    OMP_NUM_THREADS=1 python scripts/bench/bench_gpu.py --depth-proxy    # 30 layers, 210 modules, tiny widths
    bash scripts/bench/gpu_run.sh                                        # on a lent GPU (scripts/README.md)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import io
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
import yaml
from rich.console import Console
from transformers import AutoTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gradian.build.indexer as indexer  # noqa: E402
from circuitkit.core.device import get_device, measure_peak, module_bytes  # noqa: E402
from circuitkit.core.syncs import BlockingCalls  # noqa: E402
from circuitkit.models.linear_modules import module_shapes, select_modules  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from gradian.build.shard_rows import ShardPipeline  # noqa: E402
from gradian.capture.gradients import token_losses  # noqa: E402
from gradian.projection.projector import Projector  # noqa: E402
from scripts.bench.calibrate_device import calibrate  # noqa: E402
from scripts.bench.calibrate_device import markdown as calibration_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# bergson renders prompt/completion rows with the chat template: one that concatenates, so all see the same tokens
CONCAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class Setting:
    """What one run measures: the model shape, the rows, the batch sizes and the extras."""

    label: str
    shape: dict[str, int]
    rows: int
    device_tokens: int
    rows_per_shard: int
    count_rows: int = 32
    lengths: tuple[int, int] = (60, 460)
    rounds: int = 1
    eap: tuple[int, int, int] | None = (8, 64, 5)  # pairs, tokens, IG steps; None: skipped
    bergson: bool = True
    overrides: tuple[str, ...] = field(default_factory=tuple)
    calibrate: bool = True  # the per-device constants (scripts/bench/calibrate_device.py)


def conf_shape(name: str) -> dict[str, int]:
    shape = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())["shape"]
    return {k: v for k, v in shape.items() if k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model",
                                                    "d_mlp", "vocab_size")}


# SmolLM2's depth and module count with tiny widths and vocabulary: per-op host cost dominates.
PROXY_SHAPE = {"n_layers": 30, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_model": 64, "d_mlp": 128,
               "vocab_size": 0}  # 0: the tokenizer's own size


def setting_from(args: argparse.Namespace, on_gpu: bool) -> Setting:
    shape = conf_shape(args.model)
    if args.smoke:
        s = Setting(f"{args.model} widths, 2 layers (smoke)", {**shape, "n_layers": 2}, 16, 8192, 8,
                    count_rows=8, eap=(2, 24, 2), bergson=False)
    elif args.depth_proxy:
        s = Setting("SmolLM2 depth (30 layers, 210 modules), tiny widths (depth proxy)", PROXY_SHAPE, 64, 8192, 32,
                    count_rows=16, rounds=3, eap=(4, 32, 3), bergson=False)
    else:
        s = Setting(f"random {args.model} shape", shape, 2000 if on_gpu else 48, 32768 if on_gpu else 8192, 512)
    if args.layers:
        s = replace(s, shape={**s.shape, "n_layers": args.layers}, label=f"{s.label}, {args.layers} layers")
    for key in ("rows", "device_tokens", "rows_per_shard", "rounds", "count_rows"):
        if getattr(args, key) is not None:
            s = replace(s, **{key: getattr(args, key)})
    return replace(s, eap=None if args.no_eap else s.eap, bergson=s.bergson if args.bergson is None else args.bergson,
                   calibrate=not args.no_calibrate,
                   overrides=(*s.overrides, *args.grads))


# -- model and rows ----------------------------------------------------------------------------
def model_dir(shape: dict[str, int], dtype: torch.dtype, device: torch.device, cache: Path) -> Path:
    """A random LlamaForCausalLM of `shape` saved (in `dtype`) with the fixture tokenizer; cached by shape."""
    key = "-".join(f"{k}{v}" for k, v in sorted(shape.items())) + f"-{str(dtype).removeprefix('torch.')}"
    out = cache / f"llama-{key}"
    if (out / "done").is_file():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    from circuitkit.fixtures.models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template, tokenizer.model_max_length = CONCAT_TEMPLATE, 2**17
    config = LlamaConfig(hidden_size=shape["d_model"], intermediate_size=shape["d_mlp"],
                         num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
                         num_key_value_heads=shape["n_kv_heads"], head_dim=shape["head_dim"],
                         vocab_size=shape["vocab_size"] or len(tokenizer), max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (Llama-3.2-1B's shape takes a while on a CPU)
        model = LlamaForCausalLM(config).to(dtype).cpu()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "done").write_text("")
    return out


def write_rows(path: Path, tokenizer: Any, n_rows: int, lengths: tuple[int, int], seed: int = 0) -> Path:
    """n_rows {"prompt", "completion"} rows: windows of the fixture corpus, lengths uniform in `lengths`
    tokens, 15-35 % of each in the completion."""
    from circuitkit.fixtures.models import synthetic_corpus

    rng = random.Random(seed)
    stream = tokenizer(" ".join(synthetic_corpus(6000, seed=seed + 1)), add_special_tokens=False)["input_ids"]
    with path.open("w") as fh:
        for _ in range(n_rows):
            total = rng.randint(*lengths)
            completion = max(1, round(total * rng.uniform(0.15, 0.35)))
            start = rng.randrange(len(stream) - total)
            ids = stream[start:start + total]
            fh.write(json.dumps({"prompt": tokenizer.decode(ids[:-completion]),
                                 "completion": tokenizer.decode(ids[-completion:])}) + "\n")
    return path


# -- measuring ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GpuBusy:
    """NVML utilisation ("a kernel ran during the last sample period", %) sampled every `period` s in a
    thread; `share(t0, t1)` is the mean over a perf_counter window, None without a GPU."""

    def __init__(self, device: torch.device, period: float = 0.2) -> None:
        self.samples: list[tuple[float, float]] = []
        self.read = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
                self.read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except Exception:  # no NVML binding: the command-line tool
                query = ["nvidia-smi", f"--id={device.index or 0}", "--query-gpu=utilization.gpu",
                         "--format=csv,noheader,nounits"]
                self.read = lambda: float(subprocess.run(query, capture_output=True, text=True).stdout.split()[0])
        self.period, self.stop = period, threading.Event()
        if self.read is not None:
            threading.Thread(target=self._run, daemon=True, name="gpu-busy").start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            with contextlib.suppress(Exception):
                self.samples.append((time.perf_counter(), float(self.read())))

    def share(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u in self.samples if t0 <= t <= t1]
        return statistics.mean(inside) / 100 if inside else None


@dataclass
class Clock:
    """Marks of one index run (perf_counter and process CPU seconds)."""

    batches: list[tuple[list[int], list[Any]]] = field(default_factory=list)  # (row ids, gradian.data.rows.Row list)
    first: tuple[float, float] | None = None
    loop_end: tuple[float, float] | None = None
    written: float | None = None
    curvature_s: float = 0.0


@contextlib.contextmanager
def clocked(device: torch.device) -> Any:
    """Patch the index loop's edges: the first batch starts the clock, `ShardPipeline.finish` (after a
    device sync) ends the loop, its return ends the writes; `finalize_curvature` is timed on its own."""
    clock = Clock()
    real_batch, real_finish, real_curvature = indexer.index_batch, ShardPipeline.finish, indexer.finalize_curvature

    def index_batch(capture, rows, plan, first_row, factors, buffer):
        if clock.first is None:
            sync(device)
            clock.first = (time.perf_counter(), time.process_time())
        clock.batches.append(([first_row + i for i in plan], rows))
        return real_batch(capture, rows, plan, first_row, factors, buffer)

    def finish(self):
        sync(device)
        clock.loop_end = (time.perf_counter(), time.process_time())
        real_finish(self)
        clock.written = time.perf_counter()

    def finalize_curvature(index_dir):
        t0 = time.perf_counter()
        try:
            return real_curvature(index_dir)
        finally:
            clock.curvature_s += time.perf_counter() - t0

    with mock.patch.object(indexer, "index_batch", index_batch), mock.patch.object(ShardPipeline, "finish", finish), \
            mock.patch.object(indexer, "finalize_curvature", finalize_curvature):
        yield clock


@contextlib.contextmanager
def sync_warnings(device: torch.device, inside: list[bool]) -> Any:
    """CUDA: the sites of torch's sync-debug warnings raised by the loop's thread while inside[0]."""
    sites: list[str] = []
    if device.type != "cuda":
        yield sites
        return
    loop = threading.current_thread()

    def show(message, category, filename, lineno, file=None, line=None):
        if inside[0] and threading.current_thread() is loop:
            sites.append(f"{Path(filename).name}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


# -- gradian -----------------------------------------------------------------------------------
QUIET = Console(file=io.StringIO())


def run_gradian(loaded, model_cfg, grads, index_dir: Path, busy: GpuBusy) -> tuple[dict[str, Any], Clock]:
    """One timed `build_index` into a fresh `index_dir` (the model already loaded)."""
    shutil.rmtree(index_dir, ignore_errors=True)
    device = loaded.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with clocked(device) as clock:
        summary = indexer.build_index(model_cfg, grads, index_dir, console=QUIET, loaded=loaded)
    end = time.perf_counter()
    (first, first_cpu), (loop, loop_cpu) = clock.first, clock.loop_end
    out = {"batches": len(clock.batches), "rows": summary["rows_stored"], "real_tokens": summary["real_tokens"],
           "computed_tokens": summary["computed_tokens"], "loop_s": loop - first, "cpu_s": loop_cpu - first_cpu,
           "index_over_loop": (clock.written - first) / (loop - first), "curvature_s": clock.curvature_s,
           "build_s": end - t0, "busy": busy.share(first, loop), "estimate_bytes": summary["estimated_peak_bytes"],
           "batch_estimate_bytes": summary["estimated_batch_peak_bytes"], "batch": summary.get("batch")}
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out, clock


def count_gradian(loaded, model_cfg, grads, index_dir: Path) -> dict[str, Any]:
    """Blocking calls (and CUDA sync warnings) per `index_batch`, and on the CPU the tracked peak."""
    shutil.rmtree(index_dir, ignore_errors=True)
    counts, names, inside, real = [], collections.Counter(), [False], indexer.index_batch

    def counted(*args, **kwargs):
        inside[0] = True
        try:
            with BlockingCalls() as calls:
                return real(*args, **kwargs)
        finally:
            inside[0] = False
            counts.append(calls.total)
            names.update(calls.by_name)

    device = loaded.device
    with mock.patch.object(indexer, "index_batch", counted), sync_warnings(device, inside) as warned, \
            measure_peak(device, lambda: module_bytes(loaded.model)) as peak:
        summary = indexer.build_index(model_cfg, grads, index_dir, console=QUIET, loaded=loaded)
    out = {"blocking": counts, "blocking_names": dict(names), "sync_warnings": len(warned),
           "sync_sites": dict(collections.Counter(warned).most_common(5))}
    if device.type == "cpu":
        out.update(peak_bytes=peak.peak_bytes, estimate_bytes=summary["estimated_peak_bytes"],
                   batch_estimate_bytes=summary["estimated_batch_peak_bytes"])
    return out


# -- the floor ---------------------------------------------------------------------------------
def floor_pass(loaded, grads, batches, out: torch.Tensor | None = None, blocking: list[dict] | None = None) -> None:
    """The hand-written floor over `batches` ((row ids, rows) as Gradian formed them): per batch one
    forward+backward, frozen weights, loss on the supervised positions only (gathered before the
    unembedding; Gradian's `token_losses`, whose margin keeps one (N, V) tensor for its backward), per module G̃ = Σ_t (P_out δ_t)(P_in x_t)ᵀ from plain hooks, rows cast to the storage
    dtype and copied to `out` (n_rows, width) on the host: one wait per batch. `blocking`: each batch's
    blocking calls (name -> count) are appended to it."""
    model, device = loaded.model, loaded.device
    modules = select_modules(model, loaded.adapter, grads.module_filter)
    projector = Projector(module_shapes(modules), grads.projection, grads.projection_dim, grads.projection_seed)
    storage = getattr(torch, grads.storage_dtype)
    blocks: dict[str, torch.Tensor] = {}

    def hook(name: str):
        p_out, p_in = projector.kronecker_matrices(name, device)  # (k_o, d_out), (k_i, d_in)

        def forward(module, args, output):
            xp = args[0].detach().float() @ p_in.T  # (B, T, k_i)

            def backward(delta):  # (B, T, d_out)
                blocks[name] = torch.bmm((delta.float() @ p_out.T).transpose(1, 2), xp).flatten(1)  # (B, k_o k_i)
            output.register_hook(backward)
        return forward

    handles = [m.register_forward_hook(hook(name)) for name, m in modules]
    pad = loaded.tokenizer.pad_token_id or 0
    try:
        for row_ids, rows in batches:
            with BlockingCalls() if blocking is not None else contextlib.nullcontext() as calls:
                width = max(len(r.input_ids) for r in rows)  # right-padded: causal attention needs no mask
                ids = np.full((len(rows), width), pad, dtype=np.int64)
                sup = np.zeros((len(rows), width), dtype=bool)
                for b, r in enumerate(rows):
                    ids[b, :len(r.input_ids)], sup[b, :len(r.supervised)] = r.input_ids, r.supervised
                ex, pos = np.nonzero(sup)  # target t is predicted at t - 1
                host = torch.from_numpy(np.stack([ex, pos - 1, ids[ex, pos]]))
                input_ids, (ex, pos, target) = (t.to(device, non_blocking=True) for t in
                                                (torch.from_numpy(ids), host))
                with torch.enable_grad():
                    x = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
                    # (as Gradian: with use_cache=False transformers 5 looks for packed rows, a wait per forward)
                    h = model.model(inputs_embeds=x).last_hidden_state[ex, pos]  # (N, d)
                    token_losses(model.lm_head(h).float(), target, grads.loss).sum().backward()
                stored = torch.cat([blocks.pop(name) for name, _ in modules], dim=1).to(storage).cpu()
                if out is not None:
                    out[row_ids] = stored
            if blocking is not None:
                blocking.append(dict(calls.by_name))
    finally:
        for handle in handles:
            handle.remove()


def run_floor(loaded, grads, batches, busy: GpuBusy, keep: bool = False) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The floor timed over `batches`; with `keep` its stored rows come back too, (n_rows, width) on the host."""
    device = loaded.device
    out = None
    if keep:
        modules = select_modules(loaded.model, loaded.adapter, grads.module_filter)
        width = Projector(module_shapes(modules), grads.projection, grads.projection_dim,
                          grads.projection_seed).total_width
        n_rows = 1 + max(max(ids) for ids, _ in batches)
        out = torch.zeros((n_rows, width), dtype=getattr(torch, grads.storage_dtype))
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    floor_pass(loaded, grads, batches, out)
    sync(device)
    t1, c1 = time.perf_counter(), time.process_time()
    real = sum(len(r.input_ids) for _, rows in batches for r in rows)
    return {"batches": len(batches), "rows": sum(len(ids) for ids, _ in batches), "real_tokens": real,
            "loop_s": t1 - t0, "cpu_s": c1 - c0, "busy": busy.share(t0, t1)}, out


# -- bergson and EAP-IG ------------------------------------------------------------------------
def bergson_python() -> str | None:
    """A Python that imports bergson: this one, else a peer venv's (`make peers`)."""
    if importlib.util.find_spec("bergson") is not None:
        return sys.executable
    for venv in (".venv-peers", ".venv-bergson"):
        python = ROOT / venv / "bin" / "python"
        if python.exists() and subprocess.run([python, "-c", "import bergson"], capture_output=True).returncode == 0:
            return str(python)
    return None


def run_bergson(model_path: Path, data: Path, modules: list[str], grads, precision: str, tokens: int,
                work: Path, timeout: float) -> dict[str, Any]:
    """scripts/peers/worker_bergson.py (a warm-up build, then the timed build, model load included)."""
    python = bergson_python()
    if python is None:
        return {"error": "not installed"}
    work.mkdir(parents=True, exist_ok=True)
    queries = work / "queries.jsonl"
    queries.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))
    spec = {"model_dir": str(model_path), "docs": str(data), "queries": {"full": str(queries)}, "modules": modules,
            "per_module_dim": grads.projection_dim, "total_dim": grads.projection_dim * len(modules),
            "seed": grads.projection_seed, "batch_size": grads.batch_size,
            "batch_tokens": tokens, "max_length": grads.max_seq_length, "precision": precision,
            "work_dir": str(work)}
    (work / "spec.json").write_text(json.dumps(spec))
    cmd = [python, str(ROOT / "scripts" / "peers" / "worker_bergson.py"), "--spec", str(work / "spec.json"),
           "--out", str(work / "result.json")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if not (work / "result.json").exists():
        return {"error": f"exited {proc.returncode}: {' | '.join(proc.stderr.strip().splitlines()[-2:])}"}
    result = json.loads((work / "result.json").read_text())
    return {"error": result["error"]} if result.get("error") else {
        "rows": result["n_rows"], "build_s": result["index_seconds"], "version": result.get("version")}


def run_eap(loaded, pairs: int, seq: int, steps: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of EAP-IG node and edge and of bench_attribution's floors, on one batch of pairs."""
    from circuitkit.discovery.attribution.eap import attribute
    from circuitkit.discovery.tasks.base import random_pairs
    from scripts.bench.bench_attribution import floor_pass as eap_floor

    model, device = loaded.model, loaded.device
    data = random_pairs(pairs, seq, model.config.vocab_size)
    on_device = data.to(device)
    runs = {"floor (full logits)": lambda: eap_floor(model, on_device, steps),
            "floor (answer logits)": lambda: eap_floor(model, on_device, steps, answer_only=True)}
    for level in ("node", "edge"):
        runs[f"eap-ig {level}"] = lambda level=level: attribute(loaded.adapter, data, "eap-ig", level, ig_steps=steps,
                                                                 batch_size=pairs, progress=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats + 1):  # the first round warms up; the runs interleave, so drift hits all alike
        for name, fn in runs.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in times.items()}


# -- the run -----------------------------------------------------------------------------------
def configs(model_path: Path, data: Path, precision: str, s: Setting, *extra: str):
    _, cfg = compose([f"model.name={model_path}", f"model.precision={precision}", f"grads.data_path={data}",
                      f"grads.rows_per_shard={s.rows_per_shard}", *s.overrides, *extra])
    return cfg.model, cfg.grads


def run_bench(s: Setting, work: Path, device: torch.device | None = None, keep_floor_rows: bool = False,
              cache: Path = ROOT / ".cache" / "bench_gpu", log=print) -> dict[str, Any]:
    """Everything the tables show (module docstring), as one dict; `keep_floor_rows`: the floor's stored rows
    of each variant's first round come back as report["floor_rows"][variant] (n_rows, width), for a check
    against Gradian's stored rows (the index directories stay in `work`). `cache`: the models' directory."""
    device = device or get_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    precision = str(dtype).removeprefix("torch.")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = model_dir(s.shape, dtype, device, cache)
    data = write_rows(work / "rows.jsonl", AutoTokenizer.from_pretrained(path), s.rows,
                      s.lengths)
    model_cfg, grads = configs(path, data, precision, s)
    t1 = time.perf_counter()
    loaded = load_model(model_cfg, device, keep_adapter=True)
    sync(device)
    load_s = time.perf_counter() - t1
    log(f"model and rows ready in {t1 - t0:.1f} s, model loaded in {load_s:.1f} s")
    busy = GpuBusy(device)
    variants = {"defaults": (), "device-sized": (f"grads.batch_tokens={s.device_tokens}",
                                                 f"grads.batch_size={max(1, s.device_tokens // s.lengths[0])}")}
    report: dict[str, Any] = {"setting": {**s.__dict__, "lengths": list(s.lengths)}, "precision": precision,
                              "model_dir": str(path), "load_s": load_s, "index": {}, "floor": {}, "counts": {},
                              "floor_blocking": None, "bergson": None, "eap": None, "calibration": None}
    for name, extra in variants.items():
        _, vgrads = configs(path, data, precision, s, *extra)
        _, counted = configs(path, data, precision, s, *extra, f"grads.data_row_range=[0,{s.count_rows}]")
        report["counts"][name] = count_gradian(loaded, model_cfg, counted, work / f"count-{name}")  # warms up too
        runs, floors = [], []
        for r in range(s.rounds):
            result, clock = run_gradian(loaded, model_cfg, vgrads, work / f"index-{name}", busy)
            runs.append(result)
            if report["floor_blocking"] is None:  # the floor's own count, on its first batches
                report["floor_blocking"] = []
                floor_pass(loaded, grads, clock.batches[:3], blocking=report["floor_blocking"])
            floor, rows = run_floor(loaded, vgrads, clock.batches, busy, keep=keep_floor_rows and r == 0)
            floors.append(floor)
            if rows is not None:
                report.setdefault("floor_rows", {})[name] = rows
            log(f"{name}, round {r + 1}/{s.rounds}: gradian {result['loop_s']:.2f} s, floor {floor['loop_s']:.2f} s"
                f" ({result['batches']} batches)")
        report["index"][name], report["floor"][name] = runs, floors
    if s.bergson:
        modules = [n for n, _ in select_modules(loaded.model, loaded.adapter, grads.module_filter)]
        report["bergson"] = run_bergson(path, data, modules, grads, precision, s.device_tokens, work / "bergson", 600)
    if s.calibrate:
        report["calibration"] = calibrate(loaded, grads, small=device.type == "cpu" and s.rows < 64)
        log(calibration_markdown(report["calibration"]))
    if s.eap is not None:
        report["eap"] = {"pairs": s.eap[0], "tokens": s.eap[1], "steps": s.eap[2],
                         "seconds": run_eap(loaded, *s.eap)}
    busy.stop.set()
    return report


# -- the tables --------------------------------------------------------------------------------
def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report as Markdown: a header, the index table, the EAP-IG table."""
    s = report["setting"]
    lines = [f"# bench_gpu: {s['label']}", "",
             f"{meta['device']}; torch {meta['torch']}; {report['precision']}; {s['rows']} rows of"
             f" {s['lengths'][0]}-{s['lengths'][1]} tokens (15-35 % supervised); rows_per_shard {s['rows_per_shard']};"
             f" device-sized: batch_tokens {s['device_tokens']}; overrides: {' '.join(s['overrides']) or 'none'};"
             f" {meta['threads']} threads; load average before / after: {meta['load']} / {meta.get('load_after', '-')}",
             "",
             "| run | batches | tokens / batch | rows/s | real tok/s | loop s | CPU s | x floor (time) | CPU x floor"
             " | index / loop | curvature s | GPU busy | peak / estimate | blocking / batch | sync warnings / batch |",
             "|" + "---|" * 15]
    for name in report["index"]:
        floors, runs, counts = report["floor"][name], report["index"][name], report["counts"][name]
        ratio = statistics.median(g["loop_s"] / f["loop_s"] for g, f in zip(runs, floors, strict=True))
        cpu_ratio = statistics.median(g["cpu_s"] / f["cpu_s"] for g, f in zip(runs, floors, strict=True))
        fb = [sum(c.values()) for c in report["floor_blocking"]]
        for label, rs, extra in ((f"floor ({name} batches)", floors, None), (f"gradian, {name}", runs, counts)):
            loop = _median(rs, "loop_s")
            peak = _median(rs, "peak_bytes") or (extra or {}).get("peak_bytes")
            # on the CPU the peak comes from the counting run: its estimates with it
            source = rs if _median(rs, "peak_bytes") else [extra or {}]
            bound, formed = _median(source, "estimate_bytes"), _median(source, "batch_estimate_bytes")
            peak_text = "n/a" if not (peak and formed) else \
                (f"{peak / 2**20:.0f} / {formed / 2**20:.0f} MiB ({formed / peak:.2f});"
                 f" bound {bound / 2**20:.0f} MiB ({bound / peak:.2f})")
            blocking = (f"{max(fb)} ({statistics.mean(fb):.1f})" if extra is None
                        else f"{max(extra['blocking'])} ({statistics.mean(extra['blocking']):.1f})")
            warned = "n/a" if meta["device"].startswith("cpu") else (
                "1 (the copy)" if extra is None else f"{extra['sync_warnings'] / len(extra['blocking']):.1f}")
            gradian = extra is not None
            computed = runs[0]["computed_tokens"] / runs[0]["batches"]  # the floor runs Gradian's batches
            lines.append(f"| {label} | {rs[0]['batches']} | {computed:,.0f} | {rs[0]['rows'] / loop:.1f}"
                         f" | {rs[0]['real_tokens'] / loop:,.0f}"
                         f" | {loop:.2f} | {_median(rs, 'cpu_s'):.2f} | {_fmt(ratio if gradian else 1.0)}"
                         f" | {_fmt(cpu_ratio if gradian else 1.0)}"
                         f" | {_fmt(_median(rs, 'index_over_loop')) if gradian else '-'}"
                         f" | {_fmt(_median(rs, 'curvature_s')) if gradian else '-'}"
                         f" | {_fmt(_median(rs, 'busy'), '.0%')} | {peak_text if gradian else '-'}"
                         f" | {blocking} | {warned} |")
    berg = report.get("bergson")
    if berg is not None:
        if berg.get("error"):
            lines.append(f"| bergson: {berg['error'].strip().splitlines()[-1][:200]} |" + " |" * 14)
        else:
            ours = report["index"]["device-sized"][0]
            ours_tps = ours["real_tokens"] / (ours["build_s"] + report["load_s"])
            tps = ours["real_tokens"] / berg["build_s"]
            lines.append(f"| bergson {berg.get('version', '')} (build incl. load {berg['build_s']:.1f} s; gradian"
                         f" device-sized load+build: {ours_tps / tps:.2f}x its tok/s) | - | - | {berg['rows'] / berg['build_s']:.1f}"
                         f" | {tps:,.0f} |" + " - |" * 10)
    lines += ["", "x floor: median over rounds of the paired ratio gradian loop / floor loop on the same batches"
              " (rounds: " + str(s["rounds"]) + "). index / loop: (first batch to the last shard written) / (first"
              " batch to the device done). blocking / batch: max (mean) over the counting run's batches"
              f" ({s['count_rows']} rows). peak / estimate: the measured peak (CUDA: max_memory_allocated;"
              " CPU: the tracker, in the counting run) against the estimate at the batches formed (ratio"
              " estimate / peak), and against the bound the device batch plans with (the longest row in the"
              " largest batch). Goals: CPU x floor <= 1.2 (depth proxy), index / loop <= 1.05; GPU:"
              " x floor <= 2 (>= 0.5x its tok/s), busy >= 70 % device-sized, estimate / peak in [0.95, 1.10]."]
    if report.get("eap"):
        e = report["eap"]
        sec = e["seconds"]
        lines += ["", f"EAP-IG, {e['pairs']} pairs x {e['tokens']} tokens, m={e['steps']} (median of 3):", "",
                  "| run | s / batch | x floor (full logits) | x floor (answer logits) |", "|---|---|---|---|"]
        for name, value in sec.items():
            lines.append(f"| {name} | {value:.3f} | {value / sec['floor (full logits)']:.2f}"
                         f" | {value / sec['floor (answer logits)']:.2f} |")
        lines.append("Goals: node <= 1.3x, edge <= 2x the floor.")
    if report.get("calibration"):
        lines += ["", calibration_markdown(report["calibration"]).rstrip()]
    return "\n".join(lines) + "\n"


def machine_meta(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads(), "load": load,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="SmolLM2 widths, 2 layers, 16 rows: the CPU check")
    mode.add_argument("--depth-proxy", action="store_true", help="30 layers and 210 modules at tiny widths (CPU)")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "llama1b"), help="the shape (conf/model)")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--device-tokens", type=int, default=None, help="grads.batch_tokens of the device-sized run")
    p.add_argument("--rows-per-shard", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="gradian/floor pairs per variant (median ratio)")
    p.add_argument("--count-rows", type=int, default=None, help="rows of the blocking-call counting run")
    p.add_argument("--grads", action="append", default=[], metavar="grads.KEY=VALUE",
                   help="an override for every Gradian run (and the floor), e.g. grads.preconditioner=none")
    p.add_argument("--no-eap", action="store_true")
    p.add_argument("--no-calibrate", action="store_true", help="skip the per-device constants' table")
    p.add_argument("--bergson", action=argparse.BooleanOptionalAction, default=None,
                   help="run bergson if installed (default: yes, except with --smoke and --depth-proxy)")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    p.add_argument("--out", default=None, help="write the Markdown here too")
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    device = get_device()
    s = setting_from(args, device.type == "cuda")
    meta = machine_meta(device)
    print(f"bench_gpu: {s.label} on {meta['device']}, load {meta['load']}", flush=True)
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench_gpu-")))
        report = run_bench(s, work, device, log=lambda text: print(text, flush=True))
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = markdown(report, meta)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **report}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
