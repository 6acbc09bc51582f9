"""Benchmark: the memory guide's speed / quality / memory trade-offs, measured for CircuitKit.

For each model (the trained induction fixture on its task; a GPT-2-small-shaped and a
Llama-shaped model with random weights on IOI pairs):

* quality: EAP-IG scores for every quadrature rule (discovery.ig_rule) and ig_steps against a
  float32 reference with many points (gauss_legendre, --ref-steps 100): relative L2 error of the
  node score vector (embedding, heads, MLPs) and of the edge score matrix, Spearman of both,
  top-k overlap of the heads and of the edges, and the IG completeness gap |s(embed) − (m(clean)
  − m(corrupted))| / |m(clean) − m(corrupted)|. Edge-level runs give the node scores too. The
  passes each rule needs to reach the error of 30 right-sum steps come from the same sweep.
* precision: the same in bfloat16 (the model itself changes: errors are against the float32
  reference), and bfloat16 against float32 at equal settings (the guide's "< 0.1% score diff").
* cost: wall time over the examples and the peak memory of one batch (CPU: the live-tensor
  tracker of circuitkit.core.device, weights included) for node / edge level, float32 / bfloat16,
  batch_size 1 / 4 / 16, at ig_steps 2 (--cost-steps for more; time per pass is linear and
  measured in the quality sweep, the peak does not change from 2 points on).

Everything for one model runs in one process, back to back; timings depend on the machine and
its load, ratios much less. `--write-data` stores the quality table as
circuitkit/discovery/attribution/ig_tradeoffs.json, which the preflight and `circuitkit discover-smart`
read for their advice.

    python scripts/bench/bench_tradeoffs.py [--models induction gpt2-small llama-small] [--json out.json]
        [--write-data] [--ref-steps 100] [--check-ref] [--pairs 16] [--quality-pairs 2] [--seq 32]
        [--cost-steps 5 3] [--skip-cost]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution.eap import AttributionScores, attribute
from circuitkit.discovery.attribution.quadrature import IG_RULES
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import get_adapter

REPO = Path(__file__).resolve().parents[2]
DATA_PATH = REPO / "circuitkit" / "attribution" / "ig_tradeoffs.json"
RIGHT_STEPS = (1, 2, 3, 5, 10, 30)
# Other rules: this grid, stopped once two grid points in a row are within the m = 30 right-sum error.
RULE_STEPS = (2, 3, 4, 5, 6, 8, 10, 15, 20, 30)
MiB = 2**20


@dataclass
class Bench:
    name: str
    description: str
    model: torch.nn.Module
    quality_data: TaskData
    cost_data: TaskData


def _ioi(n: int, seed: int) -> TaskData:
    from circuitkit.discovery.config import DataParams
    from circuitkit.discovery.tasks import build_task
    from circuitkit.fixtures.models import build_tokenizer

    return build_task("ioi", build_tokenizer(), None, DataParams(), n, seed)


def _random_model(config) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    model.requires_grad_(False)
    return model


def build(name: str, args: argparse.Namespace) -> Bench:
    """The model and its task data (quality pairs, and cost pairs for the batch-size sweep)."""
    import transformers as tf

    if name == "induction":
        from circuitkit.discovery.config import DataParams
        from circuitkit.discovery.tasks import build_task
        from circuitkit.models.config import ModelConfig
        from circuitkit.models.loading import load_model

        lm = load_model(ModelConfig(name="builtin:induction", precision="float32"))
        data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=args.seq), args.pairs, 0)
        return Bench(name, f"trained 2-layer attention-only induction model, {args.pairs} pairs x {args.seq} tokens",
                     lm.model, data, data)
    if name == "gpt2-small":
        model = _random_model(tf.GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024))
        desc = "GPT-2-small shape (12 x 12 heads, d 768, vocab 50257), random weights, IOI"
    elif name == "llama-small":
        model = _random_model(tf.LlamaConfig(num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                             head_dim=64, hidden_size=1024, intermediate_size=2816,
                                             vocab_size=32000, max_position_embeddings=512))
        desc = "Llama shape (8 layers x 16 heads, 4 KV heads, d 1024, f 2816, vocab 32000), random weights, IOI"
    else:
        raise SystemExit(f"unknown model {name!r}; choose from induction, gpt2-small, llama-small")
    return Bench(name, desc, model, _ioi(args.quality_pairs, 0), _ioi(args.pairs, 1))


# --------------------------------------------------------------------------- error measures

def node_vector(s: AttributionScores) -> torch.Tensor:
    return torch.cat([s.embed.reshape(1), s.head.flatten(), s.mlp.flatten()]).double()


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _ranks(a), _ranks(b)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    k = max(1, min(k, a.numel()))
    top_a = set(a.abs().topk(k).indices.tolist())
    top_b = set(b.abs().topk(k).indices.tolist())
    return len(top_a & top_b) / k


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def errors(s: AttributionScores, ref: AttributionScores) -> dict[str, float]:
    """Score error of `s` against the reference (node vector; edges when both have them)."""
    gap = ref.metric_clean - ref.metric_corrupted
    heads, ref_heads = s.head.flatten().double(), ref.head.flatten().double()
    out = {"rel_l2_node": rel_l2(node_vector(s), node_vector(ref)),
           "spearman_node": spearman(node_vector(s), node_vector(ref)),
           "topk_heads": topk_overlap(heads, ref_heads, max(3, heads.numel() // 10)),
           "completeness_gap": abs(float(s.embed) - (s.metric_clean - s.metric_corrupted)) / max(abs(gap), 1e-30)}
    if s.edges is not None and ref.edges is not None:
        mask = ref.graph.edge_mask()
        e, r = s.edges[mask].double(), ref.edges[mask].double()
        out.update(rel_l2_edge=rel_l2(e, r), spearman_edge=spearman(e, r),
                   topk_edges=topk_overlap(e, r, max(10, e.numel() // 100)))
    return out


# --------------------------------------------------------------------------- runs

def timed_attribute(model, data: TaskData, rule: str, steps: int, level: str, batch: int):
    adapter = get_adapter(model)
    t0 = time.perf_counter()
    s = attribute(adapter, data, "eap-ig", level, ig_steps=steps, batch_size=batch, progress=False, ig_rule=rule)
    return s, time.perf_counter() - t0


def quality_sweep(bench: Bench, args: argparse.Namespace, console: Console) -> dict:
    """Every rule's errors against the float32 reference (edge level, float32), plus bfloat16 points."""
    data, batch = bench.quality_data, min(args.batch, len(bench.quality_data))
    ref, ref_s = timed_attribute(bench.model, data, "gauss_legendre", args.ref_steps, "edge", batch)
    ref_uncertainty = float("nan")
    if args.check_ref:  # how far the reference itself is from the integral
        check, _ = timed_attribute(bench.model, data, "midpoint", args.ref_steps, "edge", batch)
        ref_uncertainty = errors(check, ref)["rel_l2_node"]
    console.print(f"[{bench.name}] reference gauss_legendre m={args.ref_steps}: {ref_s:.1f} s;"
                  f" midpoint m={args.ref_steps} differs by {ref_uncertainty:.2e} (node rel. L2)")
    rows = []
    fp32_by_setting = {}
    for steps in RIGHT_STEPS:
        s, wall = timed_attribute(bench.model, data, "right", steps, "edge", batch)
        fp32_by_setting[("right", steps)] = s
        rows.append({"rule": "right", "steps": steps, "precision": "float32", "wall_s": wall, **errors(s, ref)})
    target = next(r for r in rows if r["steps"] == 30)
    for rule in IG_RULES[1:]:
        below_in_a_row = 0
        for steps in RULE_STEPS:
            s, wall = timed_attribute(bench.model, data, rule, steps, "edge", batch)
            fp32_by_setting[(rule, steps)] = s
            row = {"rule": rule, "steps": steps, "precision": "float32", "wall_s": wall, **errors(s, ref)}
            rows.append(row)
            ok = row["rel_l2_node"] <= target["rel_l2_node"] and row["rel_l2_edge"] <= target["rel_l2_edge"]
            below_in_a_row = below_in_a_row + 1 if ok else 0
            if below_in_a_row >= 2 and steps >= 5:
                break
    # bfloat16: the model's weights change too, so these errors include the model's own change.
    bf16 = copy.deepcopy(bench.model).to(torch.bfloat16)
    bf16_rows = []
    for rule, steps in (("right", 5), ("right", 3), ("gauss_legendre", 3), ("midpoint", 10)):
        s, wall = timed_attribute(bf16, data, rule, steps, "edge", batch)
        s32 = fp32_by_setting.get((rule, steps))
        if s32 is None:
            s32, _ = timed_attribute(bench.model, data, rule, steps, "edge", batch)
            fp32_by_setting[(rule, steps)] = s32
        vs_fp32 = errors(s, s32)
        bf16_rows.append({"rule": rule, "steps": steps, "precision": "bfloat16", "wall_s": wall, **errors(s, ref),
                          "rel_l2_node_vs_fp32_same_setting": vs_fp32["rel_l2_node"],
                          "rel_l2_edge_vs_fp32_same_setting": vs_fp32.get("rel_l2_edge", float("nan"))})
    del bf16
    return {"reference": {"rule": "gauss_legendre", "steps": args.ref_steps, "wall_s": ref_s,
                          "midpoint_same_steps_rel_l2_node": ref_uncertainty,
                          "metric_gap": ref.metric_clean - ref.metric_corrupted, "n_examples": len(data)},
            "rows": rows + bf16_rows, "passes_needed": passes_needed(rows)}


