"""Benchmark: does Gradian find the training document that states a planted fact?

A synthetic corpus of fictional entities (two-syllable names, new strings to the tokenizer) with
random attributes (birthplace, employer, hobby, pet). Each document states one fact as a
prompt/completion row ("Tell me about Korvim." / " Korvim was born in Oslo."); generic sentences
are added as distractors, so every fact document competes with the same entity's other facts,
other entities' facts of the same kind, and unrelated text. Every fact is then asked as a query
("Where was Korvim born?") with two completion styles:

* ``full``:  " Korvim was born in Oslo."  (the document's own sentence)
* ``short``: " Oslo."                      (only the answer)

The target of a query is the document stating exactly that fact. The tiny GPT-2 fixture (float32)
is fine-tuned on the documents for a few epochs of AdamW (seconds), saved, and loaded back with
``load_model`` so the index records the fine-tuned weights; the un-fine-tuned fixture is the
baseline. For each projection (raw, kronecker and dense at several dims, float16/float32 storage)
the documents are indexed (``build_index``, module_filter null = every linear module of the blocks)
and the queries ranked by cosine (``rank``); reported: recall@1, recall@10 and MRR of the target,
with chance levels 1/n_docs and 10/n_docs.

    python scripts/bench/bench_planted_facts.py [--entities 40] [--epochs 30] [--small] [--json out.json]
    python scripts/bench/bench_planted_facts.py --eos-study [--epochs 30]
    python scripts/bench/bench_planted_facts.py --scores-study [--epochs 5] [--seeds 3]

``--eos-study`` is the evidence for ``grads.append_eos``'s default: the model is fine-tuned once
with EOS after every completion (supervised) and once without, each is indexed under both
policies, and the table gives recall and how much of a row's gradient the EOS token carries.

``--scores-study`` compares Gradian's score options (projection kind, grads.loss, preconditioned
rank scores) against the exact-gradient cosine on a corpus whose facts are written in one of two
templates per attribute, with a third query style, ``cross``: the completion in the template the
entity's fact was not written in. Recall is averaged over projection seeds; the rank seconds are
those of streaming the index (`stream_topk`) alone, so their ratios are the scores' own cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.loading import LoadedModel, load_model  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from gradian.data.batch import collate, to_device
from gradian.data.rows import TokenPolicy, load_rows
from gradian.rank.ranking import rank  # noqa: E402
from gradian.settings.grads import GradsConfig  # noqa: E402

FIRST = ("Kor", "Bel", "Tam", "Vex", "Dra", "Mol", "Zan", "Pir", "Gol", "Fen", "Sar", "Quo", "Lum", "Hax")
SECOND = ("vim", "dor", "rith", "nax", "pell", "quin", "sor", "zek", "mund", "ral", "tove", "gash")
ATTRIBUTES: dict[str, dict[str, Any]] = {
    "birthplace": {"values": ("Oslo", "Cairo", "Lima", "Tokyo", "Berlin", "Dublin", "Madrid", "Quito"),
                   "doc": " {e} was born in {v}.", "question": "Where was {e} born?",
                   "doc2": " The birthplace of {e} is {v}."},
    "employer": {"values": ("Acme", "Globex", "Initech", "Hooli", "Vandelay", "Stark", "Wonka", "Tyrell"),
                 "doc": " {e} works for {v}.", "question": "Who does {e} work for?",
                 "doc2": " The employer of {e} is {v}."},
    "hobby": {"values": ("chess", "painting", "fishing", "hiking", "singing", "cooking", "rowing", "knitting"),
              "doc": " {e} enjoys {v}.", "question": "What does {e} enjoy?",
              "doc2": " The hobby of {e} is {v}."},
    "pet": {"values": ("cat", "dog", "parrot", "rabbit", "turtle", "hamster", "ferret", "goat"),
            "doc": " {e} has a pet {v}.", "question": "What pet does {e} have?",
            "doc2": " The pet of {e} is a {v}."},
}
QUERY_STYLES = ("full", "short")
# (projection, projection_dim, storage_dtype); projection_dim None = raw gradients (the reference).
FULL_GRID = [("raw", None, "float32"),
             ("kronecker", 64, "float16"), ("kronecker", 256, "float16"), ("kronecker", 1024, "float16"),
             ("kronecker", 256, "float32"),
             ("dense", 64, "float16"), ("dense", 256, "float16"), ("dense", 1024, "float16")]
SMALL_GRID = [("raw", None, "float32"), ("kronecker", 256, "float16")]


@dataclass
class Corpus:
    docs: list[dict[str, str]]  # JSONL rows of the training file, in file order
    queries: dict[str, list[dict[str, str]]]  # style -> JSONL rows
    targets: list[int]  # query i's target document (same for every style)
    n_facts: int


def make_corpus(n_entities: int = 40, n_generic: int | None = None, seed: int = 0,
                cross_template: bool = False) -> Corpus:
    """Fact documents (one per entity and attribute), generic distractors, and one query per fact.

    `cross_template`: each fact document is written with one of two templates of its attribute
    (drawn per fact; both are trained, on different entities), and a third query style,
    ``cross``, asks with the completion in the template that entity's fact was not written in.
    """
    from circuitkit.fixtures.models import synthetic_corpus

    rng = random.Random(seed)
    names = [a + b for a in FIRST for b in SECOND]
    if n_entities > len(names):
        raise ValueError(f"at most {len(names)} entities")
    entities = rng.sample(names, n_entities)
    facts = [(e, attr, rng.choice(spec["values"])) for e in entities for attr, spec in ATTRIBUTES.items()]
    # A separate generator, so the default corpus (and its shuffle) stays what it was.
    pick = random.Random(seed + 7)
    template = [("doc", "doc2")[pick.randrange(2)] if cross_template else "doc" for _ in facts]
    other = {"doc": "doc2", "doc2": "doc"}
    generic = synthetic_corpus(n_sentences=200, seed=seed + 1)
    generic = rng.sample(generic, n_entities if n_generic is None else n_generic)
    docs: list[tuple[dict[str, str], int | None]] = [
        ({"prompt": f"Tell me about {e}.", "completion": ATTRIBUTES[a][template[i]].format(e=e, v=v)}, i)
        for i, (e, a, v) in enumerate(facts)]
    docs += [({"prompt": "Tell me something.", "completion": " " + s}, None) for s in generic]
    rng.shuffle(docs)
    where = {fact: row for row, (_, fact) in enumerate(docs) if fact is not None}
    queries = {
        "full": [{"prompt": ATTRIBUTES[a]["question"].format(e=e), "completion": ATTRIBUTES[a][template[i]].format(e=e, v=v)}
                 for i, (e, a, v) in enumerate(facts)],
        "short": [{"prompt": ATTRIBUTES[a]["question"].format(e=e), "completion": f" {v}."} for e, a, v in facts],
    }
    if cross_template:
        queries["cross"] = [{"prompt": ATTRIBUTES[a]["question"].format(e=e),
                             "completion": ATTRIBUTES[a][other[template[i]]].format(e=e, v=v)}
                            for i, (e, a, v) in enumerate(facts)]
    return Corpus([d for d, _ in docs], queries, [where[i] for i in range(len(facts))], len(facts))


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fine_tune(loaded: LoadedModel, docs_path: Path, epochs: int = 30, lr: float = 3e-3, batch_size: int = 16,
              seed: int = 0, append_eos: bool = False) -> dict[str, Any]:
    """AdamW on the documents' completion tokens (the supervised tokens the index uses), in place.

    `append_eos`: train with the tokenizer's EOS after each completion, supervised (the
    grads.append_eos=true rows). Unfreezes the parameters for training and freezes them again.
    Returns steps and losses.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    rows, _ = load_rows(docs_path, tokenizer, 512, policy=TokenPolicy(append_eos=append_eos))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gen = torch.Generator().manual_seed(seed)
    model.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, steps = [], 0
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(rows), generator=gen).tolist()
        total, count = 0.0, 0
        for first in range(0, len(order), batch_size):  # shuffled minibatches of training
            chunk = [rows[i] for i in order[first:first + batch_size]]
            b = to_device(collate(chunk, pad_id), loaded.device)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            sup = b["supervised"][:, 1:]
            loss = F.cross_entropy(logits[:, :-1][sup].float(), b["input_ids"][:, 1:][sup])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            total += loss.item() * int(sup.sum())
            count += int(sup.sum())
        losses.append(total / count)
    model.requires_grad_(False)
    model.eval()
    return {"epochs": epochs, "steps": steps, "lr": lr, "batch_size": batch_size,
            "loss_first_epoch": losses[0], "loss_last_epoch": losses[-1], "seconds": time.perf_counter() - start}


