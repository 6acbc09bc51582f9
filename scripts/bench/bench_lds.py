"""Benchmark: linear datamodeling score (LDS, as in the TRAK paper) of Gradian's options and the peers.

The planted-fact corpus of scripts/bench/bench_planted_facts.py (--entities made-up entities x 4 facts +
as many generic sentences) and the tiny GPT-2 fixture (float32). The attribution model is the
fixture fine-tuned on all documents; then `--subsets` models are fine-tuned the same way (same
epochs, learning rate, seed) from the same base, each on a random half of the documents. For a
query q (a fact asked as a question, both completion styles) and subset S_j:

    actual_j(q)    = -loss of the subset-j model on q (cross-entropy summed over the completion)
    predicted_j(q) = Σ_{i in S_j} τ(q, i),   τ the attribution score of document i for q

LDS(q) = Spearman over j of (predicted_j, actual_j); reported is the mean over queries (and its
standard error). Scores: Gradian's options at `--dim` per module (one index per projection,
loss and preconditioner; every rank score of it), Gradian's exact raw gradients (the dot and
cosine ceilings), and bergson, TRAK (traker) and dattri with their own score functions at equal
width, each in its own virtual environment (scripts/peers/, `make peers`), as bench_peers.py.

    python scripts/bench/bench_lds.py [--entities 12] [--subsets 48] [--epochs 10] [--dim 64]
                                [--tools bergson,traker,dattri] [--projection-seed S] [--work DIR] [--json out.json]

Positive τ means "training on i lowers q's loss" for every tool here (gradient inner products of
the loss; TRAK's and dattri's scores of their output function), so a useful method has LDS > 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from scipy.stats import spearmanr

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from gradian.data.batch import collate
from gradian.data.rows import load_rows
from gradian.rank.ranking import rank  # noqa: E402
from gradian.settings.grads import GradsConfig  # noqa: E402
from scripts.bench.bench_peers import TOOLS, prepare, run_worker  # noqa: E402
from scripts.bench.bench_planted_facts import fine_tune, write_jsonl  # noqa: E402

PEERS = ("bergson", "traker", "dattri")
# Gradian's index options: (label, projection, loss, preconditioner, scores ranked on it).
OPTIONS = [
    ("kronecker", "kronecker", "ce", "module", ("cosine", "dot", "influence", "whitened")),
    ("kronecker_orthogonal", "kronecker_orthogonal", "ce", "module", ("cosine", "dot", "influence", "whitened")),
    ("kronecker, margin", "kronecker", "margin", "module", ("cosine", "dot", "influence", "whitened")),
    ("raw (exact)", "raw", "ce", "none", ("cosine", "dot")),
]


def query_losses(model_dir: str, queries: dict[str, str]) -> dict[str, list[float]]:
    """Per query style, each query's cross-entropy summed over its completion tokens."""
    loaded = load_model(ModelConfig(name=model_dir, precision="float32"), device=torch.device("cpu"))
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    out = {}
    with torch.no_grad():
        for style, path in queries.items():
            rows, _ = load_rows(path, loaded.tokenizer, 256)
            losses = []
            for first in range(0, len(rows), 32):
                b = collate(rows[first:first + 32], pad)
                logits = loaded.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
                sup = b["supervised"][:, 1:]
                per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), b["input_ids"][:, 1:], reduction="none")
                losses += (per_token * sup).sum(dim=1).tolist()
            out[style] = losses
    return out


