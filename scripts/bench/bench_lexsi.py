"""Benchmark: CircuitKit against Lexsi Labs' CircuitKIT 0.2.0, node-level EAP / EAP-IG, in one run.

Two models: the GPT-2-small shape of conf/model/gpt2.yaml with random weights (seed 0) and
SmolLM2-135M-Instruct (`circuitkit fetch smollm2`). One task file: IOI pairs built once with
SmolLM2's tokenizer (the random GPT-2 carries the same tokenizer), so both tools and both models
score the exact same token ids. float32, the same batch and IG steps for both tools.

Each measurement runs in a fresh process: ours through `scripts/peers/circuit_peers.py ours`
(the project venv), Lexsi's through `scripts/peers/worker_lexsi.py` (`.venv-lexsi`, `make peers`);
runs alternate between the tools, the fastest of --repeats is kept. Measured per tool: wall
seconds and CPU seconds of the attribution alone, and the resident memory it adds above the
loaded process (scripts/peers/peak.py, the same for both). Every process gets --threads torch
threads (OMP_NUM_THREADS, default 1): on a shared 2-core machine two spinning OpenMP threads
made one GPT-2-small forward 10x slower (4 s against 0.4 s with one thread).

Faithfulness, at the same head counts (--percents of the heads, MIB's int(share * n)):
  * each tool's own figure: ours, the pruning stage's Evaluator (pruning.ablation=corrupted, the
    default: the heads outside the set take their corrupted-run value; F = (m(S) - m(no head)) /
    (m(all) - m(no head))); Lexsi's, its Pillar 1 (causal patching, baseline the corrupted run,
    clipped to [0, 1]) of its k best heads, and its `ck.faithfulness` default (sparsity 0.3).
  * one neutral judge for both (scripts/peers/neutral_heads.py: plain PyTorch forward pre-hooks on
    the HF model's attention output projections, neither tool's code) of each tool's top-k heads
    by |score| on the same pairs.
And the memory guide's claims, on Lexsi's own code (--guide): EAP-IG at ig_steps 3 vs 5 and
batch 1 vs 4, time and peak.

    python scripts/bench/bench_lexsi.py [--models gpt2-small,smollm2] [--pairs 16] [--batch 4] [--steps 5]
                                        [--repeats 3] [--smollm2-repeats 1] [--percents 5,10,20,50]
                                        [--guide gpt2-small] [--threads 1] [--smollm2 DIR] [--work DIR]
                                        [--resume] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "scripts" / "peers"

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.peers.circuit_peers import run_process  # noqa: E402
from scripts.peers.neutral_heads import NeutralJudge, Pairs, load_model, top_heads  # noqa: E402

LEXSI_PYTHON = ROOT / ".venv-lexsi" / "bin" / "python"
SMOLLM2 = Path.home() / ".cache" / "circuitkit" / "models" / "smollm2-135m-instruct"
ALGORITHMS = ("eap", "eap-ig")
GUIDE = ((3, 4), (5, 4), (5, 1))  # (ig_steps, batch) of Lexsi's memory-guide claims
CLAIMS = {"steps": "ig_steps=3 is ~40% faster and ~30% less memory than ig_steps=5",
          "batch": "batch_size=1 is ~50-60% less peak memory than batch_size=4; ~50% slower"}


# -- inputs ---------------------------------------------------------------------------------

def gpt2_small_dir(work: Path, tokenizer_dir: Path) -> Path:
    """conf/model/gpt2.yaml's shape, random weights (seed 0), with SmolLM2's tokenizer (its ids < the vocab)."""
    import torch
    import yaml
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = work / "gpt2-small-random"
    if (out / "model.safetensors").is_file():
        return out
    shape = yaml.safe_load((ROOT / "conf" / "model" / "gpt2.yaml").read_text())["shape"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=shape["n_layers"], n_head=shape["n_heads"], n_embd=shape["d_model"],
                        n_inner=shape["d_mlp"], vocab_size=shape["vocab_size"], n_positions=1024,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ioi_pairs(work: Path, tokenizer_dir: Path, n_pairs: int, seed: int = 0) -> Path:
    """IOI pairs (CircuitKit's task, default s2 corruption) as a TaskData file both tools read."""
    from transformers import AutoTokenizer

    from circuitkit.discovery.tasks import ioi

    out = work / f"ioi-{n_pairs}-seed{seed}.safetensors"
    ioi.build(AutoTokenizer.from_pretrained(tokenizer_dir), n_pairs, seed).save(out)
    return out


# -- one measurement in a fresh process -----------------------------------------------------

def measure_once(tool: str, model_dir: Path, task: Path, algorithm: str, steps: int, batch: int, work: Path,
                 repeat: int = 0, lexsi_extra: list[str] | None = None, resume: bool = False) -> dict:
    """One attribution by `tool` ("circuitkit" or "lexsi") in a fresh process; its JSON or {"error"}.

    resume: reuse the result file of this very run (tool, model, pairs, algorithm, steps, batch,
    repeat) when an earlier, interrupted benchmark left one (workers write it only on success).
    """
    out = work / f"{tool}-{model_dir.name}-{task.stem}-{algorithm}-m{steps}-b{batch}-r{repeat}.json"
    if resume and out.is_file():
        return json.loads(out.read_text())
    args = [str(model_dir), str(task), str(out), "--algorithm", algorithm, "--level", "node",
            "--steps", str(steps), "--batch", str(batch)]
    if tool == "circuitkit":
        return run_process([sys.executable, str(PEERS / "circuit_peers.py"), "ours", *args], out)
    if not LEXSI_PYTHON.is_file():
        return {"error": f"{LEXSI_PYTHON} does not exist: build it with `PEERS=lexsi make peers`"}
    return run_process([str(LEXSI_PYTHON), str(PEERS / "worker_lexsi.py"), *args, *(lexsi_extra or ["--no-faithfulness"])],
                       out)


def best_of(runs: list[dict]) -> dict:
    """The fastest run (its scores and faithfulness from the first), every time kept, the largest peak;
    the errors of failed runs under "failed"."""
    done = [r for r in runs if not r.get("error")]
    failed = [r["error"] for r in runs if r.get("error")]
    if not done:
        return runs[0]
    best = min(done, key=lambda r: r["seconds"])
    return {**done[0], "seconds": best["seconds"], "cpu_seconds": min(r["cpu_seconds"] for r in done),
            "seconds_all": [r["seconds"] for r in done], "cpu_seconds_all": [r["cpu_seconds"] for r in done],
            "peak_bytes": max(r["peak_bytes"] for r in done), "peak_bytes_all": [r["peak_bytes"] for r in done],
            "loadavg_all": [r.get("loadavg_1min") for r in done], "failed": failed}


# -- faithfulness ----------------------------------------------------------------------------

def head_counts(n_heads: int, percents: list[float]) -> list[int]:
    """Heads kept at each percent: int(share * n), as MIB's and our pruning curve count them."""
    return sorted({max(1, int(p / 100 * n_heads + 1e-9)) for p in percents})


def faithfulness_rows(model_dir: Path, task: Path, results: dict, sizes: list[int], batch: int) -> dict:
    """Ours' own, Lexsi's own and the neutral judge's faithfulness at each size, per algorithm."""
    import torch

    from circuitkit.discovery.pruning.heads import Evaluator, faithfulness
    from circuitkit.discovery.tasks.base import TaskData
    from circuitkit.models.adapters import get_adapter

    model = load_model(model_dir)
    judge = NeutralJudge(model, Pairs.load(task), batch_size=batch)
    ours_eval = Evaluator(get_adapter(model), TaskData.load(task), "logit_diff", "corrupted", None, batch)
    shape = (judge.n_layers, judge.n_heads)
    ours_full, ours_empty = ours_eval(None), ours_eval(torch.zeros(shape, dtype=torch.bool))
    out = {"neutral_baselines": {"m_all": judge.m_all, "m_none": judge.m_none, "m_corrupted": judge.m_corrupted},
           "ours_baselines": {"m_full": ours_full, "m_empty": ours_empty}, "rows": []}
    for algorithm in ALGORITHMS:
        ours, lexsi = results[algorithm]["circuitkit"], results[algorithm]["lexsi"]
        for k in sizes:
            row: dict[str, Any] = {"algorithm": algorithm, "n_heads": k, "share": k / judge.n_heads / judge.n_layers}
            sets = {}
            for tool, r in (("circuitkit", ours), ("lexsi", lexsi)):
                if r.get("error"):
                    continue
                sets[tool] = top_heads(r["head"], k)
                row[f"neutral_{tool}"] = judge.faithfulness(sets[tool])
            if "circuitkit" in sets:
                row["own_circuitkit"] = faithfulness(ours_eval(sets["circuitkit"]), ours_full, ours_empty)
            own = (lexsi.get("faithfulness") or {}).get("by_size", {}).get(str(k))
            if own:
                row["own_lexsi"] = own["patching"]["score"]
                row["own_lexsi_raw"] = own["patching"]["raw_ratio"]
                row["own_lexsi_n_heads"] = own["n_heads_kept"]
            if len(sets) == 2:
                row["shared_heads"] = int((sets["circuitkit"] & sets["lexsi"]).sum())
            out["rows"].append(row)
    return out


def head_spearman(a: list[list[float]], b: list[list[float]]) -> float:
    from scipy.stats import spearmanr

    flat = [[x for row in m for x in row] for m in (a, b)]
    return float(spearmanr(*flat).statistic)


# -- the benchmark --------------------------------------------------------------------------

def run_model(name: str, model_dir: Path, task: Path, args: argparse.Namespace, repeats: int, work: Path,
              log) -> dict:
    """Both tools, both algorithms, `repeats` alternating fresh-process runs; faithfulness; the guide."""
    config = json.loads((model_dir / "config.json").read_text())
    n_layers = config.get("n_layer", config.get("num_hidden_layers"))
    n_heads = config.get("n_head", config.get("num_attention_heads"))
    sizes = head_counts(n_layers * n_heads, args.percents)
    results: dict[str, dict] = {}
    for algorithm in ALGORITHMS:
        runs: dict[str, list] = {"circuitkit": [], "lexsi": []}
        for r in range(repeats):
            for tool in ("circuitkit", "lexsi"):
                extra = ["--sizes", ",".join(map(str, sizes))] if tool == "lexsi" and r == 0 else None
                log(f"{name}: {tool} {algorithm} (run {r + 1}/{repeats})")
                runs[tool].append(measure_once(tool, model_dir, task, algorithm, args.steps, args.batch, work, r,
                                               extra, args.resume))
        results[algorithm] = {tool: best_of(rs) for tool, rs in runs.items()}
    log(f"{name}: faithfulness at {sizes} heads")
    faith = faithfulness_rows(model_dir, task, results, sizes, args.batch)
    out = {"model_dir": str(model_dir), "n_layers": n_layers, "n_heads": n_heads, "sizes": sizes, "repeats": repeats,
           "faithfulness": faith, "timing": []}
    for algorithm in ALGORITHMS:
        ours, lexsi = results[algorithm]["circuitkit"], results[algorithm]["lexsi"]
        row = {"algorithm": algorithm, "circuitkit": _keep(ours), "lexsi": _keep(lexsi)}
        if not (ours.get("error") or lexsi.get("error")):
            row.update(speedup=lexsi["seconds"] / ours["seconds"], cpu_speedup=lexsi["cpu_seconds"] / ours["cpu_seconds"],
                       peak_ratio=lexsi["peak_bytes"] / max(ours["peak_bytes"], 1),
                       head_spearman=head_spearman(ours["head"], lexsi["head"]),
                       lexsi_default_faithfulness={k: lexsi.get("faithfulness", {}).get(k, {}).get("score")
                                                   for k in ("patching", "ablation")},
                       lexsi_faithfulness_seconds=lexsi.get("faithfulness", {}).get("seconds"))
        out["timing"].append(row)
    if name in args.guide:
        out["guide"] = guide(model_dir, task, repeats, results["eap-ig"]["lexsi"], args, work, log)
    return out


def _keep(r: dict) -> dict:
    keys = ("seconds", "cpu_seconds", "peak_bytes", "seconds_all", "cpu_seconds_all", "peak_bytes_all",
            "loadavg_all", "threads", "versions", "token_path", "max_logit_diff_vs_hf", "n_batches", "error", "failed")
    return {k: r[k] for k in keys if k in r}


def guide(model_dir: Path, task: Path, repeats: int, main_run: dict, args: argparse.Namespace, work: Path,
          log) -> list[dict]:
    """Lexsi's EAP-IG at the memory guide's settings (ig_steps, batch); (steps, batch) of the main run reused."""
    rows = []
    for steps, batch in GUIDE:
        if (steps, batch) == (args.steps, args.batch):
            result = main_run
        else:
            runs = []
            for r in range(repeats):
                log(f"guide: lexsi eap-ig ig_steps={steps} batch={batch} (run {r + 1}/{repeats})")
                runs.append(measure_once("lexsi", model_dir, task, "eap-ig", steps, batch, work, r,
                                         resume=args.resume))
            result = best_of(runs)
        rows.append({"ig_steps": steps, "batch": batch, **_keep(result)})
    return rows


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "date": datetime.now().isoformat(timespec="minutes"),
            "loadavg_start": os.getloadavg()}


