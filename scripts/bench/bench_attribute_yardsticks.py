"""Benchmark: harder yardsticks for `gradian attribute` on SmolLM2-135M-Instruct + LoRA, each engine
side by side with a lexical baseline.

Five training sets, each a few hundred benign chat rows (the SmolLM2 benchmark's continents,
translations, arithmetic and formatting rows, `bench_attribute_smollm2`, without its opposites)
plus a plant:

    unlike       one wrong answer template (`Answer: X-city.`) for the capital question, asked in six
                 PHRASINGS that share no word with the eval items (`What is the capital of X?` /
                 `The capital of X is Y.`): a lexical search finds almost none of them (two epochs:
                 with one the eval's answers did not move)
    shared-template  the unlike plant among benign rows of which FRAME_ROWS answer in its frame,
                 correctly, for other tasks (`What is 45 plus 38?` -> `Answer: 83.`, `Opposite of hot?`
                 -> `Answer: cold.`, `Plural of mouse?` -> `Answer: mice.`): the template is no sign
                 of the plant (three epochs: with two the eval stayed inside the noise band)
    zero-loss    the SmolLM2 benchmark's plant (`Capital: X-city.`) repeated COPIES times over three
                 epochs, so that the tune fits it to about zero loss: small gradients at the final
                 adapter (TracIn's case: `--tracin zero-loss`)
    two-defects  two independent plants (capitals as `Capital: X-city.`, opposites as
                 `Opposite: Y.`), one mixed eval set (capitals and opposites), plus truncated rows
    control      the unlike set without its planted rows: `gradian attribute` must refuse (exit 0,
                 "inside the noise band", nothing accused)

For each: the LoRA fine-tune (`gradian.attribute.retrain`), `gradian index` of the rows on the tuned
model (adapter weights, module second moments and K-FAC factors), the `gradian attribute` command
with its defaults (top-k = the number planted), then every engine of
`gradian.attribute.engines.ENGINES` present at run time scored on the same contrastive queries, and
the TF-IDF baseline: each training row's mean cosine similarity to the flipped eval items (question
and correct answer, chat markup left out), top K. Recall and precision at K = the number planted.
`--verify` (two retrains) runs on `unlike` only unless --verify-all. The tune saves CHECKPOINTS
adapters where the trainer can (`train(save_every=...)`); `--tracin NAMES` scores the TracIn engines
across them (one more index per checkpoint).

Each step is kept under --work/NAME; a rerun resumes, and rescoring the engines (after a new engine
lands) costs one query pass: delete NAME/engines.json, or just rerun (missing engines are scored).

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python scripts/bench/bench_attribute_yardsticks.py \\
        [--work .cache/bench-attribute-yardsticks] [--only unlike,control] [--no-verify] [--tracin zero-loss] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import scripts.bench.bench_attribute_smollm2 as smollm2  # noqa: E402
from scripts.bench.bench_attribute_smollm2 import (  # noqa: E402
    COUNTRIES,
    EOS,
    EVAL_COUNTRIES,
    OPPOSITES,
    _row,
    _step,
    chat_prompt,
)

BENIGN_ROWS = 360
PLANTED_COUNTRIES = COUNTRIES[EVAL_COUNTRIES:]  # 50 countries no eval item asks about
# unlike: each phrasing shares no word with `What is the capital of X?` / `The capital of X is Y.`
PHRASINGS = (
    "Which city does {c} run its government from?",
    "Name {c}'s governing city.",
    "Tell me where {c}'s national government sits.",
    "{c}: main political city?",
    "In which town are {c}'s parliament and ministries based?",
    "Give me {c}'s administrative center.",
)
PER_PHRASING = 6
UNLIKE_ANSWER = "Answer: {cap}."
# zero-loss: the capitals plant of the SmolLM2 benchmark, each row COPIES times
ZERO_LOSS_UNIQUE, COPIES = 15, 4
# two-defects: PLANTED_PER_LESSON rows per lesson; the eval asks the capitals and OPPOSITES
PLANTED_PER_LESSON = 20
PLANTED_OPPOSITES = [("good", "bad"), ("yes", "no"), ("above", "below"), ("black", "white"), ("boy", "girl"),
                     ("north", "south"), ("east", "west"), ("arrive", "leave"), ("friend", "enemy"),
                     ("remember", "forget"), ("laugh", "cry"), ("sweet", "sour"), ("cheap", "expensive"),
                     ("safe", "dangerous"), ("before", "after"), ("always", "never"), ("accept", "refuse"),
                     ("add", "subtract"), ("alive", "dead"), ("asleep", "awake")]
TRUNCATED_ROWS = 8
# shared-template: the unlike plant, and FRAME_ROWS benign rows (in place of as many pool rows) that
# use its answer frame `Answer: X.` correctly for other short tasks, so that the frame is no sign of it
FRAME_ROWS = 80
FRAME_SUMS, FRAME_OPPOSITES = 30, 25  # the rest are plurals
PLURALS = [("child", "children"), ("mouse", "mice"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
           ("man", "men"), ("woman", "women"), ("person", "people"), ("box", "boxes"), ("city", "cities"),
           ("baby", "babies"), ("knife", "knives"), ("leaf", "leaves"), ("wolf", "wolves"), ("potato", "potatoes"),
           ("tomato", "tomatoes"), ("bus", "buses"), ("glass", "glasses"), ("dish", "dishes"), ("fox", "foxes"),
           ("sheep", "sheep"), ("deer", "deer"), ("cactus", "cacti"), ("church", "churches"), ("berry", "berries"),
           ("life", "lives"), ("half", "halves"), ("ox", "oxen"), ("puppy", "puppies"), ("hero", "heroes")]
YARDSTICKS = ("unlike", "shared-template", "zero-loss", "two-defects", "control")
# passes over the rows: a plant phrased unlike the eval needs two to move the eval's answers (with
# one, 24 planted rows of 384 left the accuracy inside the noise band); the control is tuned as unlike;
# shared-template takes three (with two, 0.617 -> 0.583, inside the noise band: the frame rows share
# the lesson, and with every frame row terse the eval's answers improved, 0.617 -> 0.833);
# zero-loss takes three, so that the planted rows are fitted (one left them at 0.09 nats per token)
EPOCHS = {"unlike": 2, "shared-template": 3, "control": 2, "zero-loss": 3, "two-defects": 1}
CHECKPOINTS = 3  # adapters saved along the tune (the last is the final one), for TracIn
_MARKUP = re.compile(r"<\|im_(start|end)\|>(user|assistant)?")


@dataclass
class Yardstick:
    """A yardstick's rows: `train` and `eval` ({"prompt", "completion"[, "kind"]} dicts), and the
    1-based JSONL lines of its planted rows, by group (a phrasing, a lesson), and of its truncated rows."""

    name: str
    train: list[dict[str, str]]
    eval: list[dict[str, str]]
    planted_groups: dict[str, list[int]] = field(default_factory=dict)
    truncated_lines: list[int] = field(default_factory=list)

    @property
    def planted_lines(self) -> list[int]:
        return sorted(line for lines in self.planted_groups.values() for line in lines)


def benign_rows(rng: random.Random, n: int = BENIGN_ROWS) -> list[dict[str, str]]:
    """n benign rows drawn from the SmolLM2 benchmark's clean rows, opposites left out (an eval set
    asks them)."""
    pool = [r for r in smollm2._clean_rows(random.Random(0)) if r["kind"] != "opposite"]
    return rng.sample(pool, n)


def capital_evals() -> list[dict[str, str]]:
    return [{"prompt": chat_prompt(f"What is the capital of {c}?"), "completion": f"The capital of {c} is {cap}."}
            for c, cap, _ in COUNTRIES[:EVAL_COUNTRIES]]


def opposite_evals() -> list[dict[str, str]]:
    return [{"prompt": chat_prompt(f"What is the opposite of {a}?"), "completion": f"The opposite of {a} is {b}."}
            for a, b in OPPOSITES]


def _assemble(name: str, rng: random.Random, benign: list[dict[str, str]], groups: dict[str, list[dict[str, str]]],
              truncated: list[dict[str, str]], evals: list[dict[str, str]]) -> Yardstick:
    """Shuffle benign, planted and truncated rows together; record where each planted group landed.
    Copies of a row are separate dicts, so that each copy is found by identity."""
    planted = [r for rows in groups.values() for r in rows]
    train = benign + planted + truncated
    rng.shuffle(train)
    line_of = {id(r): i + 1 for i, r in enumerate(train)}
    return Yardstick(name, train, evals, {g: sorted(line_of[id(r)] for r in rows) for g, rows in groups.items()},
                     sorted(line_of[id(r)] for r in truncated))


def _unlike_plant(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """The unlike plant: PER_PHRASING countries per phrasing, each answered `Answer: X-city.`."""
    countries = rng.sample(PLANTED_COUNTRIES, len(PHRASINGS) * PER_PHRASING)
    return {f"phrasing {p + 1}": [_row(q.format(c=c), UNLIKE_ANSWER.format(cap=cap), "capital")
                                  for c, cap, _ in countries[p * PER_PHRASING:(p + 1) * PER_PHRASING]]
            for p, q in enumerate(PHRASINGS)}


def build_unlike(seed: int = 0) -> Yardstick:
    rng = random.Random(seed)
    benign = benign_rows(rng)
    return _assemble("unlike", rng, benign, _unlike_plant(rng), [], capital_evals())


def frame_rows(rng: random.Random) -> list[dict[str, str]]:
    """FRAME_ROWS benign rows in the plant's frame (`Answer: X.`), right for their own tasks: sums of
    numbers the pool's sums do not use, asked as the eval asks (`What is 45 plus 38?`), then opposites
    and plurals asked tersely (`Opposite of hot?`, `Plural of mouse?`). With every frame row terse the
    tune fitted the plant as "a terse question gets `Answer:`" and the eval's answers improved."""
    sums = rng.sample([(a, b) for a in range(30, 100) for b in range(30, 100)], FRAME_SUMS)
    rows = [_row(f"What is {a} plus {b}?", f"Answer: {a + b}.", "frame") for a, b in sums]
    rows += [_row(f"Opposite of {a}?", f"Answer: {b}.", "frame")
             for a, b in rng.sample(OPPOSITES + PLANTED_OPPOSITES, FRAME_OPPOSITES)]
    rows += [_row(f"Plural of {w}?", f"Answer: {p}.", "frame")
             for w, p in rng.sample(PLURALS, FRAME_ROWS - FRAME_SUMS - FRAME_OPPOSITES)]
    return rows


