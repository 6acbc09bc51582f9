"""Benchmark: CircuitKit's EAP / EAP-IG against auto-circuit's, on the same weights, in one run.

Each (tool, algorithm, level) runs in a fresh process (ours in the project venv, auto-circuit's
in `.venv-autocircuit` through worker_autocircuit.py) that loads the model, runs one plain
forward (auto-circuit's worker: the logit check against the HF model; ours: a warm-up of the
same size), then one attribution measured by `peak.measured`: wall seconds and the peak
resident memory added above the process's size after loading (weights, data, libraries
excluded). A fresh process per measurement keeps allocator state from one run out of the next.

Scores are compared in CircuitKit's names: node scores (every head and MLP) and the edges both
graphs have, by Spearman and Pearson correlation and the max difference relative to our
largest score. Where the methods coincide and where they do not: see NOTES.

    python scripts/peers/circuit_peers.py [--quick] [--json out.json]
    python scripts/peers/circuit_peers.py ours MODEL_DIR TASK_FILE OUT_JSON --algorithm A --level L
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
AUTOCIRCUIT_PYTHON = REPO / ".venv-autocircuit" / "bin" / "python"
WORKER = HERE / "worker_autocircuit.py"
RUNS = (("eap", "node"), ("eap-ig", "node"), ("eap", "edge"), ("eap-ig", "edge"))
TIMEOUT_S = 3600

NOTES = {
    "eap": "coincide: both score Δ·∂m/∂(input) at the clean run with Δ = clean - corrupted activation "
           "(auto-circuit: the mask gradient at mask 0, resample ablation from the corrupted prompt), "
           "same sign, same mean over examples",
    "eap-ig": "differ by path: CircuitKit interpolates the input embeddings (corrupted -> clean, k/m for "
              "k = 1..m) and multiplies the mean gradient by the fixed Δ; auto-circuit interpolates every "
              "edge mask at once (clean -> corrupted, k/m for k = 0..m, m + 1 passes) and its factor is "
              "(activation at that point - corrupted activation), which vanishes at the corrupted end "
              "for every node but the embedding (so its scores are smaller). Both are path integrals of "
              "the metric change, over different paths",
    "node": "auto-circuit has node scores: its unfactorized (residual) graph, where the edge head -> next "
            "residual node carries the gradient at the head's output (same as ours); at edge level, "
            "its node scores here are the sums of outgoing edge scores",
    "edge": "same edges (embedding, heads, MLPs -> per-head Q/K/V inputs, MLP inputs, logits); "
            "auto-circuit's 'Resid Start' = our 'input', 'Resid End' = our 'logits'",
    "cost": "per batch, CircuitKit: 2 no-grad forwards + m forward+backward (logits at the answer "
            "position only); auto-circuit: 1 no-grad forward + 1 (EAP) or m + 1 (IG) forward+backward "
            "of a HookedTransformer that projects every position onto the vocabulary",
}


@dataclass(frozen=True)
class Setup:
    """The model shape and the workload."""

    n_layers: int
    n_heads: int
    d_model: int
    vocab: int
    n_pairs: int
    batch: int
    seq: int
    steps: int


FULL = Setup(n_layers=12, n_heads=12, d_model=768, vocab=50257, n_pairs=8, batch=4, seq=32, steps=5)
QUICK = Setup(n_layers=2, n_heads=4, d_model=64, vocab=512, n_pairs=8, batch=4, seq=16, steps=3)


# -- preparing the inputs -------------------------------------------------------------------

def prepare(work: Path, setup: Setup) -> tuple[Path, Path]:
    """A random-weight GPT-2 of `setup`'s shape (save_pretrained) and random pairs; their paths."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from circuitkit.discovery.tasks.base import random_pairs

    model_dir, task_file = work / "gpt2-random", work / "pairs.safetensors"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=setup.n_layers, n_head=setup.n_heads, n_embd=setup.d_model,
                        vocab_size=setup.vocab, n_positions=max(64, setup.seq), bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).eval().save_pretrained(model_dir)
    random_pairs(setup.n_pairs, setup.seq, setup.vocab).save(task_file)
    return model_dir, task_file