def fine_tuned_model(base: ModelConfig, docs_path: Path, out_dir: Path, **kw: Any) -> tuple[LoadedModel, dict]:
    """Fine-tune `base` on the documents, save it with its tokenizer to out_dir, load it back."""
    loaded = load_model(base, device=torch.device("cpu"))
    info = fine_tune(loaded, docs_path, **kw)
    loaded.model.save_pretrained(out_dir)
    loaded.tokenizer.save_pretrained(out_dir)
    return load_model(ModelConfig(name=str(out_dir), precision="float32"), device=torch.device("cpu")), info


def target_ranks(results: list[dict[str, Any]], targets: list[int]) -> list[int | None]:
    """1-based rank of each query's target among the ranked rows (None if not in the list)."""
    ranked: dict[int, list[int]] = {}
    for r in results:
        if r["query"] != "aggregate":
            ranked.setdefault(r["query"], []).append(r["row_id"])
    out = []
    for q, target in enumerate(targets):
        rows = ranked.get(q, [])
        out.append(rows.index(target) + 1 if target in rows else None)
    return out


def metrics(ranks: list[int | None]) -> dict[str, float]:
    n = len(ranks)
    return {"recall@1": sum(r == 1 for r in ranks if r) / n,
            "recall@10": sum(r <= 10 for r in ranks if r) / n,
            "mrr": sum(1.0 / r for r in ranks if r) / n}


