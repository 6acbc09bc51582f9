"""Benchmark: Gradian and CircuitKit side by side with the peer tools, in one run.

Gradient indexing (Gradian vs bergson, traker, dattri). The planted-fact corpus of
scripts/bench/bench_planted_facts.py (40 made-up entities x 4 facts + 40 generic sentences = 200
prompt/completion documents; 160 queries asked two ways, full sentence and answer only) and a
GPT-2-shaped model fine-tuned here on the documents (the tiny fixture shape by default, float32).
Every tool indexes the same JSONL file with the same model directory, the loss summed over the
completion tokens only, gradients of the same linear modules (every Conv1D of the blocks,
weights only) and the same projection width: per module sqrt(d) x sqrt(d) for the tools that
project per module (Gradian's kronecker, bergson, dattri's LoGra), one global projection of the
same total width for TRAK. Each tool runs in a fresh process of its own virtual environment
(`make peers`); the worker scripts are in scripts/peers/. Measured per tool: indexing time
(JSONL to stored rows, model load included) as examples/s, the peak resident memory the indexing
added (same RSS method for every tool, scripts/peers/peak.py), bytes kept per row, and recall@10
and MRR of each query's target document, for several projection seeds (mean over seeds).

Circuit discovery (CircuitKit vs auto-circuit): scripts/peers/circuit_peers.py, on the same
weights loaded into a HookedTransformer.

    python scripts/bench/bench_peers.py [--quick] [--seeds 3] [--dims 256] [--tools gradian,bergson,...]
                                  [--no-circuit] [--json out.json]

A tool that cannot run here is a row that says why, with its error; the run goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
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

from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.linear_modules import select_modules  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from scripts.bench.bench_planted_facts import fine_tuned_model, make_corpus, metrics, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "scripts" / "peers"
# tool -> (virtual environment, worker script, spec entries of its own)
TOOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gradian": (".venv", "worker_gradian.py", {"storage_dtype": "float16"}),
    "gradian-fp32": (".venv", "worker_gradian.py", {"storage_dtype": "float32"}),
    "bergson": (".venv-peers", "worker_bergson.py", {}),
    "traker": (".venv-peers", "worker_trak.py", {}),
    "dattri": (".venv-peers", "worker_dattri.py", {}),
    "kronfluence": (".venv-kronfluence", "worker_kronfluence.py", {}),
}
# bergson formats prompt/completion rows with the tokenizer's chat template. For every tool to see
# the same tokens (the prompt's then the completion's, loss on the completion), the benchmark's
# model directory carries a template that only concatenates the two.
CONCAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SHAPES = {"tiny": None,  # the tiny GPT-2 fixture: 2 layers, 4 heads, d_model 64
          "small": {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_inner": 1024}}


def venv_python(venv: str) -> Path:
    return Path(sys.executable) if venv == ".venv" else ROOT / venv / "bin" / "python"


# -- data and model ----------------------------------------------------------------------------
def base_model_dir(shape: str, work: Path) -> str:
    """The base model to fine-tune: the fixture, or a GPT-2 of another shape with the fixture's tokenizer."""
    if SHAPES[shape] is None:
        return "builtin:tiny-gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32")).tokenizer
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=256, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **SHAPES[shape])
    out = work / f"base_{shape}"
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def prepare(work: Path, shape: str, n_entities: int, epochs: int) -> dict[str, Any]:
    """Corpus files and the fine-tuned model dir (with the concatenating chat template)."""
    corpus = make_corpus(n_entities, seed=0)
    docs = write_jsonl(work / "docs.jsonl", corpus.docs)
    queries = {style: str(write_jsonl(work / f"queries_{style}.jsonl", rows))
               for style, rows in corpus.queries.items()}
    base = ModelConfig(name=base_model_dir(shape, work), precision="float32")
    model_dir = work / "model"
    loaded, info = fine_tuned_model(base, docs, model_dir, epochs=epochs, seed=0)
    loaded.tokenizer.chat_template = CONCAT_TEMPLATE
    loaded.tokenizer.save_pretrained(model_dir)
    modules = [name for name, _ in select_modules(loaded.model, loaded.adapter, None)]
    cfg = loaded.model.config
    return {"model_dir": str(model_dir), "docs": str(docs), "queries": queries, "modules": modules,
            "targets": corpus.targets, "n_docs": len(corpus.docs), "n_queries": corpus.n_facts,
            "fine_tune": info, "shape": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "d_model": cfg.n_embd,
                                         "vocab": cfg.vocab_size}}


THROUGHPUT = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "n_positions": 1024}
THROUGHPUT_PROMPT, THROUGHPUT_COMPLETION, THROUGHPUT_DIM = 48, 16, 324  # tokens; 18 x 18 per module


