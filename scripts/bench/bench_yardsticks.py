"""Benchmark: every Gradian score option on several yardsticks, in one table.

Yardsticks (each its own fine-tuned model; all recall figures are of the one target document
among all documents):

* ``A``   bench_planted_facts.make_corpus(cross_template=True): facts in one of two templates per
          attribute, queries completed in the template that entity's fact was *not* written in
          (style ``cross``); the tiny GPT-2 fixture fine-tuned --epochs epochs.
* ``B``   planted_facts_b.make_corpus_b: other entities, fact kinds, templates and prompts, queries
          that are paraphrases (a question and, for ``para``, a completion template never trained;
          ``answer``: the value alone); the same fixture fine-tuned the same way.
* ``LDS`` bench_lds.py's linear datamodeling score (--lds-subsets half-subset models), styles full
          and short.
* ``S``   (--smollm2 DIR) a fact set of B's generator fine-tuned into SmolLM2-135M on the CPU
          (--smollm2-facts facts, a few AdamW steps on a few modules), recall of ``para`` queries.
* ``S2``  (--smollm2-chat DIR) S's kind of facts (--smollm2-chat-facts), each taught by one plain
          declarative sentence (one phrasing per kind), fine-tuned in as S is (--smollm2-chat-epochs),
          queried in another register: chat turns through SmolLM2's chat template, the assistant
          answering in B's ``para`` sentence (``chat``) or a short informal answer (``chat_answer``).
          The fine-tune record has the model's top-1-of-8 fact accuracy on each phrasing.

Options, per loss (ce, margin) and width per module (--widths; kronecker, 3 projection seeds):
``cosine``, ``influence`` and ``whitened`` (module second moments, widths <= 4096), ``kfac`` and
``ekfac`` (gradian.curvature.factors), all ranked by `stream_topk` on one index built with
grads.preconditioner=module+kfac; and the exact references on raw gradients (no projection):
cosine, kfac, ekfac, and exact influence (the damped per-module second moment of the raw rows,
applied by Woodbury's identity: an n x n solve instead of a D x D one). The modules are the
MLP's two linear layers of every block (module_filter mlp), so that every width up to 16384 has
a Kronecker factorisation on the fixture (d_model 64, d_mlp 256).

Also measured on the widest index that has every score: the seconds of `stream_topk` per score
(ratios to cosine in the same process) and the bytes of each stored part.

    python scripts/bench/bench_yardsticks.py [--widths 256,1024,4096,16384] [--seeds 3] [--losses ce,margin]
        [--yardsticks A,B,LDS] [--lds-subsets 16] [--smollm2 DIR] [--smollm2-seeds 1] [--work DIR]
        [--fisher empirical,sampled] [--projections kronecker,kronecker_orthogonal,whitened] [--json out.json]

Every (fisher, projection) pair builds its own indexes; the tables show them as a "projection,
fisher" column (rows of JSON files from before these options read as "kronecker, empirical").
A projection written KIND+spectrum (kronecker_orthogonal+spectrum) also sets
grads.width_allocation=spectrum; its rows record the modules' widths.

--row-formats dense,factored:C also builds every projected index with factored rows
(grads.row_format=factored, grads.row_rank=C) at the projection width whose rank-C factors store as
many numbers per module as the dense width does (yardsticks_factored.equal_bytes_width): its rows
sit under the dense width with a setup label "..., factored c=C @W'", and a last table sets each
beside its dense row (recall@10 / LDS, mean ± sd over seeds, bytes per row, rank time ratio).
--row-formats signs:P builds sign rows (grads.row_format=signs, projection P, preconditioner none) at
16 x the dense width: the bytes of the product's float16 dense row (yardsticks_factored.sign_width);
they rank by cosine only and the last table sets them beside the dense row's every score.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
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
from gradian.build.indexer import build_index  # noqa: E402
from gradian.index.reader import IndexReader
from gradian.rank.checks import check_compatible
from gradian.rank.queries import query_gradients
from gradian.rank.scores import stream_topk
from gradian.settings.grads import GradsConfig  # noqa: E402
from scripts.bench.bench_planted_facts import fine_tuned_model, make_corpus, write_jsonl  # noqa: E402
from scripts.bench.planted_facts_b import make_corpus_b  # noqa: E402
from scripts.bench.yardsticks_factored import (  # noqa: E402
    compact,
    comparison_markdown,
    equal_bytes_width,
    parse_row_formats,
    row_format_label,
    sign_width,
)

MODULES = ["mlp"]
# The tables' reference damping: a kfac / ekfac row without "λ=" was ranked at 0.1 (the default
# until the damping sweep; gradian.curvature.factors.CURVATURE_DAMPING is 0.01 since: the "λ=0.01" rows).
DAMPING = 0.1


def score_matrix(index_dir: Path, q: torch.Tensor, score: str, n_docs: int,
                 damping: float | None = None) -> tuple[torch.Tensor, float]:
    """(Q, n_docs) scores of every row and the seconds `stream_topk` took."""
    start = time.perf_counter()
    top = stream_topk(index_dir, q, top_k=n_docs, score=score, damping=damping)
    seconds = time.perf_counter() - start
    out = torch.zeros(q.shape[0], n_docs, dtype=torch.float64)
    out.scatter_(1, top["query_rows"], top["query_scores"].double())
    return out, seconds


def exact_influence(index_dir: Path, q: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Σ_m q_mᵀ (F_m + λ_m I)⁻¹ g_m on raw rows, F_m = G_mᵀ G_m / n, λ_m = damping · tr(F_m) / D_m,
    by Woodbury: (F + λI)⁻¹ q = (q - G_mᵀ (nλ I + G_m G_mᵀ)⁻¹ G_m q) / λ. (Q, n) float64."""
    reader = IndexReader(index_dir)
    rows = torch.cat([g for _, g, _ in reader.shards()]).double()
    n = rows.shape[0]
    out = torch.zeros(q.shape[0], n, dtype=torch.float64)
    start = 0
    for entry in reader.manifest["projection"]["modules"].values():
        width = entry["width"]
        g, qm = rows[:, start:start + width], q[:, start:start + width].double()
        lam = damping * (g * g).sum() / n / width
        gram = g @ g.T + n * lam * torch.eye(n, dtype=torch.float64)
        solved = (qm - (torch.linalg.solve(gram, g @ qm.T)).T @ g) / lam  # (Q, D)
        out += solved @ g.T
        start += width
    return out