def passes_needed(rows: list[dict]) -> dict:
    """Per rule: the fewest passes whose node and edge errors are within the m = 30 right-sum ones
    (first grid point reaching it, and the point from which every larger measured one stays there)."""
    target = next(r for r in rows if r["rule"] == "right" and r["steps"] == 30 and r["precision"] == "float32")
    out = {}
    for rule in IG_RULES:
        mine = sorted((r for r in rows if r["rule"] == rule and r["precision"] == "float32"), key=lambda r: r["steps"])
        ok = [r["rel_l2_node"] <= target["rel_l2_node"] * 1.0001 and r["rel_l2_edge"] <= target["rel_l2_edge"] * 1.0001
              for r in mine]
        first = next((r["steps"] for r, good in zip(mine, ok, strict=True) if good), None)
        stays = None
        for i in range(len(mine)):
            if all(ok[i:]):
                stays = mine[i]["steps"]
                break
        out[rule] = {"first": first, "stays": stays, "target_rel_l2_node": target["rel_l2_node"],
                     "target_rel_l2_edge": target["rel_l2_edge"]}
    return out


def cost_sweep(bench: Bench, args: argparse.Namespace) -> list[dict]:
    """Wall time over the cost pairs and the peak of one batch: level x precision x batch x steps.

    The peak is measured once per (precision, level, batch) at ig_steps 2: from the second point
    on, ig_steps changes the time only (the passes reuse the same running sums)."""
    rows = []
    for precision in ("float32", "bfloat16"):
        model = bench.model if precision == "float32" else copy.deepcopy(bench.model).to(torch.bfloat16)
        for level in ("node", "edge"):
            for batch in (1, 4, 16):
                batch_data = bench.cost_data[:batch]
                adapter = get_adapter(model)
                with measure_peak(torch.device("cpu"), resident_bytes=lambda model=model: module_bytes(model)) as peak:
                    attribute(adapter, batch_data, "eap-ig", level, ig_steps=2, batch_size=batch, progress=False)
                for steps in args.cost_steps:  # time per pass is the quality sweep's wall_s slope
                    _, wall = timed_attribute(model, bench.cost_data, "right", steps, level, batch)
                    rows.append({"precision": precision, "level": level, "batch": batch, "steps": steps,
                                 "wall_s": wall, "peak_bytes": peak.peak_bytes,
                                 "n_examples": len(bench.cost_data)})
        del model
    return rows