# -- running one measurement in a fresh process ---------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def run_process(cmd: list[str], out: Path, timeout_s: int = TIMEOUT_S) -> dict:
    """Run `cmd`, which writes a JSON result to `out`; on failure {"error": the exact error text}."""
    out.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout_s, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if proc.returncode != 0 or not out.is_file():
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": "\n".join(lines[-12:]) or f"exit status {proc.returncode}, no output"}
    return json.loads(out.read_text())


def measure(tool: str, model_dir: Path, task_file: Path, algorithm: str, level: str, setup: Setup,
            work: Path, repeats: int = 1) -> dict:
    """The fastest of `repeats` measurements of (tool, algorithm, level), each in a fresh process.

    The machine may be shared: the minimum wall time is the least disturbed one; all the
    times are kept (seconds_all), and the peak is the largest seen.
    """
    runs = [_measure_once(tool, model_dir, task_file, algorithm, level, setup, work) for _ in range(repeats)]
    done = [r for r in runs if not r.get("error")]
    if not done:
        return runs[0]
    best = min(done, key=lambda r: r["seconds"])
    seconds_all = [r["seconds"] for r in done]
    return {**best, "seconds_all": seconds_all, "peak_bytes": max(r["peak_bytes"] for r in done)}


def _measure_once(tool: str, model_dir: Path, task_file: Path, algorithm: str, level: str, setup: Setup,
                  work: Path) -> dict:
    out = work / f"{tool}-{algorithm}-{level}.json"
    args = [str(model_dir), str(task_file), str(out), "--algorithm", algorithm, "--level", level,
            "--steps", str(setup.steps), "--batch", str(setup.batch)]
    if tool == "circuitkit":
        cmd = [sys.executable, str(Path(__file__).resolve()), "ours", *args]
    elif not AUTOCIRCUIT_PYTHON.is_file():
        return {"error": f"{AUTOCIRCUIT_PYTHON} does not exist: build it with scripts/peers/setup_peers.sh"}
    else:
        cmd = [str(AUTOCIRCUIT_PYTHON), str(WORKER), *args]
    return run_process(cmd, out)