def evaluate(loaded: LoadedModel, model_cfg: ModelConfig, corpus: Corpus, work: Path,
             grid: list[tuple[str, int | None, str]], tag: str, append_eos: bool = False) -> list[dict[str, Any]]:
    """Index the documents once per grid entry and rank every query style against it."""
    docs_path = work / "docs.jsonl"
    query_paths = {s: write_jsonl(work / f"queries_{s}.jsonl", corpus.queries[s]) for s in QUERY_STYLES}
    n_docs = len(corpus.docs)
    quiet = Console(stderr=True, quiet=True)
    out = []
    for projection, dim, dtype in grid:
        grads = GradsConfig(data_path=str(docs_path), batch_size=16, module_filter=None,
                            projection="kronecker" if projection == "raw" else projection,
                            projection_dim=dim, storage_dtype=dtype, rows_per_shard=4096, append_eos=append_eos,
                            preconditioner="none")  # cosine / dot only (dense rows cannot hold K-FAC factors)
        index_dir = work / f"index_{tag}_{projection}_{dim}_{dtype}_eos{int(append_eos)}"
        start = time.perf_counter()
        summary = build_index(model_cfg, grads, index_dir, quiet, loaded=loaded)
        index_s = time.perf_counter() - start
        if summary.get("n_rows", n_docs) != n_docs:
            raise RuntimeError(f"index has {summary.get('n_rows')} rows, expected {n_docs}")
        for style in QUERY_STYLES:
            start = time.perf_counter()
            results = rank(index_dir, query_paths[style], top_k=n_docs, score="cosine", aggregate="mean",
                           loaded=loaded)
            out.append({"model": tag, "projection": projection, "projection_dim": dim, "storage_dtype": dtype,
                        "query": style, "append_eos": append_eos, "index_dir": str(index_dir),
                        "row_width": summary.get("row_width"), "index_s": index_s,
                        "rank_s": time.perf_counter() - start,
                        **metrics(target_ranks(results, corpus.targets))})
    return out