def prepare_throughput(work: Path, n_rows: int) -> dict[str, Any]:
    """DESIGN.md's indexing scale: a GPT-2-small-shaped model (random weights, float32), rows of
    about 64 tokens of which the last 16 are the completion, the 12 MLP output projections."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from circuitkit.fixtures.models import synthetic_corpus

    tokenizer = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32")).tokenizer
    tokenizer.chat_template = CONCAT_TEMPLATE
    tokenizer.model_max_length = THROUGHPUT["n_positions"]
    torch.manual_seed(0)
    model_dir = work / "gpt2_small_shape"
    GPT2LMHeadModel(GPT2Config(**THROUGHPUT)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sentences = iter(synthetic_corpus(n_sentences=40 * n_rows, seed=7))
    rows = []
    for _ in range(n_rows):
        ids: list[int] = []
        while len(ids) < THROUGHPUT_PROMPT + THROUGHPUT_COMPLETION:
            ids += tokenizer(" " + next(sentences), add_special_tokens=False)["input_ids"]
        rows.append({"prompt": tokenizer.decode(ids[:THROUGHPUT_PROMPT]),
                     "completion": tokenizer.decode(ids[THROUGHPUT_PROMPT:THROUGHPUT_PROMPT + THROUGHPUT_COMPLETION])})
    docs = write_jsonl(work / "throughput_rows.jsonl", rows)
    queries = {"full": str(write_jsonl(work / "throughput_queries.jsonl", rows[:4]))}
    modules = [f"transformer.h.{layer}.mlp.c_proj" for layer in range(THROUGHPUT["n_layer"])]
    return {"model_dir": str(model_dir), "docs": str(docs), "queries": queries, "modules": modules,
            "n_docs": n_rows}


# The model dtypes of the throughput workload.
THROUGHPUT_DTYPES = ("float32", "bfloat16")


def run_throughput(work: Path, tools: list[str], n_rows: int, batch_size: int, timeout: float,
                   console: Console) -> list[dict[str, Any]]:
    """Examples/s and peak of each tool on the throughput workload, per model dtype (no recall)."""
    data = prepare_throughput(work, n_rows)
    rows = []
    for precision in THROUGHPUT_DTYPES:
        for tool in tools:
            tool_work = work / f"throughput_{tool}_{precision}"
            tool_work.mkdir(parents=True, exist_ok=True)
            spec = {k: data[k] for k in ("model_dir", "docs", "queries", "modules")}
            spec.update(per_module_dim=THROUGHPUT_DIM, total_dim=THROUGHPUT_DIM * len(data["modules"]),
                        batch_size=batch_size, max_length=256, seed=0, work_dir=str(tool_work), precision=precision,
                        floor=tool == "gradian")
            console.print(f"[dim]throughput: {tool}, {precision}...[/dim]")
            result = run_worker(tool, spec, tool_work, timeout)
            if result.get("error"):
                rows.append({"tool": tool, "precision": precision, "error": result["error"]})
                continue
            keep = ("tool", "version", "method", "n_rows", "row_width", "bytes_per_row", "cold_seconds",
                    "index_seconds", "index_peak_bytes", "notes")
            rows.append({k: result.get(k) for k in keep}
                        | {"precision": precision, "examples_per_s": result["n_rows"] / result["index_seconds"]})
            for key, name in (("floor_seconds", "floor: fwd+bwd, full logits"),
                              ("floor_supervised_seconds", "floor: fwd+bwd, supervised logits")):
                if key in result:
                    rows.append({"tool": name, "precision": precision, "n_rows": result["n_rows"],
                                 "index_seconds": result[key], "examples_per_s": result["n_rows"] / result[key]})
    return rows


def print_throughput_table(rows: list[dict[str, Any]], n_rows: int, console: Console) -> None:
    table = Table(title=f"indexing throughput: GPT-2-small shape (random weights), {n_rows} rows of ~64 tokens"
                        f" ({THROUGHPUT_COMPLETION} supervised), 12 x mlp.c_proj, 18 x 18 per module")
    for col in ("tool", "model dtype", "examples/s", "gradian speed-up", "peak MiB", "bytes/row", "timed s", "cold s"):
        table.add_column(col, justify="left" if col in ("tool", "model dtype") else "right")
    for r in rows:
        if r.get("error"):
            table.add_row(r["tool"], r["precision"], "-", "-", "-", "-", "-", f"[red]cannot run: {r['error']}[/red]")
            continue
        ours = next((o for o in rows if o["tool"] == "gradian" and o["precision"] == r["precision"]
                     and not o.get("error")), None)
        speedup = f"{ours['examples_per_s'] / r['examples_per_s']:.2f}x" if ours else "-"
        floor = r["tool"].startswith("floor")
        table.add_row(r["tool"], r["precision"], f"{r['examples_per_s']:.2f}", speedup,
                      "-" if floor else f"{r['index_peak_bytes'] / 2**20:.0f}",
                      "-" if floor else f"{r['bytes_per_row']:.0f}", f"{r['index_seconds']:.1f}",
                      "-" if floor else f"{r['cold_seconds'] or 0:.1f}")
    console.print(table)


# -- running the workers -----------------------------------------------------------------------
def run_worker(tool: str, spec: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """One tool's worker in its own venv; a dict with `error` when it cannot run."""
    venv, script, own = TOOLS[tool]
    python = venv_python(venv)
    if not python.exists():
        return {"tool": tool, "error": f"{venv} does not exist: run `make peers` first"}
    spec_path, out_path = work / f"spec_{tool}.json", work / f"result_{tool}.json"
    spec_path.write_text(json.dumps(spec | own))
    out_path.unlink(missing_ok=True)
    cmd = [str(python), str(PEERS / script), "--spec", str(spec_path), "--out", str(out_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                   "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"})
    except subprocess.TimeoutExpired:
        return {"tool": tool, "error": f"timed out after {timeout:.0f} s"}
    if not out_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"tool": tool, "error": f"worker exited {proc.returncode} without a result: {' | '.join(tail)}"}
    result = json.loads(out_path.read_text())
    result["tool"] = tool
    return result


