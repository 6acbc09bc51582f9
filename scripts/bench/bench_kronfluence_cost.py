"""Benchmark: Gradian at its defaults against Kronfluence's EK-FAC on cost, in one run.

Same model (a real-model yardstick's fine-tuned SmolLM2: ``S`` or ``S2`` of bench_yardsticks.py,
cached), same documents, queries and modules (the 4 trained MLP down projections), same machine
and thread count, each tool in a process of its own, one after the other:

* Gradian: `build_index` at the product's defaults (grads.projection=kronecker_orthogonal, width
  per module --width, loss margin, preconditioner kfac, fisher empirical, float16 rows), which
  writes the rows and the curvature file; then `gradian.rank.ranking.rank` (score auto = ekfac, damping
  gradian.curvature.factors.CURVATURE_DAMPING) of every query file, all documents returned.
* Kronfluence 1.0.1 (`.venv-kronfluence`, `make peers`): `fit_all_factors` (EK-FAC, its default
  true Fisher, full dimensions), then `compute_pairwise_scores` of every query file (damping 0.1 x
  the mean eigenvalue, Kronfluence's heuristic), the pieces of scripts/peers/worker_kronfluence.py.

Measured per tool: wall seconds to the factors (Gradian: the index build incl. its curvature;
Kronfluence: fit_all_factors) and to the scores of every query, the peak resident memory of each
step (scripts/peers/peak.py: VmHWM above the resident size at its start, model and data loaded
before) and of the whole process, the bytes on disk, and recall@1 / recall@10 of the one document
stating each query's fact. Also the unprojected index's size (the raw per-example gradients of
the same modules in the same dtype), to check "the index is >= 10x smaller than unprojected".

    python scripts/bench/bench_kronfluence_cost.py --smollm2 ~/.cache/circuitkit/models/smollm2-135m-instruct \
        [--yardstick S|S2] [--width 1024] [--json docs/data/kronfluence_cost.json]

The same file is each tool's worker (`--worker gradian|kronfluence --spec SPEC --out OUT`); its
top-level imports are the standard library only, so that it runs in the Kronfluence venv too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "peers"))
sys.path.insert(0, str(ROOT))

KRONFLUENCE_PYTHON = ROOT / ".venv-kronfluence" / "bin" / "python"


# ----------------------------------------------------------------------------- workers


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _process_peak_bytes() -> int:
    """The process's resident high-water mark since the last reset (peak.measured resets it)."""
    from peak import _status_kib

    return _status_kib("VmHWM") * 1024


def _n_lines(path: str) -> int:
    return sum(1 for line in Path(path).read_text().splitlines() if line.strip())