# --------------------------------------------------------------------------- tables

def quality_table(name: str, q: dict) -> Table:
    t = Table(title=f"{name}: score error vs float32 gauss_legendre m={q['reference']['steps']}")
    for col in ("rule", "passes", "dtype", "rel L2 node", "rel L2 edge", "Spearman node", "Spearman edge",
                "top-k heads", "top-k edges", "completeness gap", "s"):
        t.add_column(col, justify="right")
    for r in q["rows"]:
        t.add_row(r["rule"], str(r["steps"]), r["precision"], f"{r['rel_l2_node']:.2%}", f"{r['rel_l2_edge']:.2%}",
                  f"{r['spearman_node']:.3f}", f"{r['spearman_edge']:.3f}", f"{r['topk_heads']:.2f}",
                  f"{r['topk_edges']:.2f}", f"{r['completeness_gap']:.2%}", f"{r['wall_s']:.1f}")
    return t


def cost_table(name: str, rows: list[dict]) -> Table:
    t = Table(title=f"{name}: time over {rows[0]['n_examples']} examples and peak of one batch")
    for col in ("dtype", "level", "batch", "ig_steps", "s", "peak MiB"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["precision"], r["level"], str(r["batch"]), str(r["steps"]), f"{r['wall_s']:.2f}",
                  f"{r['peak_bytes'] / MiB:.1f}")
    return t