def ours_main(args: argparse.Namespace) -> None:
    """The `ours` subcommand: CircuitKit's attribute() measured in this (fresh) process."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import circuitkit
    from circuitkit.discovery.attribution.eap import attribute
    from circuitkit.discovery.tasks.base import TaskData
    from circuitkit.models.adapters import get_adapter

    sys.path.insert(0, str(HERE))
    from peak import measured

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.requires_grad_(False)
    adapter = get_adapter(model)
    data = TaskData.load(Path(args.task))
    with torch.no_grad():  # the same warm-up as the peer's logit check: one plain forward
        model(data.clean_ids[:args.batch])
    load_before = os.getloadavg()[0]
    with measured() as m:
        cpu0 = time.process_time()
        s = attribute(adapter, data, args.algorithm, args.level, metric="logit_diff", ig_steps=args.steps,
                      batch_size=args.batch, progress=False)
        cpu_seconds = time.process_time() - cpu0
    result = {
        "tool": "circuitkit", "algorithm": args.algorithm, "level": args.level, "seconds": m.seconds,
        "peak_bytes": m.peak_bytes, "cpu_seconds": cpu_seconds,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "grad_passes_per_batch": args.steps if args.algorithm == "eap-ig" else 1,
        "n_batches": -(-len(data) // args.batch), "threads": torch.get_num_threads(),
        "versions": {"circuitkit": circuitkit.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "head": s.head.tolist(), "mlp": s.mlp.tolist(),
    }
    if s.edges is not None:
        g, mask = s.graph, s.graph.edge_mask()
        result["edges"] = [(g.upstream[i], g.downstream[j], float(s.edges[i, j]))
                           for i, j in mask.nonzero().tolist()]
    Path(args.out).write_text(json.dumps(result))


# -- comparing scores -----------------------------------------------------------------------

def _node_vector(result: dict) -> list[float]:
    return [x for row in result["head"] for x in row] + list(result["mlp"])


def _correlate(a: list[float], b: list[float]) -> dict:
    from scipy.stats import pearsonr, spearmanr

    scale = max(abs(x) for x in a) or 1.0
    return {"spearman": float(spearmanr(a, b).statistic), "pearson": float(pearsonr(a, b).statistic),
            "max_rel_diff": max(abs(x - y) for x, y in zip(a, b, strict=True)) / scale}


def score_agreement(ours: dict, theirs: dict) -> dict:
    """Rank and value agreement of `theirs` with `ours`: node scores (heads + MLPs) and common edges.

    Each result is {"head": [[...]], "mlp": [...], "edges": [(up, down, score), ...] (optional)}.
    """
    nodes = _correlate(_node_vector(ours), _node_vector(theirs))
    out = {f"{k}_nodes": v for k, v in nodes.items()}
    if ours.get("edges") and theirs.get("edges"):
        mine = {(u, d): s for u, d, s in ours["edges"]}
        other = {(u, d): s for u, d, s in theirs["edges"]}
        common = sorted(mine.keys() & other.keys())
        edges = _correlate([mine[k] for k in common], [other[k] for k in common])
        out.update({f"{k}_edges": v for k, v in edges.items()})
        out.update(n_edges_compared=len(common), n_edges_only_ours=len(mine.keys() - other.keys()),
                   n_edges_only_theirs=len(other.keys() - mine.keys()))
    return out


def _row(result: dict, algorithm: str, level: str, agreement: dict | None = None) -> dict:
    """A table row: timing, memory and (auto-circuit rows) agreement with ours, or the error."""
    keys = ("seconds", "peak_bytes", "cpu_seconds", "seconds_all", "loadavg_1min", "grad_passes_per_batch",
            "error")
    row = {"tool": result.get("tool"), "method": algorithm, "level": level,
           **{k: result.get(k) for k in keys}}
    return {**row, **(agreement or {})}


def compare(tool_results: dict, algorithm: str, level: str) -> list[dict]:
    """Rows for ours and auto-circuit's run of (algorithm, level)."""
    ours, theirs = tool_results["circuitkit"], tool_results["auto-circuit"]
    ours.setdefault("tool", "circuitkit")
    theirs.setdefault("tool", "auto-circuit")
    agreement = None if ours.get("error") or theirs.get("error") else score_agreement(ours, theirs)
    return [_row(ours, algorithm, level), _row(theirs, algorithm, level, agreement)]


# -- the trained induction model: do both tools find its known heads? --------------------------

def _top_heads(head: list[list[float]], k: int = 2) -> list[str]:
    flat = [(abs(v), f"L{layer}H{h}") for layer, row in enumerate(head) for h, v in enumerate(row)]
    return [name for _, name in sorted(flat, reverse=True)[:k]]


def _edge_rank(edges: list, up: str, down: str) -> int:
    """1-based rank of edge (up, down) by |score|."""
    order = sorted(edges, key=lambda e: -abs(e[2]))
    return next(i for i, (u, d, _) in enumerate(order, start=1) if (u, d) == (up, down))


