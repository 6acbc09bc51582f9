"""Device check: memory preflight of real shapes, then attribution and indexing on a random-weight
model of a real shape, estimated vs measured peak and throughput per stage, as one JSON report.

On a machine with a CUDA GPU (about 3-5 minutes on one large GPU, always under 8):

    python scripts/tools/gpu_check.py --out gpu_check.json

1. The preflight for gemma4b and llama3b (and llama1b): the estimated attribution (node and
   edge level) and indexing peaks from the shapes in conf/model/*.yaml, against the GPU's free
   memory (nothing is loaded).
2. A random-weight model of llama1b's exact shape (conf/model/llama1b.yaml; with --models also
   llama3b) is saved with a small local tokenizer (token ids stay below the real vocabulary), and
   the real pipeline runs on it: preflight, data, attribution at node level, attribution at
   edge level, and gradient indexing of generated rows. From each stage's manifest entry:
   estimated peak, measured peak (`torch.cuda.max_memory_allocated`), their ratio, wall time,
   and examples/s (attribution) or rows/s (indexing).

`--small` runs the same steps on the CPU with a 2-layer model of llama1b's width divided by 16,
to check the script itself where there is no GPU (about a minute); its figures say nothing about
a GPU. `--budget-s` (default 420) skips the remaining models once the time is spent, so the
whole check stays under 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from circuitkit.core.device import free_memory_bytes, get_device  # noqa: E402
from circuitkit.discovery.attribution.memory import attribution_estimate  # noqa: E402
from circuitkit_app.config import compose  # noqa: E402
from circuitkit_app.stage_list import run_pipeline  # noqa: E402
from gradian.build.memory import grads_estimate  # noqa: E402

GiB = 2**30
PREFLIGHT_MODELS = ("gemma4b", "llama3b", "llama1b")
ATTRIBUTION = ["discovery.task=induction", "discovery.algorithm=eap-ig", "discovery.ig_steps=5",
               "discovery.data_params.seq_len=128", "discovery.data_params.eval_examples=4"]
GRADS = ["grads.max_seq_length=256", "grads.module_filter=[down_proj]", "grads.projection_dim=64",
         "grads.rows_per_shard=512"]


def preflight_rows(free: int) -> list[dict]:
    """Estimated peaks of the real shapes at the check's settings (no weights loaded)."""
    rows = []
    for model in PREFLIGHT_MODELS:
        for level in ("node", "edge"):
            cfg = compose([f"model={model}", *ATTRIBUTION, f"discovery.level={level}", "discovery.batch_size=8"])[1]
            rows.append({"model": model, "stage": f"attribution ({level})",
                         "estimated_bytes": attribution_estimate(cfg).total_bytes, "free_bytes": free})
        cfg = compose([f"model={model}", *GRADS, "grads.batch_size=8"])[1]
        rows.append({"model": model, "stage": "grads", "estimated_bytes": grads_estimate(cfg).total_bytes,
                     "free_bytes": free})
    for row in rows:
        row["fits"] = row["estimated_bytes"] <= 0.9 * free
    return rows