def gradian_side(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Index at the defaults, then rank every query file (all documents); fills `result`."""
    import logging

    import torch
    from peak import measured
    from rich.console import Console
    from worker_gradian import score_matrix

    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.build.indexer import build_index
    from gradian.curvature.factors import CURVATURE_DAMPING
    from gradian.rank.ranking import rank
    from gradian.settings.grads import GradsConfig

    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)  # the float32 notice
    model_cfg = ModelConfig(name=spec["model_dir"], precision="float32")
    loaded = load_model(model_cfg, device=torch.device("cpu"))
    # Every key the comparison does not fix stays at GradsConfig's default.
    grads = GradsConfig(data_path=spec["docs"], batch_size=spec["batch_size"], module_filter=spec["modules"],
                        projection_dim=spec["per_module_dim"], projection_seed=spec["seed"])
    index_dir = Path(spec["work_dir"]) / "gradian_index"
    with measured() as build:
        summary = build_index(model_cfg, grads, index_dir, Console(stderr=True, quiet=True), loaded=loaded)
    build_process_peak = _process_peak_bytes()
    n_docs = summary["n_rows"]
    scores = {}
    with measured() as ranking:
        for style, path in spec["queries"].items():
            results = rank(index_dir, path, top_k=n_docs, loaded=loaded)
            scores[style] = score_matrix(results, _n_lines(path), n_docs)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    from bench_yardsticks import stored_bytes

    modules = manifest["projection"]["modules"]
    raw_width = sum(m["shape"][0] * m["shape"][1] for m in modules.values())
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float32": 4}[grads.storage_dtype]
    result.update({
        "method": f"gradian defaults: {grads.projection} {spec['per_module_dim']} per module, loss {grads.loss},"
                  f" preconditioner {grads.preconditioner}, fisher {grads.fisher}, {grads.storage_dtype} rows;"
                  f" rank score auto (ekfac), damping {CURVATURE_DAMPING}",
        "n_rows": n_docs, "threads": torch.get_num_threads(),
        "factor_seconds": build.seconds, "factor_peak_bytes": build.peak_bytes,
        "factor_process_peak_bytes": build_process_peak,
        "score_seconds": ranking.seconds, "score_peak_bytes": ranking.peak_bytes,
        "score_process_peak_bytes": _process_peak_bytes(),
        "disk_bytes": _tree_bytes(index_dir), "disk_parts": stored_bytes(index_dir),
        "row_width": summary["row_width"], "storage_dtype": grads.storage_dtype,
        "raw_row_width": raw_width, "raw_index_bytes": n_docs * raw_width * dtype_bytes,
        "module_shapes": {name: m["shape"] for name, m in modules.items()},
        "scores": scores})


def kronfluence_side(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Fit EK-FAC factors, then pairwise scores of every query file; fills `result`."""
    from functools import partial

    import torch
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs
    from lmdata import collate, load_model_and_tokenizer, load_rows, pad_id
    from peak import measured
    from worker_kronfluence import LMTask, linearize

    torch.manual_seed(spec["seed"])
    model, tokenizer = load_model_and_tokenizer(spec["model_dir"])
    docs = load_rows(spec["docs"], tokenizer, spec["max_length"])
    queries = {style: load_rows(path, tokenizer, spec["max_length"]) for style, path in spec["queries"].items()}
    task = LMTask(linearize(model, spec["modules"]))
    model = prepare_model(model, task)
    out_dir = Path(spec["work_dir"]) / "kronfluence"
    analyzer = Analyzer(analysis_name="cost", model=model, task=task, cpu=True, disable_tqdm=True,
                        output_dir=str(out_dir))
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=partial(collate, pad=pad_id(tokenizer))))
    with measured() as fit:
        analyzer.fit_all_factors(factors_name="ekfac", dataset=docs, per_device_batch_size=spec["batch_size"],
                                 factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
    fit_process_peak = _process_peak_bytes()
    scores = {}
    with measured() as scoring:
        for style, rows in queries.items():
            analyzer.compute_pairwise_scores(
                scores_name=f"scores_{style}", factors_name="ekfac", query_dataset=rows, train_dataset=docs,
                per_device_query_batch_size=spec["query_batch_size"] or len(rows),
                per_device_train_batch_size=spec["batch_size"], score_args=ScoreArguments(damping_factor=None),
                overwrite_output_dir=True)
            scores[style] = analyzer.load_pairwise_scores(f"scores_{style}")["all_modules"].double().tolist()
    analysis = out_dir / "cost" if (out_dir / "cost").is_dir() else out_dir  # Kronfluence: <output>/<analysis>/
    result.update({
        "method": "Kronfluence EK-FAC (true Fisher, full dimensions), damping 0.1 x mean eigenvalue",
        "n_rows": len(docs), "threads": torch.get_num_threads(),
        "factor_seconds": fit.seconds, "factor_peak_bytes": fit.peak_bytes,
        "factor_process_peak_bytes": fit_process_peak,
        "score_seconds": scoring.seconds, "score_peak_bytes": scoring.peak_bytes,
        "score_process_peak_bytes": _process_peak_bytes(),
        "disk_bytes": _tree_bytes(out_dir),
        "disk_parts": {p.name: _tree_bytes(p) for p in sorted(analysis.iterdir()) if p.is_dir()},
        "query_batch_size": spec["query_batch_size"] or "all queries of a style",
        "scores": scores})


def run_side(tool: str, spec: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """This script as `tool`'s worker in its own process (Gradian: this venv; Kronfluence: its venv)."""
    python = Path(sys.executable) if tool == "gradian" else KRONFLUENCE_PYTHON
    if not python.exists():
        return {"error": f"{python} does not exist: build it with `PEERS=kronfluence bash scripts/peers/setup_peers.sh`"}
    spec_path, out_path = work / f"spec_{tool}.json", work / f"result_{tool}.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run([str(python), __file__, "--worker", tool, "--spec", str(spec_path), "--out", str(out_path)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - start
    if not out_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"worker exited {proc.returncode} without a result: {' | '.join(tail)}"}
    result = json.loads(out_path.read_text())
    result["process_seconds"] = wall  # interpreter start, imports and model load included
    return result


# ----------------------------------------------------------------------------- orchestrator


def quality(result: dict[str, Any], targets: list[int]) -> dict[str, dict[str, Any]]:
    """recall@1 / recall@10 / MRR per query style, from the worker's score matrices, and each query's
    rank of its target (1 + the documents scored above it)."""
    import torch
    from bench_yardsticks import planted_metrics

    out = {}
    for style, m in (result.get("scores") or {}).items():
        scores = torch.tensor(m, dtype=torch.float64)
        ranks = [1 + int((row > row[t]).sum()) for row, t in zip(scores, targets, strict=True)]
        out[style] = planted_metrics(scores, targets) | {"ranks": ranks}
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    g, k = out["gradian"], out["kronfluence"]
    table = Table(title=f"Gradian (defaults, {out['width']} per module) vs Kronfluence EK-FAC on {out['yardstick']}:"
                        f" {g['n_rows']} documents, {out['n_queries']} queries, {len(out['modules'])} modules,"
                        f" {g['threads']} thread(s)")
    for col in ("", "Gradian", "Kronfluence", "Kronfluence / Gradian"):
        table.add_column(col, justify="left" if not col else "right")

    def row(label: str, key: str, fmt) -> None:
        a, b = g[key], k[key]
        table.add_row(label, fmt(a), fmt(b), f"{b / a:.1f}x" if a else "-")

    row("factors s (index build / fit_all_factors)", "factor_seconds", lambda v: f"{v:.1f}")
    row("scores s (rank / compute_pairwise_scores)", "score_seconds", lambda v: f"{v:.1f}")
    row("process s (start to end)", "process_seconds", lambda v: f"{v:.1f}")
    row("factors peak MiB above start", "factor_peak_bytes", mib)
    row("scores peak MiB above start", "score_peak_bytes", mib)
    g["process_peak_bytes"] = max(g["factor_process_peak_bytes"], g["score_process_peak_bytes"])
    k["process_peak_bytes"] = max(k["factor_process_peak_bytes"], k["score_process_peak_bytes"])
    row("process peak RSS MiB", "process_peak_bytes", mib)
    row("disk MiB (index / factors + scores)", "disk_bytes", mib)
    for style in out["styles"]:
        a, b = g["quality"][style], k["quality"][style]
        table.add_row(f"{style} recall@1 / @10", f"{a['r1']:.3f} / {a['r10']:.3f}", f"{b['r1']:.3f} / {b['r10']:.3f}",
                      "")
    Console(width=200).print(table)
    raw = g["raw_index_bytes"]
    Console(width=200).print(
        f"unprojected index ({g['raw_row_width']:,} values per row, {g['storage_dtype']}): {mib(raw)} MiB;"
        f" Gradian's index {mib(g['disk_bytes'])} MiB ({raw / g['disk_bytes']:.0f}x smaller; rows alone"
        f" {raw / g['disk_parts']['rows']:.0f}x); Kronfluence's files {mib(k['disk_bytes'])} MiB; parts:"
        f" Gradian {g['disk_parts']}, Kronfluence {k['disk_parts']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("gradian", "kronfluence"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--smollm2", help="SmolLM2-135M-Instruct HF directory (the base of the yardstick)")
    p.add_argument("--yardstick", default="S", choices=("S", "S2"))
    p.add_argument("--facts", type=int, default=None, help="facts of the set (S: 60, S2: 30, as bench_yardsticks)")
    p.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs (S: 2, S2: 16, as bench_yardsticks)")
    p.add_argument("--width", type=int, default=1024, help="Gradian's projection_dim per module")
    p.add_argument("--seed", type=int, default=0, help="Gradian's projection seed; Kronfluence's torch seed")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch of both tools (index / factors)")
    p.add_argument("--query-batch-size", type=int, default=8,
                   help="Kronfluence's per_device_query_batch_size (8, as the peer worker); 0 = every query of a style in"
                        " one batch (one pass over the documents per style: on S2 no faster, twice the memory)")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.worker:
        from lmdata import run_worker

        if args.worker == "gradian":
            from gradian import __version__

            sys.argv = [sys.argv[0], "--spec", args.spec, "--out", args.out]
            run_worker("gradian", lambda: __version__, gradian_side)
        else:
            from importlib.metadata import version

            sys.argv = [sys.argv[0], "--spec", args.spec, "--out", args.out]
            run_worker("kronfluence", lambda: version("kronfluence"), kronfluence_side)
        return 0
    if not args.smollm2:
        p.error("--smollm2 DIR is required (SmolLM2-135M-Instruct, e.g. ~/.cache/circuitkit/models/smollm2-135m-instruct)")

    import logging
    import platform

    import torch
    from bench_yardsticks import smollm2_chat_yardstick, smollm2_yardstick
    from rich.console import Console

    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)
    console = Console(width=200)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kronfluence_cost_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.yardstick == "S":
            ys = smollm2_yardstick(work, args.smollm2, args.facts or 60, args.epochs or 2, console)
        else:
            ys = smollm2_chat_yardstick(work, args.smollm2, args.facts or 30, args.epochs or 16, console)
        spec = {"model_dir": ys.model_dir, "docs": str(ys.docs), "queries": {s: str(q) for s, q in ys.queries.items()},
                "modules": ys.modules, "per_module_dim": args.width, "total_dim": 0, "batch_size": args.batch_size,
                "query_batch_size": args.query_batch_size, "max_length": 256, "seed": args.seed}
        out: dict[str, Any] = {"yardstick": args.yardstick, "width": args.width, "modules": ys.modules,
                               "styles": list(ys.queries), "n_queries": sum(_n_lines(str(q)) for q in ys.queries.values()),
                               "fine_tune": ys.fine_tune}
        for tool in ("gradian", "kronfluence"):
            tool_work = work / tool
            tool_work.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            out[tool] = run_side(tool, spec | {"work_dir": str(tool_work)}, work, args.timeout)
            console.print(f"[dim]{tool}: {time.perf_counter() - t0:.0f} s[/dim]")
            if out[tool].get("error"):
                raise SystemExit(f"{tool} failed: {out[tool]['error']}")
            out[tool]["quality"] = quality(out[tool], ys.targets)
            del out[tool]["scores"]
    print_table(out)
    out["machine"] = {"cores": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average": os.getloadavg(),
                      "wall_s": time.perf_counter() - start}
    console.print(f"wall time {out['machine']['wall_s']:.0f} s; load average {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out | {"args": vars(args) | {"work": str(args.work), "json": str(args.json)}},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