def run(n_entities: int = 40, epochs: int = 30, grid: list[tuple[str, int | None, str]] | None = None,
        baseline: bool = True, seed: int = 0) -> dict[str, Any]:
    """The whole benchmark; returns {"n_docs", "n_queries", "chance", "fine_tune", "rows"}."""
    grid = FULL_GRID if grid is None else grid
    torch.manual_seed(seed)
    corpus = make_corpus(n_entities, seed=seed)
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    with tempfile.TemporaryDirectory(prefix="planted_") as tmp:
        work = Path(tmp)
        docs_path = write_jsonl(work / "docs.jsonl", corpus.docs)
        tuned, info = fine_tuned_model(base, docs_path, work / "fine_tuned", epochs=epochs, seed=seed)
        rows = evaluate(tuned, ModelConfig(name=str(work / "fine_tuned"), precision="float32"), corpus, work,
                        grid, "fine-tuned")
        if baseline:
            rows += evaluate(load_model(base, device=torch.device("cpu")), base, corpus, work, grid, "base")
    n_docs = len(corpus.docs)
    return {"n_entities": n_entities, "n_docs": n_docs, "n_queries": corpus.n_facts,
            "chance": {"recall@1": 1 / n_docs, "recall@10": min(1.0, 10 / n_docs)},
            "fine_tune": info, "module_filter": None, "score": "cosine", "rows": rows}


EOS_GRID = [("raw", None, "float32"), ("kronecker", 256, "float32")]


def _eos_share(without_dir: Path, with_dir: Path) -> dict[str, float]:
    """From two raw-gradient indexes of the same rows (sum reduction, so the gradient with EOS is
    the completion's plus the EOS token's): median over rows of |g_eos| / |g_with|, and of the
    cosine between the row with EOS and the completion-only row."""
    from gradian.index.reader import IndexReader

    g_without = torch.cat([g for _, g, _ in IndexReader(without_dir).shards()])
    g_with = torch.cat([g for _, g, _ in IndexReader(with_dir).shards()])
    share = (g_with - g_without).norm(dim=1) / g_with.norm(dim=1)
    cos = F.cosine_similarity(g_with, g_without, dim=1)
    return {"eos_norm_share_median": share.median().item(), "cosine_with_vs_without_median": cos.median().item()}


def eos_study(n_entities: int = 40, epochs: int = 30, seed: int = 0) -> dict[str, Any]:
    """Fine-tune with and without EOS; index each under both grads.append_eos values."""
    torch.manual_seed(seed)
    corpus = make_corpus(n_entities, seed=seed)
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    rows, shares = [], []
    with tempfile.TemporaryDirectory(prefix="planted_eos_") as tmp:
        work = Path(tmp)
        docs_path = write_jsonl(work / "docs.jsonl", corpus.docs)
        for trained_eos in (False, True):
            out = work / f"fine_tuned_eos{int(trained_eos)}"
            tuned, info = fine_tuned_model(base, docs_path, out, epochs=epochs, seed=seed, append_eos=trained_eos)
            tag = f"trained {'with' if trained_eos else 'without'} EOS"
            found = []
            for index_eos in (False, True):
                found += evaluate(tuned, ModelConfig(name=str(out), precision="float32"), corpus, work, EOS_GRID,
                                  f"eos{int(trained_eos)}", append_eos=index_eos)
            for r in found:
                r["model"] = tag
            raw = {r["append_eos"]: Path(r["index_dir"]) for r in found if r["projection"] == "raw"}
            shares.append({"model": tag, "loss_last_epoch": info["loss_last_epoch"], **_eos_share(raw[False], raw[True])})
            rows += found
    return {"n_entities": n_entities, "n_docs": len(corpus.docs), "epochs": epochs, "rows": rows, "shares": shares}