def planted_metrics(scores: torch.Tensor, targets: list[int]) -> dict[str, float]:
    order = scores.argsort(dim=1, descending=True, stable=True)
    ranks = [(order[i] == t).nonzero().item() + 1 for i, t in enumerate(targets)]
    n = len(ranks)
    return {"r1": sum(r == 1 for r in ranks) / n, "r10": sum(r <= 10 for r in ranks) / n,
            "mrr": sum(1 / r for r in ranks) / n}


def stored_bytes(index_dir: Path) -> dict[str, int]:
    """Bytes of the rows, the second moments and the K-FAC factors + curvature file."""
    from safetensors import safe_open

    out = {"rows": 0, "second_moment": 0, "kfac": 0}
    reader = IndexReader(index_dir)
    for name in reader.manifest["shards"]:
        with safe_open(str(index_dir / name), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                t = fh.get_slice(key)
                size = 1
                for d in t.get_shape():
                    size *= d
                size *= {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}[t.get_dtype()]
                part = "rows" if key in ("grads", "norms", "rows", "sources") else (
                    "second_moment" if key == "second_moment" else "kfac")
                out[part] += size
    curv = index_dir / "curvature.safetensors"
    if curv.is_file():
        out["kfac"] += curv.stat().st_size
    whitened = index_dir / "projection.safetensors"  # grads.projection=whitened: its stored matrices
    out["projection"] = whitened.stat().st_size if whitened.is_file() else 0
    return out


class Yardstick:
    """A fine-tuned model, its documents, query files per style, and how to score a matrix."""

    def __init__(self, name: str, model_dir: str, docs: Path, queries: dict[str, Path], targets: list[int] | None,
                 lds_data: tuple | None = None, precision: str = "float32") -> None:
        self.name, self.model_dir, self.docs, self.queries, self.targets = name, model_dir, docs, queries, targets
        self.lds_data = lds_data  # (subsets, style -> losses)
        self.n_docs = sum(1 for line in docs.read_text().splitlines() if line.strip())
        self.precision = precision

    def evaluate(self, style: str, scores: torch.Tensor) -> dict[str, float]:
        if self.lds_data is None:
            return planted_metrics(scores, self.targets)
        from scripts.bench.bench_lds import lds

        subsets, losses = self.lds_data
        mean, se = lds(scores.tolist(), subsets, losses[style])
        return {"lds": mean, "lds_se": se}


SCORES = ("cosine", "influence", "whitened", "kfac", "ekfac")


def damped_label(score: str, damping: float) -> str:
    """The table's name of a curvature score at a damping other than the default."""
    return score if damping == DAMPING else f"{score} λ={damping:g}"


def setup_label(projection: str, fisher: str) -> str:
    """The tables' name of an index's projection kind and Fisher (the first is the old default)."""
    kind, plus, allocation = projection.partition("+")  # "+spectrum": grads.width_allocation=spectrum
    return f"{'orthogonal' if kind == 'kronecker_orthogonal' else kind}{plus}{allocation}, {fisher}"


DEFAULT_SETUP = setup_label("kronecker", "empirical")  # rows of JSON files written before --projections


def run_yardstick(ys: Yardstick, widths: list[int], seeds: int, losses: list[str], work: Path,
                  console: Console, batch_size: int = 16, wanted: tuple[str, ...] = SCORES,
                  dampings: tuple[float, ...] = (DAMPING,), raw_too: bool = True,
                  fisher: str = "empirical", projection: str = "kronecker",
                  row_formats: tuple[tuple[str, int | None], ...] = (("dense", None),)) -> list[dict[str, Any]]:
    """Rows of every (loss, width, seed, row format) index's scores; `row_formats` ("factored", c) builds
    the width's index also with factored rows at the equal-bytes width (`equal_bytes_width`), recorded
    under the dense width with its setup label saying so."""
    from circuitkit.models.linear_modules import module_shapes, select_modules
    from circuitkit.models.loading import load_model

    model_cfg = ModelConfig(name=ys.model_dir, precision=ys.precision)
    loaded = load_model(model_cfg, device=torch.device("cpu"))
    quiet = Console(stderr=True, quiet=True)
    modules = getattr(ys, "modules", MODULES)
    out = []
    plan = ([(loss, None, 0, "dense", None) for loss in losses] if raw_too else []) + [
        (loss, w, s, fmt, rank) for loss in losses for w in widths for s in range(seeds) for fmt, rank in row_formats]
    kind, _, allocation = projection.partition("+")  # "kronecker_orthogonal+spectrum": grads.width_allocation
    shapes = module_shapes(select_modules(loaded.model, loaded.adapter, modules))
    for loss, width, seed, row_format, rank in plan:
        raw = width is None
        factored, signs = row_format == "factored", row_format == "signs"
        # factored rows store the dense width's bytes at a wider projection; sign rows a float16 row's
        built_width = (equal_bytes_width(width, rank, shapes) if factored else sign_width(width, shapes) if signs
                       else width)
        # per-module widths (spectrum) have no equal-width module second moments; factored rows none at all
        module = (not raw and not factored and not signs and not allocation and width <= 4096
                  and {"influence", "whitened"} & set(wanted))
        precond = "none" if signs else "module+kfac" if module else "kfac"
        grads = GradsConfig(data_path=str(ys.docs), batch_size=batch_size, module_filter=modules,
                            projection=rank if signs else kind, projection_dim=built_width, projection_seed=seed,
                            storage_dtype="float32", loss=loss, preconditioner=precond, fisher=fisher,
                            width_allocation=(allocation or "uniform") if width else "uniform",
                            row_format=row_format, **({"row_rank": rank} if factored else {}))
        label = row_format_label(row_format, rank, built_width)
        index_dir = work / f"{ys.name}_{loss}_{width or 'raw'}_{seed}_{projection}_{fisher}{label.replace(' ', '_')}"
        start = time.perf_counter()
        build_index(model_cfg, grads, index_dir, quiet, loaded=loaded)
        index_s = time.perf_counter() - start
        manifest = IndexReader(index_dir).manifest
        projector = check_compatible(manifest, loaded, index_dir)
        scores = ["cosine"] if signs else [
            s for s in wanted if s in ("cosine", "kfac", "ekfac") or (module and s in ("influence", "whitened"))]
        sizes = stored_bytes(index_dir)
        for style, path in ys.queries.items():
            q, _ = query_gradients(manifest, loaded, projector, path, batch_size=batch_size)
            for score in scores:
                for damping in (dampings if score in ("kfac", "ekfac") else (None,)):
                    matrix, seconds = score_matrix(index_dir, q, score, ys.n_docs, damping)
                    out.append({"yardstick": ys.name, "style": style, "loss": loss, "width": width or "raw",
                                "setup": setup_label(projection if width else "kronecker", fisher) + label,
                                "seed": seed, "score": score if damping is None else damped_label(score, damping),
                                "stream_s": seconds, "index_s": index_s, "bytes": sizes,
                                **({"widths": [e["width"] for e in manifest["projection"]["modules"].values()]}
                                   if allocation else {}),
                                **ys.evaluate(style, matrix)})
            if raw and "influence" in wanted:
                start = time.perf_counter()
                matrix = exact_influence(index_dir, q)
                out.append({"yardstick": ys.name, "style": style, "loss": loss, "width": "raw", "seed": seed,
                            "setup": setup_label("kronecker", fisher),
                            "score": "influence", "stream_s": time.perf_counter() - start, "index_s": index_s,
                            "bytes": sizes, **ys.evaluate(style, matrix)})
        console.print(f"[dim]{ys.name}: loss {loss}, width {width or 'raw'}{label}, seed {seed} done"
                      f" (index {index_s:.1f} s)[/dim]")
        if not raw:
            import shutil

            shutil.rmtree(index_dir, ignore_errors=True)  # disk: keep only the raw references
    return out


PEER_LABELS = {
    "kronfluence": {"scores": "ekfac (Kronfluence)", "scores_default_damping": "ekfac, damping 1e-8 (Kronfluence)",
                    "scores_empirical": "ekfac, empirical Fisher (Kronfluence)"},
    "traker": {"scores": "TRAK score (traker)", "scores_cosine": "feature cosine (traker)"},
}
PEER_ORDER = [v for labels in PEER_LABELS.values() for v in labels.values()]


def run_peer(ys: Yardstick, tool: str, work: Path, console: Console, timeout: float = 3000,
             total_dim: int = 0, empirical: bool = False) -> list[dict[str, Any]]:
    """A peer's worker (scripts/peers/) on the yardstick's model, documents, queries and modules.

    total_dim: the projected width of a projecting peer (traker); empirical: Kronfluence also fits
    its factors with the empirical Fisher (the data's labels, as Gradian)."""
    from circuitkit.models.linear_modules import select_modules
    from circuitkit.models.loading import load_model
    from scripts.bench.bench_peers import run_worker

    loaded = load_model(ModelConfig(name=ys.model_dir, precision=ys.precision), device=torch.device("cpu"))
    modules = [n for n, _ in select_modules(loaded.model, loaded.adapter, getattr(ys, "modules", MODULES))]
    del loaded
    tool_work = work / f"{tool}_{ys.name}"
    tool_work.mkdir(parents=True, exist_ok=True)
    spec = {"model_dir": ys.model_dir, "docs": str(ys.docs), "queries": {s: str(p) for s, p in ys.queries.items()},
            "modules": modules, "per_module_dim": 0, "total_dim": total_dim, "batch_size": 8, "max_length": 256,
            "seed": 0, "work_dir": str(tool_work), "empirical_fisher": empirical}
    start = time.perf_counter()
    result = run_worker(tool, spec, tool_work, timeout)
    console.print(f"[dim]{tool} on {ys.name}: {time.perf_counter() - start:.0f} s[/dim]")
    if result.get("error"):
        console.print(f"{tool} on {ys.name} failed: {str(result['error']).splitlines()[0]}")
        return []
    out = []
    for key, label in PEER_LABELS[tool].items():
        if total_dim:
            label = label.replace(")", f", {total_dim} total)")
        for style, matrix in (result.get(key) or {}).items():
            out.append({"yardstick": ys.name, "style": style, "loss": "ce", "width": "full", "seed": 0,
                        "score": label, "stream_s": result.get("query_seconds") or 0.0,
                        "index_s": result.get("index_seconds"), "bytes": {"rows": 0, "second_moment": 0, "kfac": 0},
                        "version": result.get("version"),
                        **ys.evaluate(style, torch.tensor(matrix, dtype=torch.float64))})
    return out


def planted_a(work: Path, entities: int, epochs: int) -> Yardstick:
    corpus = make_corpus(entities, seed=0, cross_template=True)
    docs = write_jsonl(work / "a_docs.jsonl", corpus.docs)
    queries = {"cross": write_jsonl(work / "a_queries_cross.jsonl", corpus.queries["cross"])}
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    _, info = fine_tuned_model(base, docs, work / "a_model", epochs=epochs, seed=0)
    ys = Yardstick("A", str(work / "a_model"), docs, queries, corpus.targets)
    ys.fine_tune = info
    return ys


def planted_b(work: Path, entities: int, epochs: int) -> Yardstick:
    corpus = make_corpus_b(entities, seed=0)
    docs = write_jsonl(work / "b_docs.jsonl", corpus.docs)
    queries = {s: write_jsonl(work / f"b_queries_{s}.jsonl", q) for s, q in corpus.queries.items()}
    base = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    _, info = fine_tuned_model(base, docs, work / "b_model", epochs=epochs, seed=0)
    ys = Yardstick("B", str(work / "b_model"), docs, queries, corpus.targets)
    ys.fine_tune = info
    return ys


def lds_yardstick(work: Path, subsets: int, console: Console) -> Yardstick:
    from scripts.bench.bench_lds import subset_losses
    from scripts.bench.bench_peers import prepare

    lds_work = work / "lds"
    lds_work.mkdir(parents=True, exist_ok=True)
    data = prepare(lds_work, "tiny", 12, 10)
    subs, losses = subset_losses(data, lds_work, subsets, 10, 0, console)
    ys = Yardstick("LDS", data["model_dir"], Path(data["docs"]), {s: Path(p) for s, p in data["queries"].items()},
                   None, lds_data=(subs, losses))
    ys.fine_tune = data["fine_tune"]
    return ys


SMOLLM2_FORMAT = 2  # bump when the fact set, the trained modules or the training changes


def fine_tuned_smollm2(model_dir: str, doc_rows: list[dict], epochs: int, console: Console, prefix: str = "smollm2",
                       key_extra: dict[str, Any] | None = None, lr: float = 1e-3, batch: int = 8) -> tuple[Path, dict]:
    """SmolLM2 fine-tuned on `doc_rows` (only the MLP down projections of the last 4 layers train, so
    the backward stops there; `epochs` epochs of AdamW), and its training record.

    Cached under $CIRCUITKIT_CACHE/yardsticks/<prefix>-<key>/, the key a sha256 of the base model's
    config and weights, the documents and the training settings (`key_extra` included): a rerun
    reuses the model (the fine-tuning is deterministic on the CPU: seeded order, one thread)."""
    import hashlib
    import shutil

    from circuitkit.fixtures.cache import cache_root
    from circuitkit.models.loading import load_model
    from scripts.bench.bench_planted_facts import fine_tune

    key = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".json", ".safetensors")):
            key.update(name.encode())
            key.update(hashlib.sha256((Path(model_dir) / name).read_bytes()).digest())
    key.update(json.dumps({"docs": doc_rows, "epochs": epochs, "lr": lr, "batch": batch, **(key_extra or {})},
                          sort_keys=True).encode())
    cached = cache_root() / "yardsticks" / f"{prefix}-{key.hexdigest()[:16]}"
    if not (cached / "info.json").is_file():
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        docs = write_jsonl(tmp / "s_docs.jsonl", doc_rows)
        loaded = load_model(ModelConfig(name=model_dir, precision="float32"), device=torch.device("cpu"))
        model = loaded.model
        n_layers = model.config.num_hidden_layers
        trained = [f"model.layers.{i}.mlp.down_proj" for i in range(n_layers - 4, n_layers)]
        # Only the trained modules' weights get gradients (fine_tune unfreezes everything: wrap it).
        start = time.perf_counter()
        original = model.requires_grad_

        def restricted(flag: bool = True):
            original(False)
            if flag:
                for name in trained:
                    model.get_submodule(name).weight.requires_grad_(True)
            return model

        model.requires_grad_ = restricted
        info = fine_tune(loaded, docs, epochs=epochs, lr=lr, batch_size=batch, seed=0)
        model.requires_grad_ = original
        model.requires_grad_(False)
        model.save_pretrained(tmp / "model")
        loaded.tokenizer.save_pretrained(tmp / "model")
        info |= {"trained_modules": trained, "wall_s": time.perf_counter() - start, "docs": len(doc_rows),
                 "threads": torch.get_num_threads()}
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
        console.print(f"SmolLM2 fine-tune (cached in {cached}): {info}")
    return cached, json.loads((cached / "info.json").read_text())