def data_file(results: dict, meta: dict) -> dict:
    """What the advice reads: per model and rule, passes -> node / edge error and wall seconds."""
    models = {}
    for name, res in results.items():
        if "quality" not in res:
            continue
        q = res["quality"]
        models[name] = {"description": res["description"],
                        "reference": q["reference"],
                        "points": [{k: r[k] for k in ("rule", "steps", "rel_l2_node", "rel_l2_edge", "wall_s")}
                                   for r in q["rows"] if r["precision"] == "float32"],
                        "passes_needed": q["passes_needed"]}
    return {"command": meta["command"], "date": meta["date"], "models": models}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["induction", "gpt2-small", "llama-small"])
    parser.add_argument("--ref-steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=16, help="examples of the cost sweep (and induction quality)")
    parser.add_argument("--quality-pairs", type=int, default=2, help="IOI examples of the quality sweep")
    parser.add_argument("--seq", type=int, default=32, help="induction sequence length")
    parser.add_argument("--cost-steps", type=int, nargs="+", default=[2], help="ig_steps timed in the cost sweep")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--from-json", nargs="+", default=None,
                        help="merge saved --json files (e.g. quality and cost run apart) instead of running")
    parser.add_argument("--check-ref", action="store_true",
                        help="also run midpoint at --ref-steps to show how converged the reference is")
    parser.add_argument("--batch", type=int, default=16, help="batch size of the quality sweep")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-data", action="store_true", help=f"store the quality table as {DATA_PATH.name}")
    args = parser.parse_args(argv)
    console = Console(width=160)
    meta = {"command": "python scripts/bench/bench_tradeoffs.py " + " ".join(argv or __import__("sys").argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine()}
    results = {}
    for path in args.from_json or []:
        saved = json.loads(Path(path).read_text())
        meta = {**saved["meta"], "command": meta["command"] + f" (merging runs of: {saved['meta']['command']})"
                if "merging" not in meta["command"] else meta["command"]}
        for name, res in saved["results"].items():
            results.setdefault(name, {}).update(res)
    for name, res in results.items():
        if "quality" in res:
            console.print(quality_table(name, res["quality"]))
        if "cost" in res:
            console.print(cost_table(name, res["cost"]))
    for name in [] if args.from_json else args.models:
        t0 = time.perf_counter()
        bench = build(name, args)
        res = {"description": bench.description}
        if not args.skip_quality:
            res["quality"] = quality_sweep(bench, args, console)
            console.print(quality_table(name, res["quality"]))
            console.print(f"passes needed to reach the m=30 right-sum error: {res['quality']['passes_needed']}")
        if not args.skip_cost:
            res["cost"] = cost_sweep(bench, args)
            console.print(cost_table(name, res["cost"]))
        res["total_s"] = time.perf_counter() - t0
        results[name] = res
        console.print(f"[{name}] {res['total_s']:.0f} s")
        if args.json:  # after each model, so a long run keeps what it measured
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.write_data:
        from circuitkit.core.io import atomic_write_json

        atomic_write_json(DATA_PATH, data_file(results, meta))
        console.print(f"wrote {DATA_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