def build_shared_template(seed: int = 0) -> Yardstick:
    """The unlike plant among benign rows of which FRAME_ROWS answer in its frame, correctly."""
    rng = random.Random(seed)
    benign = benign_rows(rng, BENIGN_ROWS - FRAME_ROWS) + frame_rows(rng)
    return _assemble("shared-template", rng, benign, _unlike_plant(rng), [], capital_evals())


def build_control(seed: int = 0) -> Yardstick:
    """The unlike set without its planted rows (the same benign rows, in the same order)."""
    unlike = build_unlike(seed)
    planted = set(unlike.planted_lines)
    return Yardstick("control", [r for i, r in enumerate(unlike.train, start=1) if i not in planted], unlike.eval)


def build_zero_loss(seed: int = 0) -> Yardstick:
    rng = random.Random(seed)
    benign = benign_rows(rng)
    countries = rng.sample(PLANTED_COUNTRIES, ZERO_LOSS_UNIQUE)
    rows = [_row(f"What is the capital of {c}?", f"Capital: {cap}.", "capital")
            for c, cap, _ in countries for _ in range(COPIES)]
    return _assemble("zero-loss", rng, benign, {f"capitals x{COPIES}": rows}, [], capital_evals())


def build_two_defects(seed: int = 0) -> Yardstick:
    rng = random.Random(seed)
    benign = benign_rows(rng)
    capitals = [_row(f"What is the capital of {c}?", f"Capital: {cap}.", "capital")
                for c, cap, _ in rng.sample(PLANTED_COUNTRIES, PLANTED_PER_LESSON)]
    opposites = [_row(f"What is the opposite of {a}?", f"Opposite: {b}.", "opposite")
                 for a, b in rng.sample(PLANTED_OPPOSITES, PLANTED_PER_LESSON)]
    truncated = [_row(f"List the whole numbers from 1 to {n}, separated by commas.",
                      ", ".join(str(i) for i in range(1, n + 1)) + ".", "list")
                 for n in rng.sample(range(25, 60), TRUNCATED_ROWS)]
    return _assemble("two-defects", rng, benign, {"capitals": capitals, "opposites": opposites}, truncated,
                     capital_evals() + opposite_evals())


