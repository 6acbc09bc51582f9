"""The pruned checkpoint against its base model, side by side in one run.

    python scripts/bench/bench_export_hf.py RUN_DIR [--text FILE] [--tokens 128] [--batch 4] [--repeats 3]

RUN_DIR is a pipeline run with the export stage (export.format=hf: RUN_DIR/pruned_model). Both
models are loaded with plain `AutoModelForCausalLM.from_pretrained` (float32, CPU) and measured
on the same inputs: parameters and bytes, forward tokens/s (min time of `--repeats`), the task
metric on the run's held-out pairs (and the faithfulness it gives against the pruning stage's
full / empty figures), and the perplexity of held-out text (default: the GNU GPL v3 text, which
no task prompt comes from). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from circuitkit.core.circuit_file import load_circuit
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.export.hf import PROVENANCE_FILE
from circuitkit.discovery.pruning.heads import faithfulness
from circuitkit.discovery.stages import _read_task_data
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import pretrained_args

GPL = Path("/usr/share/common-licenses/GPL-3")


def sizes(model) -> dict:
    params = list(model.parameters())
    return {"n_params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params)}


@torch.no_grad()
def tokens_per_s(model, ids: torch.Tensor, repeats: int) -> float:
    model(input_ids=ids)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids)
        best = min(best, time.perf_counter() - t0)
    return ids.numel() / best


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    out = model(input_ids=ids, labels=ids)
    return math.exp(out.loss.item())


@torch.no_grad()
def task_metric(model, base, held, metric: str) -> float:
    total = 0.0
    for batch in held.batches(8):
        clean = answer_forward(base, batch.clean_ids, batch.attention_mask, batch.answer_pos).float()
        logits = answer_forward(model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        total += compute_metric(metric, logits, batch, clean).sum().item()
    return total / len(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--text", type=Path, default=GPL)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run, out = args.run_dir, args.run_dir / "pruned_model"
    prov = json.loads((out / PROVENANCE_FILE).read_text())
    circuit = load_circuit(run / "circuit.pt")
    metric = circuit.config["discovery"]["metric"]
    base_dir = pretrained_args(ModelConfig(name=prov["base_model"]["name"]))[0]  # builtin:, fetched: resolved
    tok = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    pruned = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text_ids = tok(args.text.read_text(), return_tensors="pt").input_ids[0]
    n = args.batch * args.tokens
    speed_ids = text_ids[:n].view(args.batch, args.tokens)
    ppl_ids = text_ids[n:n + 4 * 256].view(4, 256)  # other tokens than the speed batch
    data, n_attr = _read_task_data(run / "data.safetensors")
    held = data[n_attr:]
    w = circuit.weight_ablations[prov["ablation"]]
    rows = {}
    for name, model in (("base", base), ("pruned", pruned)):
        m = task_metric(model, base, held, metric)
        rows[name] = {**sizes(model), "tokens_per_s": tokens_per_s(model, speed_ids, args.repeats),
                      "task_metric": m, "faithfulness": faithfulness(m, w["full"], w["empty"]),
                      "perplexity": perplexity(model, ppl_ids)}
    rows["pruned"]["safetensors_bytes"] = prov["safetensors_bytes"]
    rows["base"]["safetensors_bytes"] = sum(p.stat().st_size for p in Path(base_dir).glob("*.safetensors"))
    print(json.dumps({"run_dir": str(run), "ablation": prov["ablation"], "metric": metric,
                      "heads_removed": prov["n_heads_removed"], "heads_kept": prov["n_heads_kept"],
                      "kv_groups_cut_per_layer": prov["physically_removed"]["kv_groups_per_layer"],
                      "why_not": prov["physically_removed"]["why_not"],
                      "reported": {"weight_ablation": w, "reference_ablation": circuit.weight_ablations["reference_ablation"],
                                   "reference_faithfulness": circuit.weight_ablations["reference_faithfulness"]},
                      "n_held_out": len(held), "speed_batch": [args.batch, args.tokens], "ppl_tokens": ppl_ids.numel(),
                      "text": str(args.text), "cpu": os.cpu_count(), "load_1min": os.getloadavg()[0], **rows}, indent=1))


if __name__ == "__main__":
    main()
