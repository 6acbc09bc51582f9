"""Does restricting the gradient index to a circuit help retrieve the rows of its behaviour?

Fixture: the trained induction model (`builtin:induction`), whose copy behaviour runs through
the previous-token head L0H2 and the induction head L1H1 (verified from attention patterns when
the fixture is built). Training rows mix two kinds (`scripts/bench/induction_rows.py`): `copy` rows
(the completion repeats a segment seen earlier: the induction circuit predicts it) and `fresh`
rows (the completion is symbols never seen in the row: nothing to copy, the model's guess comes
from the direct path). Queries are held-out rows of each kind.

For each query, the share of its top-k training rows (cosine of raw per-example gradients, no
projection) that are of the query's kind, averaged over queries, for four indexes built in this
one run on the same rows:

* circuit:      the circuit's heads only (their o_proj column blocks), the circuit found by the
                pipeline here (EAP-IG, edge level, head pruning to 2 of 8 heads);
* unrestricted: every linear module of the blocks (grads.module_filter null);
* random heads: as many heads as the circuit, drawn at random (every other pair), averaged;
* all heads:    every head's o_proj block (the circuit's superset of the same kind of weights).

    python scripts/bench/bench_circuit_index.py [--train 200] [--queries 20] [--top-k 10] [--random 10]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from circuitkit.discovery.circuit import load_circuit, save_circuit
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline
from gradian.build.indexer import build_index
from gradian.rank.ranking import rank
from gradian.settings.grads import GradsConfig
from scripts.bench.induction_rows import induction_rows


def find_circuit(work: Path) -> Path:
    """The induction circuit as the pipeline finds it (as `make demo` does)."""
    _, cfg = compose(["stages=[data,attribution,pruning]", "pruning.graph=false"], config_name="demo")
    run_pipeline(cfg, work / "discovery", Console(file=io.StringIO()))
    return work / "discovery" / "circuit.pt"


def heads_circuit(path: Path, template: dict, heads: list[tuple[int, int]]) -> Path:
    mask = torch.zeros_like(template["head_mask"])
    for layer, head in heads:
        mask[layer, head] = True
    save_circuit(path, {**{k: v for k, v in template.items() if k != "format_version"}, "head_mask": mask,
                        "mlp_mask": torch.zeros(mask.shape[0], dtype=torch.bool)})
    return path


def same_kind_share(index_dir: Path, queries: Path, kinds: list[str], query_kinds: list[str], top_k: int,
                    loaded) -> dict[str, float]:
    """Mean over queries of the share of their top-k rows with the query's kind, per query kind."""
    results = rank(index_dir, queries, top_k=top_k, loaded=loaded)
    shares: dict[str, list[float]] = {}
    for q, kind in enumerate(query_kinds):
        rows = [r["row_id"] for r in results if r["query"] == q]
        shares.setdefault(kind, []).append(sum(kinds[r] == kind for r in rows) / len(rows))
    return {kind: statistics.mean(v) for kind, v in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=200, help="training rows (half copy, half fresh)")
    parser.add_argument("--queries", type=int, default=20, help="query rows per kind")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--random", type=int, default=10, help="random head sets averaged")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    console = Console(width=120)
    torch.manual_seed(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        loaded = load_model(ModelConfig(name="builtin:induction", precision="float32"))
        tok = loaded.tokenizer
        train = induction_rows(tok, args.train, seed=10)
        queries = induction_rows(tok, 2 * args.queries, seed=11)
        (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
        (work / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
        kinds, query_kinds = [r["kind"] for r in train], [r["kind"] for r in queries]

        circuit_path = find_circuit(work)
        template = load_circuit(circuit_path)
        circuit_heads = [tuple(h) for h in template["head_mask"].nonzero().tolist()]
        n_layers, n_heads = template["head_mask"].shape
        every_pair = [p for p in itertools.combinations(itertools.product(range(n_layers), range(n_heads)),
                                                        len(circuit_heads)) if sorted(p) != sorted(circuit_heads)]
        random_sets = random.Random(0).sample(every_pair, min(args.random, len(every_pair)))
        grads = replace(GradsConfig(), data_path=str(work / "train.jsonl"), projection_dim=None,
                        storage_dtype="float32", batch_size=16, max_seq_length=128, circuit_mlps="none",
                        preconditioner="none")  # raw rows ranked with cosine: no curvature
        quiet = Console(file=io.StringIO())

        def measure(name: str, circuit: Path | None) -> dict[str, float]:
            index_dir = work / f"index-{name}"
            summary = build_index(loaded_cfg, grads, index_dir, quiet, loaded=loaded, circuit_path=circuit)
            shares = same_kind_share(index_dir, work / "queries.jsonl", kinds, query_kinds, args.top_k, loaded)
            return {**shares, "row_width": summary["row_width"]}

        loaded_cfg = ModelConfig(name="builtin:induction", precision="float32")
        results: dict[str, dict[str, float]] = {}
        results["circuit"] = measure("circuit", circuit_path)
        results["unrestricted"] = measure("unrestricted", None)
        all_heads = [(la, h) for la in range(n_layers) for h in range(n_heads)]
        results["all heads"] = measure("all-heads", heads_circuit(work / "all.pt", template, all_heads))
        draws = [measure(f"random-{i}", heads_circuit(work / f"random-{i}.pt", template, list(pair)))
                 for i, pair in enumerate(random_sets)]
        results["random heads"] = {k: statistics.mean(d[k] for d in draws) for k in draws[0]}
        results["random heads (min..max)"] = {k: (min(d[k] for d in draws), max(d[k] for d in draws))
                                              for k in ("copy", "fresh")}
    wall = time.perf_counter() - start
    chance = 0.5
    table = Table(title=f"share of the top-{args.top_k} training rows of the query's kind ({args.train} rows,"
                        f" half copy / half fresh; {args.queries} queries per kind; raw gradients, cosine)")
    for col in ("index", "heads", "row width", "copy queries", "fresh queries", "copy / random heads"):
        table.add_column(col, justify="right")
    label = ", ".join(f"L{la}H{h}" for la, h in circuit_heads)
    rnd = results["random heads"]
    for name, heads in (("circuit", label), ("random heads", f"{len(circuit_heads)} random x {len(random_sets)}"),
                        ("all heads", str(n_layers * n_heads)), ("unrestricted", "all linear modules")):
        r = results[name]
        table.add_row(name, heads, f"{r['row_width']:.0f}", f"{r['copy']:.3f}", f"{r['fresh']:.3f}",
                      f"{r['copy'] / rnd['copy']:.2f}x")
    lo, hi = results["random heads (min..max)"]["copy"]
    table.caption = (f"chance {chance:.2f}; random head sets range {lo:.2f}..{hi:.2f} on copy queries;"
                     f" wall {wall:.0f} s (shared 2-core machine)")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "circuit_heads": circuit_heads,
                                         "random_sets": random_sets, "results": results, "wall_s": wall}, indent=2))


if __name__ == "__main__":
    main()