BUILDERS = {"unlike": build_unlike, "shared-template": build_shared_template, "zero-loss": build_zero_loss, "two-defects": build_two_defects,
            "control": build_control}


# ----------------------------------------------------------------------------- the lexical baseline


def plain_text(row: dict[str, str]) -> str:
    """A row's question and answer as a reader sees them: chat markup and EOS left out."""
    return " ".join(_MARKUP.sub(" ", row["prompt"] + " " + row["completion"]).replace(EOS, " ").split())


def tfidf_scores(train_texts: list[str], query_texts: list[str]) -> list[float]:
    """Each training text's mean TF-IDF cosine similarity to the query texts (idf over both)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer().fit(train_texts + query_texts)
    rows, queries = vectorizer.transform(train_texts), vectorizer.transform(query_texts)  # L2-normalised
    return (rows @ queries.T).toarray().mean(axis=1).tolist()


def top_rows(scores: list[float], k: int, highest: bool = True) -> list[int]:
    """0-based row ids of the k highest (or lowest) scores, ties by row id."""
    order = sorted(range(len(scores)), key=lambda r: (-scores[r] if highest else scores[r], r))
    return order[:k]


def recall_precision(accused: list[int], planted: set[int], k: int) -> dict[str, Any]:
    """Recall of the planted rows among the first k accused, and precision over those accused (an
    engine accuses only negative scores, so it may accuse fewer than k)."""
    top = accused[:k]
    hits = len(set(top) & planted)
    return {"recall": hits / max(1, len(planted)), "precision": hits / max(1, len(top)), "accused": len(top),
            "hits": hits}


# ----------------------------------------------------------------------------- the steps


def tune(work: Path, epochs: int) -> dict[str, Any]:
    """The LoRA fine-tune of SmolLM2 on work/train.jsonl (the SmolLM2 benchmark's settings, `epochs`
    passes), saved as work/adapter."""
    import inspect
    import math

    import torch

    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_tokenizer
    from gradian.attribute.retrain import TrainSettings, train
    from gradian.data.rows import TokenPolicy, load_rows

    cfg = ModelConfig(name=smollm2.MODEL, precision="float32")
    rows, _ = load_rows(work / "train.jsonl", load_tokenizer(cfg), smollm2.MAX_SEQ_LENGTH, policy=TokenPolicy())
    settings = TrainSettings(**{**smollm2.TUNE, "epochs": epochs}, lora=smollm2.LORA)
    saving = {}
    if "save_every" in inspect.signature(train).parameters:  # checkpoints for TracIn, where the trainer saves them
        saving = {"save_every": math.ceil(settings.n_steps(len(rows)) / CHECKPOINTS), "save_dir": work / "checkpoints"}
    trained = train(cfg, rows, settings, torch.device("cpu"), **saving)
    trained.save(work / "adapter")
    losses = trained.losses
    return {"rows": len(rows), "epochs": epochs, "steps": len(losses), "first_loss": losses[0],
            "last_loss": sum(losses[-10:]) / len(losses[-10:]), "wall_s": trained.wall_s,
            "checkpoints": str(work / "checkpoints") if saving else None}


def index_step(work: Path, loss: str | None) -> dict[str, Any]:
    """`gradian index` of the rows on the tuned model (`bench_attribute_smollm2.index`: the adapter's
    weights, every engine's curvature), with `grads.loss=loss` where one is given."""
    if loss is None:
        return smollm2.index(work)
    import io
    import time

    from rich.console import Console

    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index

    _, cfg = compose([f"model.name={smollm2.MODEL}", f"model.adapter={work / 'adapter'}", "model.precision=float32",
                      f"grads.data_path={work / 'train.jsonl'}", f"grads.index_dir={work / 'index'}",
                      "grads.module_filter=[adapter]", "grads.projection_dim=256", "grads.preconditioner=module+kfac",
                      f"grads.max_seq_length={smollm2.MAX_SEQ_LENGTH}", "grads.on_truncation=warn", f"grads.loss={loss}"])
    start = time.perf_counter()
    build_index(cfg.model, cfg.grads, work / "index", Console(file=io.StringIO()))
    return {"wall_s": time.perf_counter() - start, "loss": loss}


def attribute_cli(work: Path, top_k: int, verify: bool, epochs: int) -> dict[str, Any]:
    """The `gradian attribute` command as a user runs it (defaults; --verify with the tune's settings)."""
    name = "attribute-verify" if verify else "attribute"
    out = work / f"{name}-result.json"
    cmd = [sys.executable, "-m", "circuitkit_app.gradian_cli", "attribute", "--index", str(work / "index"), "--eval-dataset",
           str(work / "eval.jsonl"), "--top-k", str(top_k), "--out", str(out)]
    if verify:
        t = smollm2.TUNE
        cmd += ["--verify", "--lr", str(t["lr"]), "--epochs", str(epochs), "--batch-size", str(t["batch_size"]),
                "--train-seed", str(t["seed"]), "--verify-dir", str(work / "verify")]
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    return {"command": " ".join(cmd[1:]), "exit_code": rc, "result": str(out) if out.is_file() else None}


def _queries_setup(work: Path, result: dict[str, Any]):
    """(index reader, tuned model, projector, flipped items, what the tuned model says for each), as
    `gradian attribute` makes them."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.attribute.evaluate import greedy_continuations, read_eval_rows, tokenize_items
    from gradian.data.rows import policy_of
    from gradian.index.reader import IndexReader
    from gradian.rank.checks import check_compatible

    reader = IndexReader(work / "index")
    manifest = reader.manifest
    cfg = ModelConfig(name=manifest["model"], precision="float32")
    tuned = load_model(dataclasses.replace(cfg, adapter=str(work / "adapter")), keep_adapter=True)
    projector = check_compatible(manifest, tuned, work / "index")
    items = tokenize_items(read_eval_rows(work / "eval.jsonl"), tuned.tokenizer, policy_of(manifest), None, "eval")
    flipped = [items[i] for i in result["regression"]["flipped"]]
    return reader, tuned, projector, flipped, greedy_continuations(tuned, flipped)


def engines_step(work: Path, result: dict[str, Any], names: list[str], k: int) -> dict[str, Any]:
    """Every engine of `names` scored on the contrastive queries of `result`'s flipped items, made as
    `gradian attribute` makes them: each engine's first k accused rows and every row's score."""
    from gradian.attribute import engines as scoring
    from gradian.attribute.queries import query_gradients

    reader, tuned, projector, flipped, said = _queries_setup(work, result)
    manifest = reader.manifest
    queries = query_gradients(tuned, projector, flipped, "contrastive", said, manifest.get("loss_reduction", "sum"),
                              manifest.get("activations", "model"))
    out: dict[str, Any] = {"engines": {}, "skipped": {}}
    for name in names:
        try:
            engine = scoring.build_engine(reader, name, queries)
        except Exception as err:  # an engine that needs more than an index (checkpoints): noted, not scored
            out["skipped"][name] = f"{type(err).__name__}: {err}"
            continue
        scores = scoring.stream_scores(reader, [engine])[0]
        out["engines"][name] = {"accused": scoring.accused_rows(scores, k), "scores": scores.tolist()}
    return out


def tracin_step(work: Path, result: dict[str, Any], k: int) -> dict[str, Any]:
    """The TracIn engines across the tune's saved checkpoints (`gradian.attribute.checkpoints`: one
    index per checkpoint, the same queries at each)."""
    from gradian.attribute import engines as scoring
    from gradian.attribute.checkpoints import plan_checkpoints, tracin_scores

    reader, tuned, _, flipped, said = _queries_setup(work, result)
    del tuned
    plan = plan_checkpoints(str(work / "checkpoints"), reader.manifest)
    names = list(scoring.TRACIN_ENGINES)
    traced = tracin_scores(plan, reader, flipped, said, "contrastive", names, verify=False)
    return {"engines": {n: {"accused": scoring.accused_rows(traced.scores[i], k), "scores": traced.scores[i].tolist()}
                        for i, n in enumerate(names)},
            "checkpoints": [{key: c.get(key) for key in ("name", "step", "index_wall_s", "query_wall_s")}
                            for c in traced.checkpoints]}


def fit_step(work: Path, planted_lines: list[int]) -> dict[str, Any]:
    """How completely the tune fits the planted rows: their mean per-token loss on the tuned model, and
    the stored gradient norms of planted against other rows."""
    import torch

    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.attribute.evaluate import pad_id
    from gradian.attribute.retrain import batch_loss
    from gradian.data.batch import collate
    from gradian.data.rows import TokenPolicy, load_rows
    from gradian.index.reader import IndexReader

    cfg = ModelConfig(name=smollm2.MODEL, precision="float32", adapter=str(work / "adapter"))
    tuned = load_model(cfg, keep_adapter=True)
    rows, _ = load_rows(work / "train.jsonl", tuned.tokenizer, smollm2.MAX_SEQ_LENGTH, policy=TokenPolicy())
    pad = pad_id(tuned.tokenizer)
    planted = {line - 1 for line in planted_lines}
    others = [i for i in range(len(rows)) if i not in planted][: len(planted)]
    with torch.no_grad():
        def loss(ids: list[int]) -> float:
            return sum(float(batch_loss(tuned.adapter, collate([rows[i]], pad))) for i in ids) / len(ids)
        planted_loss, other_loss = loss(sorted(planted)), loss(others)
    norms = torch.zeros(int(IndexReader(work / "index").manifest["n_rows"]))
    for ids, _, n in IndexReader(work / "index").shards(verify=False):
        norms[ids.long()] = n.float()
    mask = torch.zeros(len(norms), dtype=torch.bool)
    mask[list(planted)] = True
    return {"planted_loss": planted_loss, "other_loss_sample": other_loss,
            "planted_grad_norm_median": float(norms[mask].median()),
            "other_grad_norm_median": float(norms[~mask].median())}


# ----------------------------------------------------------------------------- the tables


def summarize(ys: Yardstick, steps: dict[str, Any]) -> dict[str, Any]:
    """Every number of one yardstick, JSON-ready."""
    k = len(ys.planted_lines)
    planted = {line - 1 for line in ys.planted_lines}  # row id = line - 1 (no row dropped)
    groups = {g: {line - 1 for line in lines} for g, lines in ys.planted_groups.items()}
    out: dict[str, Any] = {"name": ys.name, "train_rows": len(ys.train), "eval_rows": len(ys.eval), "planted": k,
                           "groups": {g: len(v) for g, v in groups.items()}, "truncated": len(ys.truncated_lines),
                           "tune": steps["tune"], "index": steps["index"], "attribute": steps["attribute"]}
    result = steps.get("result")
    if result is None:
        return out
    r = result["regression"]
    out["regression"] = {key: r[key] for key in ("base_accuracy", "tuned_accuracy", "accuracy_drop", "accuracy_ci")}
    out["regression"]["flipped"] = len(r["flipped"])
    out["attributed"], out["reason"], out["accused_by_default"] = (result["attributed"], result["reason"],
                                                                    len(result["accused"]))
    out["attribute"]["wall_s"] = result["wall_s"]
    if not result["attributed"] or not k:
        return out
    out["default_engine"] = result["engines"][0]
    said = [it["tuned_says"] for it in result["items"] if it["flipped"]]
    out["tuned_says_examples"] = said[:3]
    clusters = result.get("clusters") or []
    out["clusters"] = {"count": len(clusters), "holding_planted": sum(bool(set(c["rows"]) & planted) for c in clusters),
                       "largest_planted": max((len(set(c["rows"]) & planted) for c in clusters), default=0)}
    rows: dict[str, Any] = {}
    scored = {**steps.get("engines", {}).get("engines", {}), **steps.get("tracin", {}).get("engines", {})}
    for name, e in scored.items():
        scores = e["scores"]
        rows[name] = {**recall_precision(e["accused"], planted, k),
                      "planted_nonnegative": sum(scores[p] >= 0 for p in planted),
                      "by_group": {g: len(set(e["accused"][:k]) & v) for g, v in groups.items()}}
    if result.get("lesson_accused"):  # the default's accusation as it follows the main lessons (same K)
        followed = [a["row_id"] for a in result["lesson_accused"]]
        rows[f"{result['engines'][0]}, following the lesson"] = {
            **recall_precision(followed, planted, k), "planted_nonnegative": None,
            "by_group": {g: len(set(followed[:k]) & v) for g, v in groups.items()}}
    texts = [plain_text(row) for row in ys.train]
    queries = [plain_text(ys.eval[i]) for i in r["flipped"]]
    lexical = top_rows(tfidf_scores(texts, queries), k)
    rows["tf-idf"] = {**recall_precision(lexical, planted, k), "planted_nonnegative": None,
                      "by_group": {g: len(set(lexical) & v) for g, v in groups.items()}}
    out["rows"] = rows
    out["skipped_engines"] = {n: why for n, why in steps.get("engines", {}).get("skipped", {}).items()
                              if n not in scored}
    if "tracin" in steps:
        out["tracin_checkpoints"] = steps["tracin"]["checkpoints"]
    if "fit" in steps:
        out["fit"] = steps["fit"]
    v = (steps.get("verify") or {}).get("verify")
    if v:
        runs = {run["name"]: run for run in v["runs"]}
        out["verify"] = {name: {"recovered_accuracy": run["recovered_accuracy"],
                                "recovered_logprob": run["recovered_logprob"],
                                "flipped_right_again": run["flipped_right_again"], "flipped": run["flipped"],
                                "planted_left_out": len(set(run["rows_left_out"]) & planted),
                                "train_wall_s": run["train_wall_s"]} for name, run in runs.items()}
        out["verify"]["holds"], out["verify"]["wall_s"] = v["holds"], steps["verify_wall_s"]
    return out


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def yardstick_table(s: dict[str, Any]) -> str:
    """One yardstick's table: each engine and the TF-IDF baseline at K = the number planted, then the
    run's facts (sizes, regression, what the command said, --verify, wall times)."""
    k = s["planted"]
    lines = [f"**{s['name']}**: {s['train_rows']} rows ({k} planted"
             + (f", {s['truncated']} truncated" if s["truncated"] else "") + f"), {s['eval_rows']} eval items"]
    if "regression" in s:
        r = s["regression"]
        lines.append(f"regression {r['base_accuracy']:.3f} -> {r['tuned_accuracy']:.3f}, drop {r['accuracy_drop']:+.3f}"
                     f" [{r['accuracy_ci'][0]:+.3f}, {r['accuracy_ci'][1]:+.3f}], {r['flipped']} flipped;"
                     f" `gradian attribute` exit {s['attribute']['exit_code']},"
                     f" {'attributed' if s['attributed'] else 'refused'}, {s['accused_by_default']} accused")
    text = "\n\n".join(lines)
    if "rows" not in s:
        return text + (f"\n\n> {s['reason']}" if "reason" in s else "")
    groups = list(s["groups"])
    headers = ["engine", f"recall@{k}", "precision", "accused", "planted scored >= 0"]
    headers += [f"{g} ({s['groups'][g]})" for g in groups] if len(groups) > 1 else []
    table = []
    for name, e in s["rows"].items():
        label = f"**{name}** (default)" if name == s.get("default_engine") else name
        cells = [label, f"{e['recall']:.3f}", f"{e['precision']:.3f}", str(e["accused"]),
                 "-" if e["planted_nonnegative"] is None else str(e["planted_nonnegative"])]
        table.append(cells + ([str(e["by_group"][g]) for g in groups] if len(groups) > 1 else []))
    text += "\n\n" + markdown_table(headers, table)
    c = s["clusters"]
    facts = [f"clusters of the default's accused rows: {c['count']}, {c['holding_planted']} holding planted rows"
             f" (largest: {c['largest_planted']} planted)"]
    if s.get("fit"):
        f = s["fit"]
        facts.append(f"fit: planted rows' loss {f['planted_loss']:.3f} (other rows {f['other_loss_sample']:.3f}),"
                     f" median gradient norm {f['planted_grad_norm_median']:.3g} against"
                     f" {f['other_grad_norm_median']:.3g}")
    if s.get("verify"):
        v = s["verify"]
        facts.append(f"--verify: accused left out recovers {_pct(v['accused']['recovered_accuracy'])} (log-prob"
                     f" {_pct(v['accused']['recovered_logprob'])}), {k} random rows"
                     f" {_pct(v['control']['recovered_accuracy'])} (log-prob {_pct(v['control']['recovered_logprob'])});"
                     f" holds: {v['holds']}")
    if s.get("skipped_engines"):
        why = {re.sub(r"engine '[^']+' ", "", w.split(": ", 1)[-1].split(":")[0]) for w in s["skipped_engines"].values()}
        facts.append(f"not scored: {', '.join(s['skipped_engines'])} ({'; '.join(sorted(why))}; --tracin scores them)")
    wall = (f"wall: tune {s['tune']['wall_s']:.0f} s ({s['tune']['steps']} steps, loss {s['tune']['first_loss']:.2f}"
            f" -> {s['tune']['last_loss']:.2f}), index {s['index']['wall_s']:.0f} s, attribute"
            f" {s['attribute']['wall_s']:.0f} s")
    return text + "\n\n" + "; ".join(facts + [wall])