def shape_of(model: str, small: bool) -> dict:
    cfg = compose([f"model={model}"])[1]
    shape = {k: getattr(cfg.model.shape, k) for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model",
                                                       "d_mlp", "vocab_size")}
    if small:  # the script's own check on a CPU: same proportions, 1/16 of the width, 2 layers
        shape.update(n_layers=2, n_heads=shape["n_heads"] // 8, n_kv_heads=max(1, shape["n_kv_heads"] // 8),
                     d_model=shape["d_model"] // 16, d_mlp=shape["d_mlp"] // 16, vocab_size=4096)
        shape["head_dim"] = shape["d_model"] // shape["n_heads"]
    return shape


def random_model_dir(shape: dict, out: Path, device: torch.device) -> Path:
    """A random-weight Llama of `shape` in bfloat16 with the tiny fixtures' tokenizer."""
    import transformers as tf

    from circuitkit.fixtures.models import ensure_fixture

    tokenizer = tf.AutoTokenizer.from_pretrained(ensure_fixture("tiny-llama"))
    assert len(tokenizer) <= shape["vocab_size"]
    config = tf.LlamaConfig(hidden_size=shape["d_model"], intermediate_size=shape["d_mlp"],
                            num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
                            num_key_value_heads=shape["n_kv_heads"], head_dim=shape["head_dim"],
                            vocab_size=shape["vocab_size"], max_position_embeddings=2048, tie_word_embeddings=True,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with device:  # initialise where it is fast (the GPU), save from there
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


def training_rows(path: Path, n_rows: int) -> Path:
    """JSONL prompt/completion rows of the tiny corpus' sentences (about 40-120 tokens each)."""
    from circuitkit.fixtures.models import synthetic_corpus

    sentences = synthetic_corpus(2 * n_rows + 8, seed=1)
    rng = random.Random(0)
    with open(path, "w") as fh:
        for i in range(n_rows):
            prompt = " ".join(sentences[2 * i: 2 * i + rng.randint(1, 3)])
            fh.write(json.dumps({"prompt": prompt, "completion": " " + sentences[2 * i + 1]}) + "\n")
    return path


def stage_rows(manifest: dict, label: str, n_items: dict[str, int]) -> list[dict]:
    rows = []
    for stage in ("attribution", "grads"):
        entry = manifest["stages"].get(stage)
        if not entry or entry.get("status") != "ok":
            continue
        est, meas, wall = entry.get("estimated_peak_bytes"), entry["measured_peak_bytes"], entry["wall_s"]
        rows.append({"run": label, "stage": stage, "estimated_bytes": est, "measured_bytes": meas,
                     "ratio": None if not est else est / meas, "wall_s": wall, "method": entry["peak_method"],
                     "items_per_s": n_items[stage] / wall if wall else None,
                     "unit": "examples/s" if stage == "attribution" else "rows/s"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON report path")
    parser.add_argument("--small", action="store_true", help="CPU self-check with a shrunken llama1b shape")
    parser.add_argument("--models", nargs="+", default=["llama1b"], help="real shapes to run (llama1b, llama3b)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip further models after this many seconds")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    device = get_device()
    if device.type != "cuda" and not args.small:
        console.print("no CUDA GPU visible: this check measures GPU memory; run with --small to check the script"
                      " itself on the CPU.")
        return 2
    t_start = time.perf_counter()
    free = free_memory_bytes()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "small": args.small, "torch": torch.__version__, "free_bytes_at_start": free,
              "preflight": preflight_rows(free), "runs": []}
    n_examples, batch, n_rows = (8, 4, 32) if args.small else (64, 8, 512)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        data = training_rows(tmp / "rows.jsonl", n_rows)
        for model in args.models:
            if time.perf_counter() - t_start > args.budget_s:
                report["runs"].append({"run": model, "skipped": f"time budget of {args.budget_s:.0f} s spent"})
                continue
            shape = shape_of(model, args.small)
            t0 = time.perf_counter()
            model_dir = random_model_dir(shape, tmp / model, device)
            build_s = time.perf_counter() - t0
            common = [f"model.name={model_dir}", "model.precision=bfloat16", *ATTRIBUTION,
                      f"discovery.data_params.num_examples={n_examples}", f"discovery.batch_size={batch}"]
            for level in ("node", "edge"):
                stages = "[preflight,data,attribution,grads]" if level == "node" else "[data,attribution]"
                cfg = compose([*common, f"discovery.level={level}", f"stages={stages}", *GRADS,
                               f"grads.data_path={data}", f"grads.batch_size={batch}",
                               "preflight.on_exceed=warn"])[1]
                manifest = run_pipeline(cfg, tmp / f"run-{model}-{level}", console)
                rows = stage_rows(manifest, f"{model} {level}", {"attribution": n_examples, "grads": n_rows})
                for row in rows:
                    row.update(shape=shape, model_build_s=round(build_s, 1))
                report["runs"].extend(rows)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    Path(args.out).write_text(json.dumps(report, indent=2))

    pre = Table(title=f"preflight estimates vs {free / GiB:.1f} GiB free ({report['device']})")
    for col in ("model", "stage", "estimated GiB", "fits (90%)"):
        pre.add_column(col, justify="right")
    for row in report["preflight"]:
        pre.add_row(row["model"], row["stage"], f"{row['estimated_bytes'] / GiB:.2f}", "yes" if row["fits"] else "no")
    console.print(pre)
    runs = Table(title="random-weight real shape: estimated vs measured peak, throughput")
    for col in ("run", "stage", "estimated MiB", "measured MiB", "est/meas", "wall s", "throughput"):
        runs.add_column(col, justify="right")
    for row in report["runs"]:
        if "skipped" in row:
            runs.add_row(row["run"], "skipped", "", "", "", "", row["skipped"])
            continue
        est = "-" if row["estimated_bytes"] is None else f"{row['estimated_bytes'] / 2**20:.0f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        runs.add_row(row["run"], row["stage"], est, f"{row['measured_bytes'] / 2**20:.0f}", ratio,
                     f"{row['wall_s']:.1f}", f"{row['items_per_s']:.2f} {row['unit']}")
    console.print(runs)
    console.print(f"report: {args.out} (total {report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