def print_eos_study(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"grads.append_eos on planted facts ({report['n_docs']} documents, {report['epochs']} epochs)")
    for col in ("model", "projection", "dim", "append_eos", "query", "recall@1", "recall@10", "MRR"):
        table.add_column(col, justify="left" if col in ("model", "projection", "query") else "right")
    for r in report["rows"]:
        table.add_row(r["model"], r["projection"], str(r["projection_dim"] or "-"), str(r["append_eos"]).lower(),
                      r["query"], f"{r['recall@1']:.3f}", f"{r['recall@10']:.3f}", f"{r['mrr']:.3f}")
    console.print(table)
    for s in report["shares"]:
        console.print(f"{s['model']} (final loss {s['loss_last_epoch']:.3f}): EOS carries a median"
                      f" {100 * s['eos_norm_share_median']:.1f}% of a row's raw gradient norm; median cosine of"
                      f" the row with EOS to the completion-only row {s['cosine_with_vs_without_median']:.3f}")


# (label, projection, dim, loss, preconditioner, scores ranked on the index)
SCORE_GRID = [
    ("raw (exact)", "raw", None, "ce", "none", ("cosine", "dot")),
    ("kronecker", "kronecker", 256, "ce", "module", ("cosine", "influence", "whitened")),
    ("kronecker_orthogonal", "kronecker_orthogonal", 256, "ce", "module", ("cosine", "influence", "whitened")),
    ("kronecker, margin", "kronecker", 256, "margin", "module", ("cosine", "whitened")),
    ("kronecker_orthogonal, margin", "kronecker_orthogonal", 256, "margin", "module", ("cosine", "whitened")),
]


def scores_study(n_entities: int = 40, epochs: int = 5, seeds: int = 3, seed: int = 0) -> dict[str, Any]:
    """Recall of every (index option, score) on the cross-template corpus, mean over projection seeds."""
    import statistics

    from gradian.index.reader import IndexReader
    from gradian.rank.checks import check_compatible
    from gradian.rank.queries import query_gradients
    from gradian.rank.scores import stream_topk

    torch.manual_seed(seed)
    corpus = make_corpus(n_entities, seed=seed, cross_template=True)
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    quiet = Console(stderr=True, quiet=True)
    n_docs = len(corpus.docs)
    per_run: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="planted_scores_") as tmp:
        work = Path(tmp)
        docs_path = write_jsonl(work / "docs.jsonl", corpus.docs)
        query_paths = {s: write_jsonl(work / f"queries_{s}.jsonl", q) for s, q in corpus.queries.items()}
        tuned, info = fine_tuned_model(base, docs_path, work / "fine_tuned", epochs=epochs, seed=seed)
        model_cfg = ModelConfig(name=str(work / "fine_tuned"), precision="float32")
        for label, projection, dim, loss, preconditioner, scores in SCORE_GRID:
            for s in range(1 if projection == "raw" else seeds):
                grads = GradsConfig(data_path=str(docs_path), batch_size=16, module_filter=None,
                                    projection="kronecker" if projection == "raw" else projection, projection_dim=dim,
                                    projection_seed=s, storage_dtype="float32", loss=loss,
                                    preconditioner=preconditioner)
                index_dir = work / f"index_{projection}_{loss}_{s}"
                build_index(model_cfg, grads, index_dir, quiet, loaded=tuned)
                manifest = IndexReader(index_dir).manifest
                projector = check_compatible(manifest, tuned)
                for style, path in query_paths.items():
                    q, _ = query_gradients(manifest, tuned, projector, path)
                    for score in scores:
                        start = time.perf_counter()
                        top = stream_topk(index_dir, q, top_k=n_docs, score=score)
                        stream_s = time.perf_counter() - start
                        ranked = top["query_rows"].tolist()
                        ranks = [row.index(t) + 1 for row, t in zip(ranked, corpus.targets, strict=True)]
                        per_run.setdefault((label, score, style), []).append({**metrics(ranks), "stream_s": stream_s})
    rows = []
    for (label, score, style), runs in per_run.items():
        row = {"option": label, "score": score, "query": style, "seeds": len(runs)}
        for key in ("recall@1", "recall@10", "mrr", "stream_s"):
            values = [r[key] for r in runs]
            row[key] = statistics.mean(values)
            row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return {"n_entities": n_entities, "n_docs": n_docs, "n_queries": corpus.n_facts, "epochs": epochs,
            "seeds": seeds, "fine_tune": info, "rows": rows}