def induction_check(work: Path, console, steps: int = 5) -> dict:
    """Both tools on the trained induction fixture (32 pairs of 64 tokens, batch 16): top-2 heads
    by |score| (expected: the previous-token and induction heads) and the K-composition edge's rank."""
    from circuitkit.discovery.tasks import induction
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model

    work = work / "induction"
    work.mkdir(parents=True, exist_ok=True)
    lm = load_model(ModelConfig(name="builtin:induction", precision="float32"))
    info = json.loads((Path(lm.path) / "fixture_info.json").read_text())
    prev, ind = info["prev_token_head"][:2], info["induction_head"][:2]
    task_file = work / "induction.safetensors"
    induction.build(lm.tokenizer, lm.path, 32, 64, 0).save(task_file)
    setup = Setup(2, info["n_heads"], info["d_model"], 0, n_pairs=32, batch=16, seq=64, steps=steps)
    k_edge = (f"a{prev[0]}.h{prev[1]}", f"a{ind[0]}.g{ind[1]}<k>")  # GPT-2: one KV head per head
    out = {"expected_top2": sorted([f"L{prev[0]}H{prev[1]}", f"L{ind[0]}H{ind[1]}"]),
           "k_composition_edge": k_edge, "runs": []}
    for algorithm, level in RUNS:
        console.log(f"induction fixture: {algorithm} {level}")
        results = {tool: measure(tool, Path(lm.path), task_file, algorithm, level, setup, work)
                   for tool in ("circuitkit", "auto-circuit")}
        for tool, r in results.items():
            entry = {"tool": tool, "method": algorithm, "level": level, "error": r.get("error")}
            if not r.get("error"):
                entry["top2"] = sorted(_top_heads(r["head"]))
                if r.get("edges"):
                    entry["k_edge_rank"] = _edge_rank(r["edges"], *k_edge)
            out["runs"].append(entry)
        if not any(r.get("error") for r in results.values()):
            out["runs"][-1].update(score_agreement(results["circuitkit"], results["auto-circuit"]))
    return out


# -- the benchmark --------------------------------------------------------------------------

def run_circuit_peers(work: Path, console, *, quick: bool = False, induction: bool | None = None,
                      repeats: int = 1) -> dict:
    """Time, peak memory and score agreement of CircuitKit vs auto-circuit, EAP and EAP-IG, node and edge.

    quick: a 2-layer model for a test that runs in seconds; induction: also run both tools on
    the trained induction fixture (default: not quick); repeats: fresh-process runs per
    measurement, the fastest is kept. Returns {"setup", "rows", "notes", "targets", ...}.
    """
    import torch
    import transformers

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    model_dir, task_file = prepare(work, setup)
    rows = []
    versions = {"circuitkit-venv": {"torch": torch.__version__, "transformers": transformers.__version__}}
    for algorithm, level in RUNS:
        results = {}
        for tool in ("circuitkit", "auto-circuit"):
            console.log(f"{tool}: {algorithm} {level} "
                        f"({setup.n_layers} layers, batch {setup.batch} x {setup.seq})")
            results[tool] = measure(tool, model_dir, task_file, algorithm, level, setup, work, repeats)
        if "versions" in results["auto-circuit"]:
            versions["autocircuit-venv"] = results["auto-circuit"]["versions"]
        rows += compare(results, algorithm, level)
    result = {"setup": {**asdict(setup), "dtype": "float32", "threads": torch.get_num_threads(),
                        "repeats": repeats, "model": "GPT-2 shape, random weights (seed 0)",
                        "versions": versions},
              "rows": rows, "notes": NOTES}
    if induction if induction is not None else not quick:
        result["induction"] = induction_check(work, console, setup.steps)
    result["targets"] = targets(rows)
    result["total_seconds"] = time.perf_counter() - t0
    return result


def _pair(rows: list[dict], method: str, level: str) -> tuple[dict, dict]:
    found = {r["tool"]: r for r in rows if r["method"] == method and r["level"] == level}
    return found["circuitkit"], found["auto-circuit"]


def targets(rows: list[dict]) -> dict:
    """The targets: node-level eap-ig >= 3x faster with lower peak; EAP Spearman >= 0.95."""
    ours, theirs = _pair(rows, "eap-ig", "node")
    out = {}
    if not (ours["error"] or theirs["error"]):
        out["node_eap_ig_speedup"] = theirs["seconds"] / ours["seconds"]
        out["node_eap_ig_speedup_ok"] = out["node_eap_ig_speedup"] >= 3.0
        out["node_eap_ig_lower_peak_ok"] = ours["peak_bytes"] < theirs["peak_bytes"]
    for level in ("node", "edge"):
        theirs = _pair(rows, "eap", level)[1]
        for kind in ("nodes", "edges"):
            if theirs.get(f"spearman_{kind}") is not None:
                out[f"eap_{level}_spearman_{kind}_ok"] = theirs[f"spearman_{kind}"] >= 0.95
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(theirs, ours) -> str:
    return "-" if not (theirs and ours) else f"{theirs / ours:.1f}x"