def smollm2_yardstick(work: Path, model_dir: str, n_facts: int, epochs: int, console: Console) -> Yardstick:
    """Fine-tune SmolLM2 on B-style facts (ceil(n_facts / 5) entities x 5 kinds + n_facts / 2
    distractors), only the MLP down projections of the last 4 layers (the backward stops there),
    `epochs` epochs of AdamW (batch 8, lr 1e-3); queries ``para`` and ``answer`` of every fact.
    The model is cached (`fine_tuned_smollm2`)."""
    corpus = make_corpus_b(-(-n_facts // 5), n_generic=n_facts // 2, seed=3)
    cached, info = fine_tuned_smollm2(model_dir, corpus.docs, epochs, console, key_extra={"format": SMOLLM2_FORMAT})
    info.setdefault("facts", corpus.n_facts)
    docs = write_jsonl(work / "s_docs.jsonl", corpus.docs)
    queries = {style: write_jsonl(work / f"s_queries_{style}.jsonl", q) for style, q in corpus.queries.items()}
    ys = Yardstick("S", str(cached / "model"), docs, queries, corpus.targets)
    ys.fine_tune = info
    ys.modules = info["trained_modules"]
    return ys


# S2: S's kind of facts, taught in one phrasing, asked in another register (a chat turn).
S2_FORMAT = 1  # bump when the S2 set or its training changes
S2_PROMPT = "From the archive:"  # every document's prompt: the sentences are the teaching
# A short, informal assistant answer per kind; the value keeps its leading space (the token the
# documents taught), and no document or question uses these words.
S2_SHORT = {"instrument": "Oh, the {v}.", "colour": "Definitely {v}.", "city": "Over in {v}.",
            "language": "Mostly {v}.", "commute": "Usually by {v}."}


def s2_fact_rows(entity: str, kind: str, value: str) -> dict[str, dict]:
    """One fact in each S2 phrasing: ``taught`` (the document), ``chat`` (a chat turn whose answer is
    B's `para` sentence), ``chat_answer`` (a chat turn with a short informal answer)."""
    from scripts.bench.planted_facts_b import KINDS

    spec = KINDS[kind]
    question = {"role": "user", "content": spec["question"].format(e=entity)}
    return {
        "taught": {"prompt": S2_PROMPT, "completion": spec["docs"][0].format(e=entity, v=value)},
        "chat": {"messages": [question, {"role": "assistant",
                                         "content": spec["para"].format(e=entity, v=value).strip()}]},
        "chat_answer": {"messages": [question, {"role": "assistant", "content": S2_SHORT[kind].format(v=value)}]},
    }


S2_STYLES = ("chat", "chat_answer")


def make_corpus_s2(n_facts: int, n_generic: int | None = None, seed: int = 5):
    """The S2 set: n_facts facts of planted_facts_b's kinds (entities x 5 kinds, the last entity's
    kinds cut to fit), each taught by one document in one plain declarative phrasing per kind (the
    kind's first template, one fixed prompt), n_generic distractors (default n_facts / 2), shuffled;
    queries of `S2_STYLES` (chat turns, rendered by the model's chat template). Returns
    (planted_facts_b.CorpusB, facts as (entity, kind, value)). Deterministic in the seed."""
    import random

    from circuitkit.fixtures.models import synthetic_corpus
    from scripts.bench.planted_facts_b import FIRST, KINDS, SECOND, CorpusB

    rng = random.Random(seed + 202)
    names = [a + b for a in FIRST for b in SECOND]
    entities = rng.sample(names, -(-n_facts // len(KINDS)))
    facts = [(e, kind, rng.choice(spec["values"])) for e in entities for kind, spec in KINDS.items()][:n_facts]
    docs: list[tuple[dict, int | None]] = [(s2_fact_rows(*f)["taught"], i) for i, f in enumerate(facts)]
    generic = rng.sample(synthetic_corpus(n_sentences=300, seed=seed + 11), n_facts // 2 if n_generic is None else n_generic)
    docs += [({"prompt": S2_PROMPT, "completion": " " + s}, None) for s in generic]
    rng.shuffle(docs)
    where = {fact: row for row, (_, fact) in enumerate(docs) if fact is not None}
    queries = {style: [s2_fact_rows(*f)[style] for f in facts] for style in S2_STYLES}
    return CorpusB([d for d, _ in docs], queries, [where[i] for i in range(len(facts))], len(facts)), facts


def fact_accuracy(loaded, facts: list[tuple[str, str, str]], work: Path, batch_size: int = 16) -> dict[str, float]:
    """Did the model learn the facts? Per phrasing (taught, chat, chat_answer), the share of facts whose
    true value has the highest summed log-probability of the supervised tokens among the kind's 8
    values (chance 1/8), the mean rank of the true value (1 = first) and each fact's rank."""
    from gradian.data.batch import collate
    from gradian.data.rows import load_rows
    from scripts.bench.planted_facts_b import KINDS

    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = {}
    for phrasing in ("taught", *S2_STYLES):
        rows = [s2_fact_rows(e, k, c)[phrasing] for e, k, _ in facts for c in KINDS[k]["values"]]
        tokenized, _ = load_rows(write_jsonl(work / f"s2_accuracy_{phrasing}.jsonl", rows), tok, 512)
        logprob = []
        with torch.no_grad():
            for first in range(0, len(tokenized), batch_size):
                b = collate(tokenized[first:first + batch_size], pad)
                hidden = loaded.adapter.base(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                sup = b["supervised"][:, 1:]  # the unembedding only where a supervised token is predicted
                logits = loaded.adapter.unembed(hidden.last_hidden_state[:, :-1][sup]).float()
                token_lp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:][sup][:, None])[:, 0]
                per_row = torch.zeros(sup.shape[0], dtype=torch.float64)
                per_row.index_add_(0, sup.nonzero()[:, 0], token_lp.double())
                logprob += per_row.tolist()
        ranks, at = [], 0
        for _, kind, value in facts:
            values = KINDS[kind]["values"]
            scores = logprob[at:at + len(values)]
            at += len(values)
            truth = scores[values.index(value)]
            ranks.append(1 + sum(s > truth for s in scores))
        out[f"{phrasing}_acc"] = sum(r == 1 for r in ranks) / len(ranks)
        out[f"{phrasing}_mean_rank"] = sum(ranks) / len(ranks)
        out[f"{phrasing}_ranks"] = ranks
    return out


def smollm2_chat_yardstick(work: Path, model_dir: str, n_facts: int, epochs: int, console: Console,
                           lr: float = 1e-3) -> Yardstick:
    """S2: `make_corpus_s2` fine-tuned into SmolLM2 as S is (`fine_tuned_smollm2`), queried with chat
    turns; `fine_tune` also records `fact_accuracy` of the base and the fine-tuned model."""
    from circuitkit.models.loading import load_model

    corpus, facts = make_corpus_s2(n_facts)
    cached, info = fine_tuned_smollm2(model_dir, corpus.docs, epochs, console, prefix="smollm2chat",
                                      key_extra={"format": S2_FORMAT, "set": "S2"}, lr=lr)
    accuracy_file = cached / "accuracy.json"
    if "chat_ranks" not in json.loads(accuracy_file.read_text() if accuracy_file.is_file() else "{}").get("fine_tuned", {}):
        accuracy = {}
        for label, path in (("base", model_dir), ("fine_tuned", str(cached / "model"))):
            loaded = load_model(ModelConfig(name=path, precision="float32"), device=torch.device("cpu"))
            accuracy[label] = fact_accuracy(loaded, facts, work)
            del loaded
        accuracy_file.write_text(json.dumps(accuracy, indent=1))
    info |= {"facts": corpus.n_facts, "accuracy": json.loads(accuracy_file.read_text())}
    console.print("S2 fact accuracy (top-1 of 8 values; base, fine-tuned): "
                  + str({m: {k: v for k, v in a.items() if not k.endswith("_ranks")} for m, a in info["accuracy"].items()}))
    docs = write_jsonl(work / "s2_docs.jsonl", corpus.docs)
    queries = {style: write_jsonl(work / f"s2_queries_{style}.jsonl", q) for style, q in corpus.queries.items()}
    ys = Yardstick("S2", str(cached / "model"), docs, queries, corpus.targets)
    ys.fine_tune = info
    ys.modules = info["trained_modules"]
    return ys


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over seeds (and styles kept apart) per (yardstick, style, loss, width, score)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["yardstick"], r["style"], r["loss"], str(r["width"]), r["score"],
                           r.get("setup", DEFAULT_SETUP)), []).append(r)
    out = []
    for (ys, style, loss, width, score, setup), runs in groups.items():
        entry = {"yardstick": ys, "style": style, "loss": loss, "width": width, "score": score, "setup": setup,
                 "seeds": len(runs),
                 "stream_s": statistics.mean(r["stream_s"] for r in runs), "bytes": runs[0]["bytes"],
                 "index_s": statistics.mean(r.get("index_s", 0.0) for r in runs)}
        for key in ("r1", "r10", "mrr", "lds"):
            if key in runs[0]:
                values = [r[key] for r in runs]
                entry[key] = statistics.mean(values)
                entry[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out.append(entry)
    return out


def _row_key(k: tuple[str, str, str, str]) -> tuple:
    """Rows by loss, width (exact and the peers last), score (SCORES order, then each score's
    dampings in increasing order, then the peers), then setup."""
    loss, width, score, setup = k
    base, _, damp = score.partition(" λ=")
    if base in SCORES:
        rank = (SCORES.index(base), 1 if damp else 0, float(damp or 0), "")
    else:
        peer = next((i for i, p in enumerate(PEER_ORDER) if score.startswith(p.split(" (")[0])), len(PEER_ORDER))
        rank = (len(SCORES) + peer, 0, 0.0, score)
    return (loss, {"raw": 10**9, "full": 10**10}.get(width) or int(width), rank, setup)


def print_table(summary: list[dict[str, Any]], console: Console) -> None:
    columns = sorted({(s["yardstick"], s["style"]) for s in summary},
                     key=lambda c: (["A", "B", "S", "S2", "LDS"].index(c[0]), c[1]))
    table = Table(title="Gradian score options on every yardstick (mean over projection seeds; recall@1 / recall@10,"
                        " LDS)")
    for col in ("loss", "width", "score", "projection, fisher", *[f"{y} {s}" for y, s in columns]):
        table.add_column(col, justify="left" if col in ("loss", "score", "projection, fisher") else "right")
    by = {(s["yardstick"], s["style"], s["loss"], s["width"], s["score"], s.get("setup", DEFAULT_SETUP)): s
          for s in summary}
    keys = sorted({(s["loss"], s["width"], s["score"], s.get("setup", DEFAULT_SETUP)) for s in summary}, key=_row_key)
    for loss, width, score, setup in keys:
        cells = []
        for y, s in columns:
            e = by.get((y, s, loss, width, score, setup))
            if e is None:
                cells.append("-")
            elif "lds" in e:
                cells.append(f"{e['lds']:.3f}")
            else:
                cells.append(f"{e['r1']:.3f} / {e['r10']:.3f}")
        table.add_row(loss, {"raw": "exact", "full": "peer"}.get(width, width), score,
                      "-" if width == "full" else setup, *cells)
    console.print(table)


def markdown(summary: list[dict[str, Any]]) -> str:
    """The table of `print_table` as Markdown (docs/benchmarks.md)."""
    columns = sorted({(s["yardstick"], s["style"]) for s in summary},
                     key=lambda c: (["A", "B", "S", "S2", "LDS"].index(c[0]), c[1]))
    by = {(s["yardstick"], s["style"], s["loss"], s["width"], s["score"], s.get("setup", DEFAULT_SETUP)): s
          for s in summary}
    keys = sorted({(s["loss"], s["width"], s["score"], s.get("setup", DEFAULT_SETUP)) for s in summary}, key=_row_key)
    lines = ["| loss | width | score | projection, fisher | " + " | ".join(f"{y} {s}" for y, s in columns) + " |",
             "|---|---:|---|---|" + "---:|" * len(columns)]
    for loss, width, score, setup in keys:
        cells = []
        for y, st in columns:
            e = by.get((y, st, loss, width, score, setup))
            cells.append("-" if e is None else f"{e['lds']:.3f}" if "lds" in e else f"{e['r1']:.3f} / {e['r10']:.3f}")
        lines.append(f"| {loss} | {({'raw': 'exact', 'full': 'peer'}).get(width, width)} | {score} |"
                     f" {'-' if width == 'full' else setup} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def setup_costs(summary: list[dict[str, Any]]) -> str:
    """Markdown: mean index seconds (over seeds) and disk per (yardstick, width, projection setup), for
    the first loss's rows; the whitened projection's time includes its factor pass."""
    lines = ["| yardstick | width | projection, fisher | index s | rows MiB | K-FAC MiB | projection file KiB |",
             "|---|---:|---|---:|---:|---:|---:|"]
    seen = set()
    for e in summary:
        key = (e["yardstick"], e["width"], e.get("setup", DEFAULT_SETUP))
        if key in seen or e["width"] in ("full",):
            continue
        seen.add(key)
        b = e["bytes"]
        lines.append(f"| {key[0]} | {'exact' if key[1] == 'raw' else key[1]} | {key[2]} | {e.get('index_s', 0):.1f} |"
                     f" {b['rows'] / 2**20:.2f} | {b['kfac'] / 2**20:.3f} | {b.get('projection', 0) / 2**10:.1f} |")
    return "\n".join(lines)


def print_costs(summary: list[dict[str, Any]], console: Console) -> None:
    """stream_topk seconds per score relative to cosine, and stored bytes, per width (planted B, ce)."""
    table = Table(title="rank cost (stream_topk, same process, ratio to cosine) and disk per index (yardstick B, ce)")
    for col in ("width", "cosine s", "influence", "whitened", "kfac", "ekfac", "rows MiB", "second moments MiB",
                "K-FAC MiB"):
        table.add_column(col, justify="right")
    costs_setup = next((s.get("setup", DEFAULT_SETUP) for s in summary if s["yardstick"] == "B"), DEFAULT_SETUP)
    widths = sorted({s["width"] for s in summary if s["yardstick"] == "B" and s["loss"] == "ce" and s["width"] != "full"},
                    key=lambda w: 10**9 if w == "raw" else int(w))
    for w in widths:
        e = {s["score"]: s for s in summary if s["yardstick"] == "B" and s["loss"] == "ce" and s["width"] == w
             and s["style"] == "para" and s.get("setup", DEFAULT_SETUP) == costs_setup}
        if "cosine" not in e:
            continue
        base = e["cosine"]["stream_s"]
        b = e["cosine"]["bytes"]
        table.add_row("exact" if w == "raw" else w, f"{base:.3f}",
                      *[f"{e[s]['stream_s'] / base:.2f}x" if s in e else "-" for s in ("influence", "whitened", "kfac",
                                                                                       "ekfac")],
                      f"{b['rows'] / 2**20:.2f}", f"{b['second_moment'] / 2**20:.2f}", f"{b['kfac'] / 2**20:.3f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="256,1024,4096,16384")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--losses", default="ce,margin")
    p.add_argument("--yardsticks", default="A,B,LDS")
    p.add_argument("--entities", type=int, default=24, help="entities of A and B (4 / 5 facts each)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lds-subsets", type=int, default=16)
    p.add_argument("--smollm2", default=None, help="SmolLM2 HF directory: add the real-model yardstick S")
    p.add_argument("--smollm2-facts", type=int, default=60)
    p.add_argument("--smollm2-epochs", type=int, default=2)
    p.add_argument("--smollm2-widths", default="1024,4096")
    p.add_argument("--smollm2-raw", action="store_true", help="S: also the unprojected references (slow)")
    p.add_argument("--smollm2-seeds", type=int, default=1, help="S: projection seeds (one index of SmolLM2 each)")
    p.add_argument("--smollm2-chat", default=None,
                   help="SmolLM2 HF directory: add the real-model yardstick S2 (facts taught in one phrasing, asked as"
                        " chat turns; widths and seeds of --smollm2-widths / --smollm2-seeds)")
    p.add_argument("--smollm2-chat-facts", type=int, default=30)
    p.add_argument("--smollm2-chat-epochs", type=int, default=16)
    p.add_argument("--scores", default=",".join(SCORES), help="Gradian scores to rank with")
    p.add_argument("--dampings", default=str(DAMPING),
                   help="kfac / ekfac dampings (shares of each module's mean eigenvalue); 0.1 is the default's row")
    p.add_argument("--modules", default="mlp", help="module_filter patterns (comma list), or 'all' (every linear)")
    p.add_argument("--no-raw", action="store_true", help="skip the unprojected references")
    p.add_argument("--fisher", default="empirical",
                   help="grads.fisher of the Gradian indexes, a comma list of empirical, sampled (sampled: the true"
                        " Fisher, labels drawn from the model; replaces the earlier bench-only --true-fisher)")
    p.add_argument("--projections", default="kronecker",
                   help="grads.projection of the projected indexes, a comma list of kronecker, kronecker_orthogonal, whitened"
                        " (default kronecker, as every table before the fourth round: the product's default is"
                        " kronecker_orthogonal since); a kind with '+spectrum' (kronecker_orthogonal+spectrum) also"
                        " sets grads.width_allocation=spectrum")
    p.add_argument("--row-formats", default="dense",
                   help="grads.row_format of the projected indexes, a comma list of dense, factored:C (C: grads.row_rank);"
                        " a factored index of width W is built at the projection width whose rank-C factors store W"
                        " numbers per module, as the dense k_o x k_i = W block does (equal bytes per row). Factored"
                        " rows rank cosine, kfac, ekfac only; signs:P (P: eigen, whitened, kronecker_orthogonal, kronecker)"
                        " builds sign rows of projection P at width 16 W, the bytes of a float16 dense row of W (cosine"
                        " only)")
    p.add_argument("--peers", default="", help="peer workers to run on every yardstick (kronfluence, traker)")
    p.add_argument("--peer-dim", type=int, default=4096, help="traker's projected width (all modules together)")
    p.add_argument("--kronfluence-empirical", action="store_true",
                   help="Kronfluence also with the empirical Fisher (the data's labels, as Gradian)")
    p.add_argument("--no-gradian", action="store_true", help="only the peers (e.g. after a run with the same --work)")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, nargs="*", default=None,
                   help="print the tables (and Markdown) of earlier --json files, merged; run nothing")
    args = p.parse_args(argv)
    if args.from_json:
        rows = [r for path in args.from_json for r in json.loads(path.read_text())["rows"]]
        summary = summarize(rows)
        print_table(summary, Console(width=200))
        if any(s["yardstick"] == "B" for s in summary):
            print_costs(summary, Console(width=200))
        print(markdown(summary))
        n_docs = {k: v for path in args.from_json for k, v in json.loads(path.read_text()).get("n_docs", {}).items()}
        if n_docs and any(compact(s) for s in summary):
            print(comparison_markdown(summary, n_docs))
        return 0
    global MODULES
    MODULES = None if args.modules == "all" else [m for m in args.modules.split(",") if m]
    wanted_scores = tuple(x for x in args.scores.split(",") if x)
    dampings = tuple(float(d) for d in args.dampings.split(",") if d)
    gradian_kw = {"wanted": wanted_scores, "dampings": dampings, "raw_too": not args.no_raw,
                  "row_formats": tuple(parse_row_formats(args.row_formats))}
    fishers = [f for f in args.fisher.split(",") if f]
    projections = [x for x in args.projections.split(",") if x]
    bad = [x for x in fishers if x not in ("empirical", "sampled")] + [
        x for x in projections if x.partition("+")[0] not in ("kronecker", "kronecker_orthogonal", "whitened")
        or x.partition("+")[2] not in ("", "spectrum")]
    if bad:
        raise SystemExit(f"--fisher / --projections: unknown {bad} (empirical, sampled; kronecker, kronecker_orthogonal,"
                         " whitened)")

    def gradian_on(ys: Yardstick, widths: list[int], seeds: int, **kw: Any) -> list[dict[str, Any]]:
        """Every (fisher, projection): the unprojected references once per fisher (they have no projection)."""
        return [r for fisher in fishers for i, projection in enumerate(projections)
                for r in run_yardstick(ys, widths, seeds, losses, work, console,
                                       **(gradian_kw | kw | {"fisher": fisher, "projection": projection}
                                          | ({"raw_too": False} if i else {})))]

    def peers_on(ys: Yardstick) -> list[dict[str, Any]]:
        return [r for tool in args.peers.split(",") if tool
                for r in run_peer(ys, tool, work, console, total_dim=args.peer_dim if tool == "traker" else 0,
                                  empirical=args.kronfluence_empirical and tool == "kronfluence")]

    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)
    logging.getLogger("gradian.curvature.factors").setLevel(logging.ERROR)
    console = Console(width=200)
    widths = [int(w) for w in args.widths.split(",") if w]
    losses = [x for x in args.losses.split(",") if x]
    wanted = [y for y in args.yardsticks.split(",") if y]
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    fine_tunes = {}
    n_docs: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="yardsticks_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in wanted:
            t0 = time.perf_counter()
            if name == "A":
                ys = planted_a(work, args.entities, args.epochs)
            elif name == "B":
                ys = planted_b(work, args.entities, args.epochs)
            elif name == "LDS":
                ys = lds_yardstick(work, args.lds_subsets, console)
            else:
                raise SystemExit(f"--yardsticks: unknown {name!r} (A, B, LDS)")
            fine_tunes[name] = ys.fine_tune
            n_docs[name] = ys.n_docs
            if not args.no_gradian:
                rows += gradian_on(ys, widths, args.seeds)
            rows += peers_on(ys)
            console.print(f"yardstick {name}: {time.perf_counter() - t0:.0f} s")
            if args.json:  # partial results survive a later failure
                args.json.write_text(json.dumps({"rows": rows, "fine_tune": fine_tunes, "n_docs": n_docs}, indent=1))
        smollm2_sets = [("S", args.smollm2, lambda d: smollm2_yardstick(work, d, args.smollm2_facts, args.smollm2_epochs,
                                                                           console)),
                        ("S2", args.smollm2_chat, lambda d: smollm2_chat_yardstick(work, d, args.smollm2_chat_facts,
                                                                                   args.smollm2_chat_epochs, console))]
        for name, model_dir, build in smollm2_sets:
            if not model_dir:
                continue
            t0 = time.perf_counter()
            ys = build(model_dir)
            fine_tunes[name] = ys.fine_tune
            n_docs[name] = ys.n_docs
            if not args.no_gradian:
                rows += gradian_on(ys, [int(w) for w in args.smollm2_widths.split(",")], args.smollm2_seeds, batch_size=4,
                                   raw_too=args.smollm2_raw)
            rows += peers_on(ys)
            console.print(f"yardstick {name}: {time.perf_counter() - t0:.0f} s")
            if args.json:
                args.json.write_text(json.dumps({"rows": rows, "fine_tune": fine_tunes}, indent=1))
    summary = summarize(rows)
    print_table(summary, console)
    if any(s["yardstick"] == "B" for s in summary):
        print_costs(summary, console)
    print(markdown(summary))
    print(setup_costs(summary))
    if any(compact(s) for s in summary):
        print(comparison_markdown(summary, n_docs))
    machine = f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    console.print(f"{machine}; wall time {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows, "fine_tune": fine_tunes, "n_docs": n_docs,
                                         "machine": machine, "args": vars(args) | {"work": str(args.work)}},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