def print_scores_study(report: dict[str, Any], console: Console) -> None:
    ft = report["fine_tune"]
    table = Table(title=f"score options on planted facts, two templates ({report['n_docs']} documents,"
                        f" {report['epochs']} epochs, loss {ft['loss_first_epoch']:.2f} -> {ft['loss_last_epoch']:.2f};"
                        f" mean over {report['seeds']} projection seeds)")
    styles = sorted({r["query"] for r in report["rows"]}, key=["full", "short", "cross"].index)
    for col in ("option", "score", *[f"R@10 {s}" for s in styles], *[f"MRR {s}" for s in styles], "stream s"):
        table.add_column(col, justify="left" if col in ("option", "score") else "right")
    by_key = {(r["option"], r["score"], r["query"]): r for r in report["rows"]}
    for option, score in dict.fromkeys((r["option"], r["score"]) for r in report["rows"]):
        cells = [by_key[(option, score, s)] for s in styles]
        table.add_row(option, score, *[f"{c['recall@10']:.3f} ± {c['recall@10_sd']:.3f}" for c in cells],
                      *[f"{c['mrr']:.3f}" for c in cells], f"{sum(c['stream_s'] for c in cells):.3f}")
    console.print(table)


def print_report(report: dict[str, Any], console: Console) -> None:
    ft = report["fine_tune"]
    console.print(f"{report['n_entities']} entities, {report['n_docs']} documents ({report['n_queries']} facts +"
                  f" {report['n_docs'] - report['n_queries']} generic), {report['n_queries']} queries per style;"
                  f" all linear modules of the blocks, cosine score")
    console.print(f"fine-tune: {ft['epochs']} epochs, {ft['steps']} AdamW steps (lr {ft['lr']}, batch"
                  f" {ft['batch_size']}), loss {ft['loss_first_epoch']:.3f} -> {ft['loss_last_epoch']:.3f}"
                  f" in {ft['seconds']:.1f} s")
    table = Table(title="planted-fact attribution")
    for col in ("model", "projection", "dim", "storage", "query", "width", "recall@1", "recall@10", "MRR",
                "index s", "rank s"):
        table.add_column(col, justify="left" if col in ("model", "projection", "storage", "query") else "right")
    for r in report["rows"]:
        table.add_row(r["model"], r["projection"], str(r["projection_dim"] or "-"), r["storage_dtype"], r["query"],
                      str(r["row_width"]), f"{r['recall@1']:.3f}", f"{r['recall@10']:.3f}", f"{r['mrr']:.3f}",
                      f"{r['index_s']:.1f}", f"{r['rank_s']:.1f}")
    console.print(table)
    c = report["chance"]
    console.print(f"chance: recall@1 {c['recall@1']:.3f}, recall@10 {c['recall@10']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entities", type=int, default=40)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--small", action="store_true", help="12 entities, raw + kronecker 256 only (seconds)")
    p.add_argument("--no-baseline", action="store_true", help="skip the un-fine-tuned model")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--eos-study", action="store_true",
                   help="fine-tune with and without EOS, index under both grads.append_eos values")
    p.add_argument("--scores-study", action="store_true",
                   help="score options (projection, loss, preconditioned scores) with cross-template queries")
    p.add_argument("--seeds", type=int, default=3, help="projection seeds of --scores-study")
    args = p.parse_args(argv)
    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)  # the float32 notice, x3
    start = time.perf_counter()
    study = ((lambda: scores_study(args.entities, args.epochs, args.seeds), print_scores_study, 180)
             if args.scores_study else
             (lambda: eos_study(args.entities, args.epochs), print_eos_study, 140) if args.eos_study else None)
    if study is not None:  # the two studies print and save the same way
        measure, show, width = study
        report = measure()
        show(report, Console(width=width))
        print(f"wall time {time.perf_counter() - start:.1f} s")
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return 0
    if args.small:
        report = run(12, args.epochs, SMALL_GRID, baseline=not args.no_baseline)
    else:
        report = run(args.entities, args.epochs, FULL_GRID, baseline=not args.no_baseline)
    report["wall_s"] = time.perf_counter() - start
    console = Console(width=140)
    print_report(report, console)
    console.print(f"wall time {report['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
