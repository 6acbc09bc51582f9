"""Benchmark: factored rows (grads.row_format=factored) against dense rows at equal bytes per row.

One run, one model, the same rows. One forward+backward per batch (`per_example_gradients` with
the unprojected projector) hands each selected module's inputs x and output gradients δ to every
variant at once (`AllVariants.combine`):

* **exact**: G = Σ_t δ_t x_tᵀ itself, the yardstick (cosine of the unprojected gradients);
* **dense k x k**: the kronecker_orthogonal projection P_out G P_inᵀ, stored whole (k² values);
* **factored k x k, rank c**: the same projection at a larger k, stored as `gradian.index.formats.factored`
  stores it (`FactoredRows.combine`: 2 c k values).

Each variant is written as an index (float16) and ranked by `stream_topk` (cosine) against the same
query rows (the dense projected blocks `gradian rank` computes for either format), with its agreement
with the exact cosine (top-10 overlap, and Spearman over all rows, averaged over the queries).
Timed side by side, best of 3: "capture s / row", the capture pass of `gradian index` for that
variant alone on one batch; "rank s / 10k rows", `stream_topk` over the stored rows tiled to
`--rank-rows` (the queries' one-off factoring paid as in a large index); "rank-c queries", the
factored indexes ranked with each query block first cut to its best rank-c approximation (c x c
Gram products per row and module instead of r x c for an exact query of rank r: what truncating
the queries too would buy); "full-rank queries", a dense full-rank query streamed as kfac / ekfac
stream their preconditioned (not low-rank) queries, Σ U ⊙ (q V).

    python scripts/bench/bench_factored.py [--model random|smollm2] [--rows 320] [--queries 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from itertools import product
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.models.adapters import get_adapter
from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.loading import load_model
from gradian.capture.gradients import per_example_gradients
from gradian.data.batch import collate
from gradian.data.rows import load_rows
from gradian.index.formats.factored import FactoredRows, FactoredScorer, layout_of
from gradian.index.reader import IndexReader
from gradian.index.writer import IndexWriter
from gradian.projection.projector import Projector
from gradian.rank.scores import stream_topk

SMOLLM2 = Path.home() / ".cache" / "circuitkit" / "models" / "smollm2-135m-instruct"
# (name, k per side, rank or None for dense): all but the last store 1024 numbers per module.
VARIANTS = [("dense 32x32", 32, None), ("factored 64x64 c=8", 64, 8), ("factored 128x128 c=4", 128, 4),
            ("factored 256x256 c=2", 256, 2), ("dense 256x256", 256, None)]
SUBJECTS = ["cat", "dog", "owl", "fox", "elk", "bee", "ant", "cow", "pig", "yak"]
VERBS = ["runs", "naps", "eats", "hides", "sings", "waits", "digs", "swims"]
PLACES = ["lake", "hill", "barn", "road", "cave", "wood"]


def load(kind: str):
    """(model, tokenizer, adapter, module filter), float32 and frozen: a GPT-2 shape with d_model 256
    and random weights (the tiny GPT-2 fixture's tokenizer), or SmolLM2-135M-Instruct from the cache."""
    if kind == "smollm2":
        loaded = load_model(ModelConfig(name=str(SMOLLM2), precision="float32"), device=torch.device("cpu"))
        return loaded.model, loaded.tokenizer, loaded.adapter, ["down_proj"]
    tokenizer = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32")).tokenizer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, n_inner=1024, vocab_size=len(tokenizer),
                                       n_positions=128, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    model.requires_grad_(False)
    return model, tokenizer, get_adapter(model), ["mlp.c_proj"]


def batches(tokenizer, n_rows: int, n_queries: int, batch: int, root: Path):
    """Templated prompt/completion rows, collated in batches of `batch`: (the query batches of the
    first `n_queries` rows, the index batches of the next `n_rows`)."""
    rows = [{"prompt": f"The {s} {v} ", "completion": f"near the {p} at dawn, then the {p2} by noon ({i})."}
            for i, (s, v, p, p2) in enumerate(product(SUBJECTS, VERBS, PLACES, PLACES[::-1]))]
    rows = rows[::max(1, len(rows) // (n_rows + n_queries))][:n_rows + n_queries]  # spread over the templates
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded, _ = load_rows(path, tokenizer, 64)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    queries, index = loaded[:n_queries], loaded[n_queries:]
    return ([collate(queries[i:i + batch], pad) for i in range(0, len(queries), batch)],
            [collate(index[i:i + batch], pad) for i in range(0, len(index), batch)])


class AllVariants:
    """A stand-in row format for `per_example_gradients` with the unprojected projector: from each
    module's x (B, T, d_in) and δ (B, T, d_out) it stores every variant's rows, as dense queries
    (`self.queries`) and as stored rows (`self.rows`), and returns the exact G."""

    def __init__(self, projectors: dict[int, Projector]) -> None:
        self.projectors = projectors
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.queries: dict[str, dict[str, torch.Tensor]] = {}

    def combine(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        for variant, k, c in VARIANTS:
            p = self.projectors[k]
            xp, dp = p.project_input(name, x), p.project_output(name, delta)
            self.queries.setdefault(variant, {})[name] = p.combine(name, xp, dp)
            self.rows.setdefault(variant, {})[name] = (self.queries[variant][name] if c is None
                                                       else FactoredRows(c).combine(name, xp, dp))
        return torch.bmm(delta.float().transpose(1, 2), x.float()).flatten(1)

    def combine_all(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    spans: list[int] | None = None) -> dict[str, torch.Tensor]:
        """What the capture calls once per batch: `combine` of every module, name -> (x, δ); `spans` unused
        (each variant's factors are taken per module here)."""
        return {name: self.combine(name, x, delta) for name, (x, delta) in pairs.items()}

    def take(self, which: str) -> dict[str, torch.Tensor]:
        """variant -> (B, width) of the last batch, modules side by side."""
        return {v: torch.cat(list(by_module.values()), dim=1) for v, by_module in getattr(self, which).items()}


def write_index(path: Path, rows: torch.Tensor, projector: Projector, rank: int | None, per_shard: int) -> None:
    header = {"storage_dtype": "float16", "row_width": rows.shape[1], "projection": projector.describe(),
              "row_format": "dense" if rank is None else "factored", "row_rank": rank}
    writer = IndexWriter(path, header, rows.shape[0], per_shard)
    for k in writer.pending():
        start, end = writer.row_range(k)
        writer.write_shard(k, rows[start:end], torch.arange(start, end))


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def truncated(q: torch.Tensor, n_modules: int, k: int, c: int) -> torch.Tensor:
    """Each query's (k, k) blocks cut to their best rank-c approximation (dense rows, as `stream_topk` takes)."""
    blocks = q.reshape(q.shape[0], n_modules, k, k).double()
    u, sigma, v_t = torch.linalg.svd(blocks, full_matrices=False)
    return ((u[..., :c] * sigma[..., None, :c]) @ v_t[..., :c, :]).reshape(q.shape).float()


def full_rank_pass(index_dir: Path, query: torch.Tensor) -> None:
    """Stream the index against a dense full-rank query, as kfac / ekfac score it."""
    reader = IndexReader(index_dir)
    layout = layout_of(reader.manifest)
    scorer = None if layout is None else FactoredScorer(layout, query, low_rank=False)
    for _rows, grads, _norms in reader.shards(factored=layout is not None):
        _ = query @ grads.T if scorer is None else scorer(grads)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()


def run(args: argparse.Namespace, root: Path) -> None:
    """Every variant's rows, indexes, timings and agreement, written under `root`; prints the tables."""
    console = Console()
    model, tokenizer, adapter, pattern = load(args.model)
    modules = select_modules(model, adapter, pattern)[-args.modules:]
    shapes = module_shapes(modules)
    raw = Projector(shapes, projection_dim=None)
    projectors = {k: Projector(shapes, "kronecker_orthogonal", k * k) for k in {k for _, k, _ in VARIANTS}}
    query_batches, index_batches = batches(tokenizer, args.rows, args.queries, args.batch, root)
    t0 = time.perf_counter()
    variants = AllVariants(projectors)
    exact_q, queries = [], {v: [] for v, _, _ in VARIANTS}
    for batch in query_batches:
        exact_q.append(per_example_gradients(model, adapter, modules, raw, batch, factored=variants).row())
        for v, q in variants.take("queries").items():
            queries[v].append(q)
    exact_q = torch.cat(exact_q)  # (Q, Σ d_out d_in)
    exact, rows = [], {v: [] for v, _, _ in VARIANTS}
    for batch in index_batches:
        g = per_example_gradients(model, adapter, modules, raw, batch, factored=variants).row()
        exact.append((exact_q @ g.T) / exact_q.norm(dim=1, keepdim=True) / g.norm(dim=1))  # (Q, B) cosine
        for v, r in variants.take("rows").items():
            rows[v].append(r)
    exact = torch.cat(exact, dim=1)  # (Q, n)
    console.print(f"one pass over {args.rows + args.queries} rows, every variant: {time.perf_counter() - t0:.1f} s")
    first = index_batches[0]
    cost = Table(title=f"{args.model}: {len(shapes)} modules of {list(shapes.values())[0]}, {args.rows} rows,"
                       f" {len(exact)} queries, float16 storage, {torch.get_num_threads()} threads: cost")
    agree = Table(title=f"agreement with the exact (unprojected) cosine, mean over {len(exact)} queries")
    for col in ("rows", "values / module", "bytes / row", "capture s / row", "rank s / 10k rows",
                "rank-c queries", "full-rank queries"):
        cost.add_column(col, justify="right")
    for col in ("rows", "top-10 overlap", "Spearman", "top-10, rank-c queries", "Spearman, rank-c queries"):
        agree.add_column(col, justify="right")
    results, n = [], args.rows
    for name, k, c in VARIANTS:
        stored, q = torch.cat(rows[name]), torch.cat(queries[name])
        index_dir = root / name.replace(" ", "_")
        write_index(index_dir, stored, projectors[k], c, per_shard=128)
        disk = sum(e["bytes"] for e in IndexReader(index_dir).manifest["shards"].values())
        factored = None if c is None else FactoredRows(c)
        capture_s = best_of(lambda p=projectors[k], f=factored: per_example_gradients(
            model, adapter, modules, p, first, factored=f)) / first["input_ids"].shape[0]
        asked = {"exact q": q} if c is None else {"exact q": q, "rank-c q": truncated(q, len(shapes), k, c)}
        res = {"rows": name, "values_per_module": k * k if c is None else 2 * c * k, "bytes_per_row": disk / n,
               "capture_s_per_row": capture_s}
        for which, qq in asked.items():
            top = stream_topk(index_dir, qq, top_k=n, score="cosine")
            scores = torch.zeros(qq.shape[0], n).scatter_(1, top["query_rows"], top["query_scores"])
            res[f"top10 {which}"] = sum(len(set(scores[i].topk(10).indices.tolist())
                                            & set(exact[i].topk(10).indices.tolist()))
                                        for i in range(qq.shape[0])) / (10 * qq.shape[0])
            res[f"spearman {which}"] = sum(spearman(scores[i], exact[i]) for i in range(qq.shape[0])) / qq.shape[0]
        if stored.shape[1] <= 4096 * len(shapes):  # the equal-bytes rows: rank time at scale
            tiled = root / f"{index_dir.name}_tiled"
            write_index(tiled, stored.repeat(-(-args.rank_rows // n), 1)[:args.rank_rows], projectors[k], c, 4096)
            per_10k = 1e4 / args.rank_rows
            for which, qq in asked.items():
                res[f"rank_s_per_10k {which}"] = per_10k * best_of(
                    lambda d=tiled, q=qq: stream_topk(d, q, top_k=10, score="cosine"))
            full_q = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
            res["rank_s_per_10k full-rank q"] = per_10k * best_of(lambda d=tiled, f=full_q: full_rank_pass(d, f))
            shutil.rmtree(tiled)
        results.append(res)

        def cell(key: str, fmt: str = "{:.3f}", res=res) -> str:
            return "—" if res.get(key) is None else fmt.format(res[key])

        cost.add_row(name, str(res["values_per_module"]), f"{disk / n:.0f}", f"{capture_s:.4f}",
                     cell("rank_s_per_10k exact q"), cell("rank_s_per_10k rank-c q"),
                     cell("rank_s_per_10k full-rank q"))
        agree.add_row(name, cell("top10 exact q"), cell("spearman exact q"), cell("top10 rank-c q"),
                      cell("spearman rank-c q"))
    per_module = sum(o * i for o, i in shapes.values())
    cost.add_row("exact (unprojected)", str(per_module // len(shapes)), str(per_module * 2 + 12), "", "", "", "")
    console.print(cost)
    console.print(agree)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": args.rows, "queries": args.queries,
                                         "shapes": list(shapes.values()), "results": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("random", "smollm2"), default="random")
    parser.add_argument("--rows", type=int, default=320)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modules", type=int, default=4, help="the last N of the selected linears")
    parser.add_argument("--rank-rows", type=int, default=20000, help="rows of the tiled indexes the rank time"
                        " per 10k rows is measured on (equal-bytes variants)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-factored-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