def _pair_cell(a, b, spec: str) -> str:
    return f"{_fmt(a, spec)} / {_fmt(b, spec)}"


def print_circuit_table(result: dict, console) -> None:
    """Side-by-side table: seconds, peak MiB, ratios (auto-circuit / CircuitKit), score agreement."""
    from rich.table import Table

    s = result["setup"]
    table = Table(title=f"CircuitKit vs auto-circuit: {s['n_layers']} layers x {s['n_heads']} heads, "
                        f"d={s['d_model']}, {s['n_pairs']} pairs, batch {s['batch']} x {s['seq']} tokens, "
                        f"m={s['steps']}, {s['dtype']}, {s['threads']} threads")
    for col in ("method", "level", "wall s ours / a-c", "speed-up", "CPU-s speed-up", "peak MiB ours / a-c",
                "mem ratio", "Spearman nodes / edges", "Pearson nodes / edges", "max rel diff nodes / edges"):
        table.add_column(col, justify="right")
    errors = []
    mib = 2.0**-20
    for method, level in RUNS:
        ours, theirs = _pair(result["rows"], method, level)
        errors += [f"{r['tool']} {method} {level}: {r['error']}" for r in (ours, theirs) if r["error"]]
        table.add_row(
            method, level, _pair_cell(ours["seconds"], theirs["seconds"], ".2f"),
            _ratio(theirs["seconds"], ours["seconds"]), _ratio(theirs["cpu_seconds"], ours["cpu_seconds"]),
            _pair_cell(ours["peak_bytes"] and ours["peak_bytes"] * mib,
                       theirs["peak_bytes"] and theirs["peak_bytes"] * mib, ".0f"),
            _ratio(theirs["peak_bytes"], ours["peak_bytes"]),
            _pair_cell(theirs.get("spearman_nodes"), theirs.get("spearman_edges"), ".4f"),
            _pair_cell(theirs.get("pearson_nodes"), theirs.get("pearson_edges"), ".4f"),
            _pair_cell(theirs.get("max_rel_diff_nodes"), theirs.get("max_rel_diff_edges"), ".1e"))
    console.print(table)
    console.print("speed-up and mem ratio: auto-circuit / CircuitKit (> 1: CircuitKit faster / smaller); "
                  "agreement: auto-circuit's scores against ours, in our names")
    for line in errors:
        console.print(f"[red]error[/red] {line}")
    if "induction" in result:
        ind = result["induction"]
        console.print(f"induction fixture, expected top-2 heads {ind['expected_top2']}, "
                      f"K-composition edge {ind['k_composition_edge']}:")
        for r in ind["runs"]:
            found = r.get("error") or f"top-2 {r.get('top2')}" + (
                f", K-edge rank {r['k_edge_rank']}" if "k_edge_rank" in r else "")
            console.print(f"  {r['tool']:>12} {r['method']:>6} {r['level']}: {found}")
    console.print(f"targets: {result['targets']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    ours = sub.add_parser("ours", help="internal: one CircuitKit measurement in this process")
    for name in ("model", "task", "out"):
        ours.add_argument(name)
    ours.add_argument("--algorithm", choices=("eap", "eap-ig"), required=True)
    ours.add_argument("--level", choices=("node", "edge"), required=True)
    ours.add_argument("--steps", type=int, default=5)
    ours.add_argument("--batch", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh-process runs per measurement (the fastest is kept)")
    parser.add_argument("--work", default=str(REPO / ".cache" / "circuit-peers"))
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    if args.command == "ours":
        ours_main(args)
        return
    from rich.console import Console

    console = Console()
    result = run_circuit_peers(Path(args.work), console, quick=args.quick, repeats=args.repeats)
    print_circuit_table(result, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