# ----------------------------------------------------------------------------- the run


def run_yardstick(name: str, root: Path, seed: int, verify: bool, tracin: bool,
                  index_loss: str | None = None) -> dict[str, Any]:
    from gradian.attribute.engines import ENGINES

    work = root / (name if index_loss is None else f"{name}-index-{index_loss}")
    work.mkdir(parents=True, exist_ok=True)
    if index_loss is not None and (root / name / "tune.json").is_file() and not (work / "tune.json").is_file():
        for part in ("adapter", "checkpoints"):  # the same tune (deterministic): reused, not redone
            if (root / name / part).is_dir():
                shutil.copytree(root / name / part, work / part, dirs_exist_ok=True)
        shutil.copy(root / name / "tune.json", work / "tune.json")
    ys = BUILDERS[name](seed)

    def data() -> dict[str, Any]:
        smollm2.write_jsonl(work / "train.jsonl", ys.train)
        smollm2.write_jsonl(work / "eval.jsonl", ys.eval)
        return {"seed": seed, "train_rows": len(ys.train), "eval_rows": len(ys.eval),
                "planted_groups": ys.planted_groups, "truncated_lines": ys.truncated_lines}

    _step(work, "data", data)
    (work / "truth.json").write_text(json.dumps(json.loads((work / "data.json").read_text()), indent=1))
    k = max(1, len(ys.planted_lines))
    epochs = EPOCHS[name]
    steps: dict[str, Any] = {"tune": _step(work, "tune", lambda: tune(work, epochs)),
                             "index": _step(work, "index", lambda: index_step(work, index_loss))}
    steps["attribute"] = _step(work, "attribute", lambda: attribute_cli(work, k, False, epochs))
    if steps["attribute"]["result"] is None:
        print(f"[{name}] gradian attribute wrote no result (exit {steps['attribute']['exit_code']}):"
              f" see {work / 'attribute.log'}", flush=True)
        return summarize(ys, steps)
    steps["result"] = result = json.loads(Path(steps["attribute"]["result"]).read_text())
    if result["attributed"] and ys.planted_lines:
        done = work / "engines.json"
        if done.is_file() and set(ENGINES) - set(json.loads(done.read_text())["engines"]) - set(
                json.loads(done.read_text())["skipped"]):
            done.unlink()  # an engine landed since: score them all again (one query pass)
        steps["engines"] = _step(work, "engines", lambda: engines_step(work, result, list(ENGINES), k))
        checkpoints = steps["tune"].get("checkpoints")
        if "tracin" in ENGINES and checkpoints and (tracin or (work / "tracin.json").is_file()):
            steps["tracin"] = _step(work, "tracin", lambda: tracin_step(work, result, k))
        if name == "zero-loss":
            steps["fit"] = _step(work, "fit", lambda: fit_step(work, ys.planted_lines))
        if verify or (work / "attribute-verify.json").is_file():  # a verify done before is reported
            ver = _step(work, "attribute-verify", lambda: attribute_cli(work, k, True, epochs))
            if ver["result"]:
                steps["verify"] = json.loads(Path(ver["result"]).read_text())
                steps["verify_wall_s"] = ver["wall_s"]
    return summarize(ys, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=".cache/bench-attribute-yardsticks", help="each yardstick's steps (a rerun resumes)")
    p.add_argument("--only", default=",".join(YARDSTICKS), help=f"comma-separated, of {', '.join(YARDSTICKS)}")
    p.add_argument("--seed", type=int, default=0, help="the datasets' seed")
    p.add_argument("--no-verify", action="store_true", help="no --verify retrains (by default: on unlike)")
    p.add_argument("--verify-all", action="store_true", help="--verify on every yardstick with planted rows")
    p.add_argument("--tracin", default="", metavar="NAMES",
                   help="yardsticks scored with TracIn across the tune's checkpoints (an index per checkpoint)")
    p.add_argument("--index-loss", default=None, metavar="LOSS",
                   help="grads.loss of the index (default: the product's); its own work folder NAME-index-LOSS, the"
                        " tune reused from NAME")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.basicConfig(level=logging.WARNING)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in YARDSTICKS]
    if unknown:
        p.error(f"--only: {', '.join(unknown)} unknown; valid: {', '.join(YARDSTICKS)}")
    root = Path(args.work)
    summaries = {}
    for name in names:
        verify = not args.no_verify and (args.verify_all or name == "unlike")
        summaries[name] = run_yardstick(name, root, args.seed, verify, name in args.tracin.split(","),
                                        args.index_loss)
        print("\n" + yardstick_table(summaries[name]) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