def target_ranks(scores: list[list[float]], targets: list[int]) -> list[int]:
    """1-based rank of each query's target document (ties count in the target's favour)."""
    return [1 + sum(s > row[t] for s in row) for row, t in zip(scores, targets, strict=True)]


# Scorings a worker may add beside its own ("scores"), reported as rows of their own.
EXTRA_SCORINGS = {"scores_cosine": "cosine of the same stored rows", "scores_efim": "eFIM-preconditioned"}


def summarize(runs: list[dict[str, Any]], targets: list[int], key: str = "scores") -> dict[str, Any]:
    """One tool at one dim: timing of the first seed's run, recall and MRR averaged over the seeds.

    key: which score matrices to rank ("scores", the tool's own, or one of EXTRA_SCORINGS).
    """
    ok = [r for r in runs if not r.get("error")]
    if not ok:
        return {"tool": runs[0]["tool"], "error": runs[0]["error"]}
    first = ok[0]
    out = {k: first.get(k) for k in ("tool", "version", "method", "scoring", "n_rows", "row_width", "bytes_per_row",
                                     "cold_seconds", "index_seconds", "index_peak_bytes", "query_seconds")}
    if key != "scores":
        out["tool"], out["scoring"] = f"{first['tool']} ({key.removeprefix('scores_')})", EXTRA_SCORINGS[key]
    out["examples_per_s"] = first["n_rows"] / first["index_seconds"]
    out["notes"] = first.get("notes", [])
    out["seeds"] = len(ok)
    for style in first[key]:
        per_seed = [metrics(target_ranks(r[key][style], targets)) for r in ok]
        for name in ("recall@10", "mrr"):
            values = [m[name] for m in per_seed]
            out[f"{style}_{name}"] = statistics.mean(values)
            out[f"{style}_{name}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


def run_indexing(data: dict[str, Any], work: Path, tools: list[str], dims: list[int], seeds: int,
                 batch_size: int, timeout: float, console: Console) -> list[dict[str, Any]]:
    rows = []
    for dim in dims:
        for tool in tools:
            runs = []
            for seed in range(seeds):
                tool_work = work / f"{tool}_{dim}_{seed}"
                tool_work.mkdir(parents=True, exist_ok=True)
                spec = {k: data[k] for k in ("model_dir", "docs", "queries", "modules")}
                spec.update(per_module_dim=dim, total_dim=dim * len(data["modules"]), batch_size=batch_size,
                            max_length=256, seed=seed, work_dir=str(tool_work))
                console.print(f"[dim]{tool}, {dim} per module, seed {seed}...[/dim]")
                runs.append(run_worker(tool, spec, tool_work, timeout))
                if runs[-1].get("error"):
                    break  # the same error on every seed
            rows.append({"per_module_dim": dim, **summarize(runs, data["targets"])})
            rows += [{"per_module_dim": dim, **summarize(runs, data["targets"], key)}
                     for key in EXTRA_SCORINGS if not runs[0].get("error") and key in runs[0]]
    return rows


# -- report ------------------------------------------------------------------------------------
def print_indexing_table(report: dict[str, Any], console: Console) -> None:
    for dim in report["dims"]:
        rows = [r for r in report["indexing"] if r["per_module_dim"] == dim]
        ours = next((r for r in rows if r["tool"] == "gradian" and not r.get("error")), None)
        table = Table(title=f"gradient indexing, {report['data']['n_docs']} docs, {dim} per module"
                            f" ({report['data']['n_modules']} modules), recall/MRR mean of {report['seeds']} seeds")
        for col in ("tool", "examples/s", "gradian speed-up", "peak MiB", "bytes/row", "R@10 full", "MRR full",
                    "R@10 short", "MRR short", "scoring"):
            table.add_column(col, justify="left" if col in ("tool", "scoring") else "right")
        for r in rows:
            if r.get("error"):
                table.add_row(r["tool"], "-", "-", "-", "-", "-", "-", "-", "-", f"[red]cannot run: {r['error']}[/red]")
                continue
            speedup = f"{ours['examples_per_s'] / r['examples_per_s']:.2f}x" if ours else "-"
            table.add_row(r["tool"], f"{r['examples_per_s']:.1f}", speedup, f"{r['index_peak_bytes'] / 2**20:.0f}",
                          f"{r['bytes_per_row']:.0f}", f"{r['full_recall@10']:.3f}", f"{r['full_mrr']:.3f}",
                          f"{r['short_recall@10']:.3f}", f"{r['short_mrr']:.3f}", r.get("scoring", ""))
        console.print(table)
    console.print(f"chance: recall@10 {10 / report['data']['n_docs']:.3f}, MRR ~{report['chance_mrr']:.3f}")


def chance_mrr(n: int) -> float:
    return sum(1 / k for k in range(1, n + 1)) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="12 entities, 1 seed, gradian and bergson only, no throughput workload")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--entities", type=int, default=40)
    p.add_argument("--epochs", type=int, default=5, help="fine-tuning epochs (5: learnt, not memorised)")
    p.add_argument("--seeds", type=int, default=5, help="projection seeds per tool (recall is averaged)")
    p.add_argument("--dims", default="256", help="per-module projection widths, comma-separated squares")
    # kronfluence (EK-FAC, no projection: one run whatever --dims and --seeds) runs in
    # bench_yardsticks.py --peers kronfluence; named here it runs like the others.
    p.add_argument("--tools", default=",".join(t for t in TOOLS if t != "kronfluence"),
                   help=f"subset of {','.join(TOOLS)}")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker run")
    p.add_argument("--no-circuit", action="store_true", help="skip CircuitKit vs auto-circuit")
    p.add_argument("--throughput-rows", type=int, default=48,
                   help="rows of the GPT-2-small-shape throughput workload (0 skips it)")
    p.add_argument("--throughput-tools", default="gradian,bergson,dattri",
                   help="tools on the throughput workload (TRAK's CPU projector is out of reach at this size)")
    p.add_argument("--work", type=Path, default=None, help="keep the work files here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)  # the float32 notice
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        p.error(f"--tools: unknown {unknown}; valid: {', '.join(TOOLS)}")
    if args.quick:
        args.entities, args.seeds, args.throughput_rows = 12, 1, 0
        tools = [t for t in tools if t in ("gradian", "bergson")]
    dims = [int(d) for d in args.dims.split(",")]
    console = Console(width=160)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare(work, args.shape, args.entities, args.epochs)
        report: dict[str, Any] = {
            "date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()},"
            f" {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "dims": dims, "seeds": args.seeds, "chance_mrr": chance_mrr(data["n_docs"]),
            "data": {k: data[k] for k in ("n_docs", "n_queries", "fine_tune", "shape")}
            | {"n_modules": len(data["modules"]), "epochs": args.epochs},
        }
        report["indexing"] = run_indexing(data, work, tools, dims, args.seeds, args.batch_size, args.timeout,
                                          console)
        print_indexing_table(report, console)
        if args.throughput_rows:
            chosen = [t.strip() for t in args.throughput_tools.split(",") if t.strip() in TOOLS]
            report["throughput"] = run_throughput(work / "throughput", chosen, args.throughput_rows,
                                                  args.batch_size, args.timeout, console)
            print_throughput_table(report["throughput"], args.throughput_rows, console)
        if not args.no_circuit:
            from scripts.peers.circuit_peers import print_circuit_table, run_circuit_peers

            report["circuit"] = run_circuit_peers(work / "circuit", console, quick=args.quick)
            print_circuit_table(report["circuit"], console)
    report["wall_s"] = time.perf_counter() - start
    console.print(f"{report['machine']}; wall time {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