def targets(models: dict) -> dict:
    """The goal per model and algorithm: >= 5x faster, peak at or below Lexsi's, neutral F >= Lexsi's."""
    out = {}
    for name, m in models.items():
        for row in m["timing"]:
            if "speedup" not in row:
                continue
            key = f"{name}/{row['algorithm']}"
            faith = [f for f in m["faithfulness"]["rows"] if f["algorithm"] == row["algorithm"]]
            out[key] = {"speedup_5x": row["speedup"] >= 5.0, "peak_at_or_below": row["peak_ratio"] >= 1.0,
                        "neutral_at_least": all(f.get("neutral_circuitkit", float("nan")) >= f.get("neutral_lexsi", float("inf"))
                                                for f in faith)}
    return out


def print_tables(report: dict, console) -> None:
    """Timing, faithfulness and guide tables (rich)."""
    from rich.table import Table

    mib = 2.0**-20
    s = report["setup"]
    for name, m in report["models"].items():
        t = Table(title=f"{name}: {m['n_layers']} layers x {m['n_heads']} heads, IOI {s['pairs']} pairs, batch "
                        f"{s['batch']}, m={s['steps']}, float32, min of {m['repeats']}")
        for col in ("method", "wall s ours / Lexsi", "speed-up", "CPU s ours / Lexsi", "CPU speed-up",
                    "peak MiB ours / Lexsi", "peak ratio", "head Spearman", "Lexsi own F (0.3): patch / zero"):
            t.add_column(col, justify="right")
        for row in m["timing"]:
            o, x = row["circuitkit"], row["lexsi"]
            if "speedup" not in row:
                t.add_row(row["algorithm"], o.get("error") or x.get("error") or "?", *["-"] * 7)
                continue
            d = row["lexsi_default_faithfulness"]
            t.add_row(row["algorithm"], f"{o['seconds']:.2f} / {x['seconds']:.2f}", f"{row['speedup']:.1f}x",
                      f"{o['cpu_seconds']:.2f} / {x['cpu_seconds']:.2f}", f"{row['cpu_speedup']:.1f}x",
                      f"{o['peak_bytes'] * mib:.0f} / {x['peak_bytes'] * mib:.0f}", f"{row['peak_ratio']:.1f}x",
                      f"{row['head_spearman']:.3f}", f"{_f(d['patching'])} / {_f(d['ablation'])}")
        console.print(t)
        f = m["faithfulness"]
        t = Table(title=f"{name}: faithfulness of each tool's top-k heads (neutral: m_all {f['neutral_baselines']['m_all']:.3f}, "
                        f"m_none {f['neutral_baselines']['m_none']:.3f}, m_corrupted {f['neutral_baselines']['m_corrupted']:.3f})")
        for col in ("method", "heads", "neutral ours", "neutral Lexsi", "ours own", "Lexsi own (raw)", "shared heads"):
            t.add_column(col, justify="right")
        for r in f["rows"]:
            t.add_row(r["algorithm"], str(r["n_heads"]), _f(r.get("neutral_circuitkit")), _f(r.get("neutral_lexsi")),
                      _f(r.get("own_circuitkit")), f"{_f(r.get('own_lexsi'))} ({_f(r.get('own_lexsi_raw'))})",
                      str(r.get("shared_heads", "-")))
        console.print(t)
        if "guide" in m:
            t = Table(title=f"{name}: Lexsi EAP-IG at the memory guide's settings")
            for col in ("ig_steps", "batch", "wall s", "CPU s", "peak MiB"):
                t.add_column(col, justify="right")
            for g in m["guide"]:
                t.add_row(str(g["ig_steps"]), str(g["batch"]), _f(g.get("seconds"), ".2f"), _f(g.get("cpu_seconds"), ".2f"),
                          _f(g.get("peak_bytes") and g["peak_bytes"] * mib, ".0f") if not g.get("error") else g["error"])
            console.print(t)
            console.print(f"claims: {CLAIMS['steps']}; {CLAIMS['batch']}")
    console.print(f"targets: {report['targets']}")


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-small,smollm2")
    p.add_argument("--smollm2", type=Path, default=SMOLLM2, help="SmolLM2-135M-Instruct directory (its tokenizer too)")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="fresh-process runs per measurement (fastest kept)")
    p.add_argument("--smollm2-repeats", type=int, default=None, help="repeats for SmolLM2 (default --repeats)")
    p.add_argument("--percents", type=lambda v: [float(x) for x in v.split(",")], default=[5, 10, 20, 50])
    p.add_argument("--guide", default="gpt2-small", help="models on which to check the memory guide ('' none)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of every process")
    p.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-lexsi")
    p.add_argument("--resume", action="store_true",
                   help="reuse the result files an interrupted run left in --work (each fresh-process run is one file)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.guide = [g for g in args.guide.split(",") if g]
    if args.pairs % args.batch:
        p.error(f"--pairs {args.pairs} must be a multiple of --batch {args.batch} (Lexsi weights a short batch more)")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # inherited by every worker process
        os.environ[name] = str(args.threads)
    import torch
    from rich.console import Console

    torch.set_num_threads(args.threads)
    console = Console(width=180)
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(), "setup": {"pairs": args.pairs, "batch": args.batch, "steps": args.steps,
                                                              "percents": args.percents, "dtype": "float32", "task": "ioi",
                                                              "threads": args.threads},
                              "models": {}}
    task = ioi_pairs(args.work, args.smollm2, args.pairs)
    dirs = {"gpt2-small": lambda: gpt2_small_dir(args.work, args.smollm2), "smollm2": lambda: args.smollm2}
    for name in [m for m in args.models.split(",") if m]:
        repeats = args.smollm2_repeats if name == "smollm2" and args.smollm2_repeats else args.repeats
        report["models"][name] = run_model(name, dirs[name](), task, args, repeats, args.work, console.log)
        report["targets"] = targets(report["models"])
        if args.json:  # after each model: a later interruption keeps what is done
            args.json.write_text(json.dumps(report, indent=2))
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - start
    print_tables(report, console)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