def subset_losses(data: dict[str, Any], work: Path, n_subsets: int, epochs: int, seed: int,
                  console: Console) -> tuple[list[list[int]], dict[str, list[list[float]]]]:
    """Train one model per random half of the documents; (subsets, style -> (n_subsets, Q) losses).

    Kept in work/subset_losses.json: a rerun with the same --work, subsets, epochs and seed reuses them.
    """
    cache = work / "subset_losses.json"
    key = {"n_subsets": n_subsets, "epochs": epochs, "seed": seed, "docs": Path(data["docs"]).read_text()}
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return saved["subsets"], saved["losses"]
    docs = [json.loads(line) for line in Path(data["docs"]).read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    subsets, losses = [], {style: [] for style in data["queries"]}
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    start = time.perf_counter()
    for j in range(n_subsets):
        subset = sorted(rng.sample(range(len(docs)), len(docs) // 2))
        path = write_jsonl(work / f"subset_{j}.jsonl", [docs[i] for i in subset])
        loaded = load_model(base, device=torch.device("cpu"))
        fine_tune(loaded, path, epochs=epochs, seed=seed)
        model_dir = work / f"subset_model_{j}"
        loaded.model.save_pretrained(model_dir)
        loaded.tokenizer.save_pretrained(model_dir)
        for style, values in query_losses(str(model_dir), data["queries"]).items():
            losses[style].append(values)
        subsets.append(subset)
        console.print(f"[dim]subset model {j + 1}/{n_subsets} ({time.perf_counter() - start:.0f} s)[/dim]")
    cache.write_text(json.dumps({"key": key, "subsets": subsets, "losses": losses}))
    return subsets, losses


def lds(scores: list[list[float]], subsets: list[list[int]], losses: list[list[float]]) -> tuple[float, float]:
    """Mean over queries of Spearman(Σ_{i in S_j} τ(q, i), -loss_j(q)) over subsets j; (mean, standard error)."""
    tau = torch.tensor(scores, dtype=torch.float64)  # (Q, n)
    member = torch.zeros(len(subsets), tau.shape[1], dtype=torch.float64)
    for j, subset in enumerate(subsets):
        member[j, subset] = 1.0
    predicted = member @ tau.T  # (n_subsets, Q)
    actual = -torch.tensor(losses, dtype=torch.float64)  # (n_subsets, Q)
    per_query = [spearmanr(predicted[:, q], actual[:, q]).statistic for q in range(tau.shape[0])]
    per_query = [0.0 if v != v else float(v) for v in per_query]  # a constant column has no rank order
    return statistics.mean(per_query), statistics.stdev(per_query) / len(per_query) ** 0.5


def score_matrix(results: list[dict], n_queries: int, n_docs: int) -> list[list[float]]:
    matrix = [[0.0] * n_docs for _ in range(n_queries)]
    for r in results:
        if r["query"] != "aggregate":
            matrix[r["query"]][r["row_id"]] = r["score"]
    return matrix


def gradian_scores(data: dict[str, Any], work: Path, dim: int, seed: int) -> list[dict[str, Any]]:
    """Every Gradian option's score matrices per query style, with index and rank seconds."""
    model_cfg = ModelConfig(name=data["model_dir"], precision="float32")
    loaded = load_model(model_cfg, device=torch.device("cpu"))
    quiet = Console(stderr=True, quiet=True)
    out = []
    for label, projection, loss, preconditioner, scores in OPTIONS:
        raw = projection == "raw"
        grads = GradsConfig(data_path=data["docs"], batch_size=16, max_seq_length=256, module_filter=data["modules"],
                            projection="kronecker" if raw else projection, projection_dim=None if raw else dim,
                            projection_seed=seed, storage_dtype="float32", loss=loss, preconditioner=preconditioner)
        index_dir = work / f"gradian_{projection}_{loss}_{preconditioner}_{seed}"
        start = time.perf_counter()
        build_index(model_cfg, grads, index_dir, quiet, loaded=loaded)
        index_s = time.perf_counter() - start
        for score in scores:
            matrices, rank_s = {}, 0.0
            for style, path in data["queries"].items():
                n_queries = sum(1 for line in Path(path).read_text().splitlines() if line.strip())
                start = time.perf_counter()
                results = rank(index_dir, path, top_k=data["n_docs"], score=score, loaded=loaded)
                rank_s += time.perf_counter() - start
                matrices[style] = score_matrix(results, n_queries, data["n_docs"])
            out.append({"tool": "gradian", "option": label, "score": score, "scores": matrices,
                        "index_s": index_s, "rank_s": rank_s})
    return out


def peer_scores(data: dict[str, Any], work: Path, tools: list[str], dim: int, seed: int,
                timeout: float) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        tool_work = work / f"{tool}_{seed}"
        tool_work.mkdir(parents=True, exist_ok=True)
        spec = {k: data[k] for k in ("model_dir", "docs", "queries", "modules")}
        spec.update(per_module_dim=dim, total_dim=dim * len(data["modules"]), batch_size=16, max_length=256,
                    seed=seed, work_dir=str(tool_work))
        result = run_worker(tool, spec, tool_work, timeout)
        if result.get("error"):
            out.append({"tool": tool, "option": "-", "score": "-", "error": str(result["error"]).splitlines()[0]})
            continue
        out.append({"tool": tool, "option": result.get("method") or "own", "score": result.get("scoring") or "own",
                    "scores": result["scores"], "index_s": result.get("index_seconds"),
                    "rank_s": result.get("query_seconds")})
        if "scores_cosine" in result:
            out.append({"tool": tool, "option": result.get("method") or "own", "score": "cosine",
                        "scores": result["scores_cosine"], "index_s": None, "rank_s": None})
    return out


def print_table(report: dict[str, Any], console: Console) -> None:
    styles = report["styles"]
    table = Table(title=f"LDS, {report['n_subsets']} half-subset models, {report['n_docs']} documents,"
                        f" {report['n_queries']} queries per style, {report['dim']} per module")
    for col in ("tool", "option", "score", *[f"LDS {s}" for s in styles], "rank s"):
        table.add_column(col, justify="left" if col in ("tool", "option", "score") else "right")
    for r in report["rows"]:
        if r.get("error"):
            table.add_row(r["tool"], "-", "-", *(["error"] * len(styles)), r["error"][:60])
            continue
        cells = [f"{r['lds'][s][0]:.3f} ± {r['lds'][s][1]:.3f}" for s in styles]
        table.add_row(r["tool"], r["option"], r["score"], *cells, "-" if r.get("rank_s") is None else f"{r['rank_s']:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entities", type=int, default=12)
    p.add_argument("--subsets", type=int, default=48)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dim", type=int, default=64, help="projection width per module (a square for kronecker)")
    p.add_argument("--tools", default=",".join(PEERS), help=f"peers, a subset of {','.join(PEERS)}; '' for none")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsets and the fine-tuning")
    p.add_argument("--projection-seed", type=int, default=None, help="projection seed of every tool (default --seed)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None,
                   help="keep the work files here (default: a temp dir); a rerun reuses the subset models' losses")
    args = p.parse_args(argv)
    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)  # the float32 notice
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        p.error(f"--tools: unknown {unknown}")
    console = Console(width=160)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lds_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare(work, "tiny", args.entities, args.epochs)
        subsets, losses = subset_losses(data, work, args.subsets, args.epochs, args.seed, console)
        seed = args.seed if args.projection_seed is None else args.projection_seed
        rows = gradian_scores(data, work, args.dim, seed) + peer_scores(data, work, tools, args.dim, seed, args.timeout)
    styles = list(data["queries"])
    for r in rows:
        if not r.get("error"):
            r["lds"] = {s: lds(r["scores"][s], subsets, losses[s]) for s in styles}
            del r["scores"]
    report = {"n_docs": data["n_docs"], "n_queries": data["n_queries"], "n_subsets": args.subsets,
              "projection_seed": seed,
              "epochs": args.epochs, "dim": args.dim, "styles": styles, "fine_tune": data["fine_tune"], "rows": rows,
              "wall_s": time.perf_counter() - start,
              "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"}
    print_table(report, console)
    console.print(f"{report['machine']}; wall time {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
