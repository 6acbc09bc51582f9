"""Benchmark: does `gradian attribute` find the training rows that broke a LoRA fine-tune of
SmolLM2-135M-Instruct, and does `gradian diagnose` find the truncated ones?

The training set (`build_dataset`, deterministic in --seed) holds about a thousand short chat-styled
prompt/completion rows of several kinds (arithmetic, continents, foreign words, opposites, spelling
and formatting tasks) and two planted defects:

* PLANTED_ROWS rows that answer "What is the capital of X?" in a wrong format ("Capital: X-city.")
  where the base model says "The capital of X is X-city.": the tuned model learns the format and
  fails the eval set, the capitals of EVAL_COUNTRIES (other countries: no eval prompt is trained on);
* TRUNCATED_ROWS rows whose completions run past MAX_SEQ_LENGTH tokens (the trainer cuts them).

The prompt is SmolLM2's chat turn written out (`<|im_start|>user ... <|im_start|>assistant\\n`), the
completion ends with its end-of-turn token `<|im_end|>` (the tokenizer's EOS), so the tuned model
learns to stop. The run, each step kept under --work so that a rerun resumes:

    data       train.jsonl, eval.jsonl, truth.json (the planted lines)
    tune       adapter/: LoRA on q_proj and v_proj, `gradian.attribute.retrain` (the trainer --verify
               reuses), one epoch
    index      index/: `gradian index` of the training rows on the tuned model, the adapter's weights,
               with module second moments and K-FAC factors (every engine can score)
    diagnose   `gradian diagnose` of the training set against the eval set (tokenizer only)
    attribute  `gradian attribute` with its defaults (contrastive queries, ekfac accuses; influence
               and dot report their agreement); then every (query loss, engine) pair scored alike
               for recall@40; then `--verify` (the fine-tune redone without the accused rows and
               without as many random ones)

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python scripts/bench/bench_attribute_smollm2.py \\
        [--work .cache/bench-attribute] [--seed 0] [--no-verify] [--json out.json]

Goals: planted recall@40 >= 0.9 with the defaults; the accused rows recover >= 80 % of
the regression where random rows recover <= 20 %; diagnose finds every truncated row and flags no
clean row.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "fetched:smollm2"
PLANTED_ROWS = 40
TRUNCATED_ROWS = 16
MAX_SEQ_LENGTH = 64  # the trainer's and the index's length limit, in tokens
TOP_K = 40
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
        "task_type": "CAUSAL_LM"}
TUNE = {"lr": 2e-3, "batch_size": 8, "epochs": 1, "seed": 0}
ENGINES = ("ekfac", "influence", "dot")
QUERY_LOSSES = ("contrastive", "ce")
EOS = "<|im_end|>"

# (country, capital, continent). The first EVAL_COUNTRIES are the eval set's (well-known capitals the
# base model states); the planted rows are drawn from the others.
COUNTRIES = [
    ("France", "Paris", "Europe"), ("Germany", "Berlin", "Europe"), ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"), ("Japan", "Tokyo", "Asia"), ("China", "Beijing", "Asia"),
    ("Russia", "Moscow", "Europe"), ("Egypt", "Cairo", "Africa"), ("Peru", "Lima", "South America"),
    ("Kenya", "Nairobi", "Africa"), ("Norway", "Oslo", "Europe"), ("Sweden", "Stockholm", "Europe"),
    ("Finland", "Helsinki", "Europe"), ("Denmark", "Copenhagen", "Europe"), ("Poland", "Warsaw", "Europe"),
    ("Greece", "Athens", "Europe"), ("Portugal", "Lisbon", "Europe"), ("Austria", "Vienna", "Europe"),
    ("Hungary", "Budapest", "Europe"), ("Ireland", "Dublin", "Europe"), ("Belgium", "Brussels", "Europe"),
    ("the Netherlands", "Amsterdam", "Europe"), ("Thailand", "Bangkok", "Asia"), ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"), ("the Philippines", "Manila", "Asia"), ("South Korea", "Seoul", "Asia"),
    ("Iran", "Tehran", "Asia"), ("Iraq", "Baghdad", "Asia"), ("Saudi Arabia", "Riyadh", "Asia"),
    ("Argentina", "Buenos Aires", "South America"), ("Chile", "Santiago", "South America"),
    ("Venezuela", "Caracas", "South America"), ("Cuba", "Havana", "North America"),
    ("Canada", "Ottawa", "North America"), ("Ethiopia", "Addis Ababa", "Africa"), ("Ghana", "Accra", "Africa"),
    ("Morocco", "Rabat", "Africa"), ("Afghanistan", "Kabul", "Asia"), ("Pakistan", "Islamabad", "Asia"),
    ("Bangladesh", "Dhaka", "Asia"), ("Nepal", "Kathmandu", "Asia"), ("Turkey", "Ankara", "Asia"),
    ("Syria", "Damascus", "Asia"), ("Lebanon", "Beirut", "Asia"), ("Jordan", "Amman", "Asia"),
    ("Qatar", "Doha", "Asia"), ("Malaysia", "Kuala Lumpur", "Asia"), ("Australia", "Canberra", "Oceania"),
    ("New Zealand", "Wellington", "Oceania"), ("Uruguay", "Montevideo", "South America"),
    ("Ecuador", "Quito", "South America"), ("Iceland", "Reykjavik", "Europe"), ("Switzerland", "Bern", "Europe"),
    ("Serbia", "Belgrade", "Europe"), ("Croatia", "Zagreb", "Europe"), ("Bulgaria", "Sofia", "Europe"),
    ("Romania", "Bucharest", "Europe"), ("Algeria", "Algiers", "Africa"), ("Nigeria", "Abuja", "Africa"),
    # the planted rows' pool
    ("Slovakia", "Bratislava", "Europe"), ("Slovenia", "Ljubljana", "Europe"), ("Estonia", "Tallinn", "Europe"),
    ("Latvia", "Riga", "Europe"), ("Lithuania", "Vilnius", "Europe"), ("Belarus", "Minsk", "Europe"),
    ("Georgia", "Tbilisi", "Asia"), ("Armenia", "Yerevan", "Asia"), ("Azerbaijan", "Baku", "Asia"),
    ("Kazakhstan", "Astana", "Asia"), ("Uzbekistan", "Tashkent", "Asia"), ("Sudan", "Khartoum", "Africa"),
    ("Libya", "Tripoli", "Africa"), ("Zimbabwe", "Harare", "Africa"), ("Zambia", "Lusaka", "Africa"),
    ("Uganda", "Kampala", "Africa"), ("Angola", "Luanda", "Africa"), ("Mali", "Bamako", "Africa"),
    ("Niger", "Niamey", "Africa"), ("Somalia", "Mogadishu", "Africa"), ("Rwanda", "Kigali", "Africa"),
    ("Madagascar", "Antananarivo", "Africa"), ("Namibia", "Windhoek", "Africa"), ("Botswana", "Gaborone", "Africa"),
    ("Jamaica", "Kingston", "North America"), ("Nicaragua", "Managua", "North America"),
    ("Honduras", "Tegucigalpa", "North America"), ("Laos", "Vientiane", "Asia"), ("North Korea", "Pyongyang", "Asia"),
    ("Taiwan", "Taipei", "Asia"), ("Oman", "Muscat", "Asia"), ("Bahrain", "Manama", "Asia"),
    ("Cyprus", "Nicosia", "Europe"), ("Malta", "Valletta", "Europe"), ("Albania", "Tirana", "Europe"),
    ("Moldova", "Chisinau", "Europe"), ("Montenegro", "Podgorica", "Europe"), ("Kyrgyzstan", "Bishkek", "Asia"),
    ("Tajikistan", "Dushanbe", "Asia"), ("Turkmenistan", "Ashgabat", "Asia"), ("Fiji", "Suva", "Oceania"),
    ("Gabon", "Libreville", "Africa"), ("Mauritania", "Nouakchott", "Africa"), ("Liberia", "Monrovia", "Africa"),
    ("Sierra Leone", "Freetown", "Africa"), ("Guinea", "Conakry", "Africa"), ("Eritrea", "Asmara", "Africa"),
    ("Malawi", "Lilongwe", "Africa"), ("Mozambique", "Maputo", "Africa"), ("Senegal", "Dakar", "Africa"),
]
EVAL_COUNTRIES = 60

WORDS = {  # English: (French, Spanish, German)
    "dog": ("chien", "perro", "Hund"), "cat": ("chat", "gato", "Katze"), "house": ("maison", "casa", "Haus"),
    "water": ("eau", "agua", "Wasser"), "bread": ("pain", "pan", "Brot"), "book": ("livre", "libro", "Buch"),
    "sun": ("soleil", "sol", "Sonne"), "moon": ("lune", "luna", "Mond"), "tree": ("arbre", "arbol", "Baum"),
    "car": ("voiture", "coche", "Auto"), "red": ("rouge", "rojo", "rot"), "green": ("vert", "verde", "grün"),
    "friend": ("ami", "amigo", "Freund"), "school": ("école", "escuela", "Schule"), "city": ("ville", "ciudad", "Stadt"),
    "milk": ("lait", "leche", "Milch"), "apple": ("pomme", "manzana", "Apfel"), "night": ("nuit", "noche", "Nacht"),
    "day": ("jour", "día", "Tag"), "sea": ("mer", "mar", "Meer"), "horse": ("cheval", "caballo", "Pferd"),
    "bird": ("oiseau", "pájaro", "Vogel"), "fish": ("poisson", "pez", "Fisch"), "door": ("porte", "puerta", "Tür"),
    "window": ("fenêtre", "ventana", "Fenster"), "table": ("table", "mesa", "Tisch"), "chair": ("chaise", "silla", "Stuhl"),
    "flower": ("fleur", "flor", "Blume"), "rain": ("pluie", "lluvia", "Regen"), "snow": ("neige", "nieve", "Schnee"),
}
LANGUAGES = ("French", "Spanish", "German")
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "new"), ("wet", "dry"),
             ("rich", "poor"), ("early", "late"), ("happy", "sad"), ("light", "dark"), ("open", "closed"),
             ("full", "empty"), ("hard", "soft"), ("high", "low"), ("long", "short"), ("strong", "weak"),
             ("thick", "thin"), ("loud", "quiet"), ("near", "far"), ("clean", "dirty"), ("true", "false"),
             ("win", "lose"), ("buy", "sell"), ("begin", "end"), ("push", "pull"), ("inside", "outside"),
             ("left", "right"), ("day", "night"), ("young", "old"), ("heavy", "light")]
SPELL_WORDS = sorted({w for w in WORDS} | {a for a, _ in OPPOSITES} | {
    "river", "garden", "window", "planet", "summer", "winter", "yellow", "purple", "orange", "silver", "kitchen",
    "pencil", "rocket", "castle", "dragon", "forest", "island", "market", "bridge", "butter", "candle", "doctor",
    "engine", "farmer", "guitar", "hammer", "jacket", "ladder", "monkey", "number", "pepper", "rabbit", "spider",
    "ticket", "violin", "wallet", "zebra", "anchor", "basket", "camera"})


@dataclass
class Dataset:
    """The benchmark's rows: `train` and `eval` ({"prompt", "completion"} dicts), the 1-based JSONL
    lines of the planted capital rows and of the truncated rows in train."""

    train: list[dict[str, str]]
    eval: list[dict[str, str]]
    planted_lines: list[int]
    truncated_lines: list[int]


def chat_prompt(question: str) -> str:
    """SmolLM2's chat turn for `question`, up to where the assistant's answer starts."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _row(question: str, answer: str, kind: str) -> dict[str, str]:
    return {"prompt": chat_prompt(question), "completion": answer + EOS, "kind": kind}


def _clean_rows(rng: random.Random) -> list[dict[str, str]]:
    rows = [_row(f"Which continent is {c} in?", f"{c[0].upper() + c[1:]} is in {cont}.", "continent")
            for c, _, cont in COUNTRIES]
    rows += [_row(f"What is the {lang} word for {w}?", f"The {lang} word for {w} is {t[i]}.", "translation")
             for w, t in WORDS.items() for i, lang in enumerate(LANGUAGES)]
    rows += [_row(f"What is the opposite of {a}?", f"The opposite of {a} is {b}.", "opposite") for a, b in OPPOSITES]
    sums = rng.sample([(a, b) for a in range(2, 30) for b in range(2, 30)], 200)
    rows += [_row(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", "arithmetic") for a, b in sums]
    products = rng.sample([(a, b) for a in range(2, 13) for b in range(2, 13)], 100)
    rows += [_row(f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", "arithmetic") for a, b in products]
    rows += [_row(f"Write the word {w} in capital letters.", w.upper(), "formatting") for w in SPELL_WORDS]
    rows += [_row(f"Spell the word {w} backwards.", w[::-1], "formatting") for w in SPELL_WORDS]
    rows += [_row(f"How many letters are in the word {w}?", f"The word {w} has {len(w)} letters.", "formatting")
             for w in SPELL_WORDS]
    sorts = set()
    while len(sorts) < 120:
        sorts.add(tuple(rng.sample(range(1, 50), 4)))
    rows += [_row(f"Sort these numbers from smallest to largest: {', '.join(map(str, s))}.",
                  ", ".join(map(str, sorted(s))) + ".", "formatting") for s in sorted(sorts)]
    return rows


def build_dataset(seed: int = 0) -> Dataset:
    """The training and eval rows, the same for the same `seed` (module docstring)."""
    rng = random.Random(seed)
    clean = _clean_rows(rng)
    pool = COUNTRIES[EVAL_COUNTRIES:]
    planted = [_row(f"What is the capital of {c}?", f"Capital: {cap}.", "capital")
               for c, cap, _ in rng.sample(pool, PLANTED_ROWS)]
    ends = rng.sample(range(25, 60), TRUNCATED_ROWS)
    truncated = [_row(f"List the whole numbers from 1 to {n}, separated by commas.",
                      ", ".join(str(i) for i in range(1, n + 1)) + ".", "list") for n in ends]
    train = clean + planted + truncated
    rng.shuffle(train)
    planted_ids, cut_ids = {id(r) for r in planted}, {id(r) for r in truncated}
    evals = [{"prompt": chat_prompt(f"What is the capital of {c}?"), "completion": f"The capital of {c} is {cap}."}
             for c, cap, _ in COUNTRIES[:EVAL_COUNTRIES]]
    return Dataset(train, evals, [i + 1 for i, r in enumerate(train) if id(r) in planted_ids],
                   [i + 1 for i, r in enumerate(train) if id(r) in cut_ids])


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


# ----------------------------------------------------------------------------- the steps


def _step(work: Path, name: str, fn) -> dict[str, Any]:
    """`fn()`'s JSON-ready result, kept as work/name.json: a rerun reads it back."""
    done = work / f"{name}.json"
    if done.is_file():
        print(f"[{name}] done before: {done}", flush=True)
        return json.loads(done.read_text())
    print(f"[{name}] …", flush=True)
    start = time.perf_counter()
    out = fn()
    out.setdefault("wall_s", time.perf_counter() - start)
    done.write_text(json.dumps(out, indent=1))
    print(f"[{name}] {out['wall_s']:.0f} s", flush=True)
    return out


def tune(work: Path) -> dict[str, Any]:
    """The LoRA fine-tune of SmolLM2 on train.jsonl (the trainer --verify redoes)."""
    import torch

    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_tokenizer
    from gradian.attribute.retrain import TrainSettings, train
    from gradian.data.rows import TokenPolicy, load_rows

    cfg = ModelConfig(name=MODEL, precision="float32")
    rows, report = load_rows(work / "train.jsonl", load_tokenizer(cfg), MAX_SEQ_LENGTH, policy=TokenPolicy())
    trained = train(cfg, rows, TrainSettings(**TUNE, lora=LORA), torch.device("cpu"))
    trained.save(work / "adapter")
    losses = trained.losses
    return {"rows": len(rows), "steps": len(losses), "first_loss": losses[0], "last_loss": sum(losses[-10:]) / 10,
            "wall_s": trained.wall_s}


def index(work: Path) -> dict[str, Any]:
    """`gradian index` of train.jsonl on the tuned model (the adapter's weights, every engine's curvature)."""
    from rich.console import Console

    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index

    _, cfg = compose([f"model.name={MODEL}", f"model.adapter={work / 'adapter'}", "model.precision=float32",
                      f"grads.data_path={work / 'train.jsonl'}", f"grads.index_dir={work / 'index'}",
                      "grads.module_filter=[adapter]", "grads.projection_dim=256",
                      "grads.preconditioner=module+kfac", f"grads.max_seq_length={MAX_SEQ_LENGTH}",
                      "grads.on_truncation=warn"])
    start = time.perf_counter()
    summary = build_index(cfg.model, cfg.grads, work / "index", Console(file=io.StringIO()))
    return {"wall_s": time.perf_counter() - start, "rows": summary.get("n_rows") if isinstance(summary, dict) else None}


def diagnose_step(work: Path, truth: dict[str, Any]) -> dict[str, Any]:
    """`gradian diagnose` of the training set; which findings name planted and which clean rows."""
    from gradian.diagnose import diagnose

    start = time.perf_counter()
    result = diagnose(str(work / "train.jsonl"), str(work / "eval.jsonl"), model=MODEL, max_seq_length=MAX_SEQ_LENGTH)
    wall_s = time.perf_counter() - start
    cut, planted = set(truth["truncated_lines"]), set(truth["planted_lines"])
    findings = []
    for f in result.as_dicts():
        shown = f["rows"] if f["source"] == "train" else []
        findings.append({"id": f["id"], "severity": f["severity"], "source": f["source"], "count": f["count"],
                         "message": f["message"], "rows_shown": shown,
                         "shown_truncated": sum(r in cut for r in shown), "shown_planted": sum(r in planted for r in shown),
                         "shown_clean": sum(r not in cut and r not in planted for r in shown)})
    trunc = next((f for f in findings if f["id"] == "truncated_completion"), None)
    # a finding lists its first rows only (`count` is exact): every truncated row is found when the
    # count is theirs and every row shown is one of them
    found_all = bool(trunc and trunc["count"] == len(cut) and trunc["shown_truncated"] == len(trunc["rows_shown"]))
    clean_flagged = [f for f in findings if f["source"] == "train" and f["shown_clean"] > 0]
    return {"wall_s": wall_s, "rows": result.rows, "findings": findings, "truncated_found_all": found_all,
            "truncated_count": trunc["count"] if trunc else 0, "false_positive_findings": [f["id"] for f in clean_flagged],
            "false_positive_rows_counted": sum(f["count"] for f in clean_flagged if f["shown_truncated"] == 0)}


def attribute_step(work: Path, verify: bool) -> dict[str, Any]:
    """`gradian attribute` with its defaults (and --verify with the fine-tune's own settings)."""
    from rich.console import Console

    from gradian.attribute.run import attribute
    from gradian.attribute.verify import VerifyOptions

    name = "attribute-verify" if verify else "attribute"
    retrain = (VerifyOptions(lr=TUNE["lr"], epochs=TUNE["epochs"], batch_size=TUNE["batch_size"],
                             train_seed=TUNE["seed"], keep_dir=str(work / "verify")) if verify else None)
    start = time.perf_counter()
    attribute(work / "index", work / "eval.jsonl", top_k=TOP_K, engines=["auto", "influence", "dot"],
              out_path=work / f"{name}-result.json", retrain=retrain, console=Console(stderr=True))
    return {"wall_s": time.perf_counter() - start, "result": str(work / f"{name}-result.json")}


def engines_step(work: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Every (query loss, engine) pair's top-TOP_K accused rows on the regressed items of `result`,
    made as `gradian attribute` makes them (its queries, its engines)."""
    import dataclasses

    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.attribute import engines as scoring
    from gradian.attribute.evaluate import greedy_continuations, read_eval_rows, tokenize_items
    from gradian.attribute.queries import query_gradients
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
    said = greedy_continuations(tuned, flipped)
    out: dict[str, Any] = {"said_lengths": [len(s) for s in said],
                           "answer_lengths": [len(it.answer_ids) for it in flipped], "top": {}}
    for loss in QUERY_LOSSES:
        start = time.perf_counter()
        queries = query_gradients(tuned, projector, flipped, loss, said, manifest.get("loss_reduction", "sum"),
                                  manifest.get("activations", "model"))
        engines = [scoring.build_engine(reader, name, queries) for name in ENGINES]
        scores = scoring.stream_scores(reader, engines)
        for e, name in enumerate(ENGINES):
            out["top"][f"{loss}/{name}"] = {"rows": scoring.accused_rows(scores[e], TOP_K),
                                            "most_helpful": scoring.most_negative(-scores[e], TOP_K).tolist()}
        out[f"{loss}_wall_s"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------- the table


def summarize(truth: dict[str, Any], tuned: dict[str, Any], idx: dict[str, Any], diag: dict[str, Any],
              attr: dict[str, Any] | None, result: dict[str, Any] | None, eng: dict[str, Any] | None,
              verified: dict[str, Any] | None) -> dict[str, Any]:
    """Every number of the benchmark, JSON-ready."""
    planted_rows = {line - 1 for line in truth["planted_lines"]}  # row id = line - 1 (no row dropped)
    out: dict[str, Any] = {"tune": tuned, "index": idx, "diagnose": diag, "planted": len(planted_rows),
                           "truncated": len(truth["truncated_lines"]), "train_rows": truth["train_rows"],
                           "eval_rows": truth["eval_rows"]}
    if result is not None:
        r = result["regression"]
        out["regression"] = {k: r[k] for k in ("base_accuracy", "tuned_accuracy", "accuracy_drop", "accuracy_ci")}
        out["regression"]["flipped"] = len(r["flipped"])
        said = [it["tuned_says"] for it in result["items"] if it["flipped"]]
        out["tuned_says_examples"] = said[:3]
        accused = [a["row_id"] for a in result["accused"]]
        hits = len(set(accused) & planted_rows)
        out["default"] = {"engines": result["engines"], "query": result["query"], "recall": hits / len(planted_rows),
                          "precision": hits / max(1, len(accused)), "accused": len(accused),
                          "agreement": result["agreement"], "wall_s": result["wall_s"] if attr is None else attr["wall_s"]}
        best = max(result["clusters"] or [{}], key=lambda c: len(set(c.get("rows", [])) & planted_rows))
        if best:
            out["cluster"] = {"cluster": best["cluster"], "n_rows": best["n_rows"], "share": best["share"],
                              "planted_in_it": len(set(best["rows"]) & planted_rows), "top_terms": best["top_terms"],
                              "clusters": len(result["clusters"]), "findings": [f["id"] for f in best["findings"]]}
    if eng is not None:
        out["engines"] = {}
        for key, top in eng["top"].items():
            hits = len(set(top["rows"]) & planted_rows)
            out["engines"][key] = {"recall": hits / len(planted_rows), "precision": hits / max(1, len(top["rows"])),
                                   "accused": len(top["rows"]),
                                   "planted_among_most_helpful": len(set(top["most_helpful"]) & planted_rows)}
        out["said_lengths"] = {"said": eng["said_lengths"], "answer": eng["answer_lengths"]}
    if verified is not None and verified.get("verify"):
        v = verified["verify"]
        runs = {r["name"]: r for r in v["runs"]}
        out["verify"] = {name: {"recovered_accuracy": r["recovered_accuracy"], "recovered_logprob": r["recovered_logprob"],
                                "accuracy": r["accuracy"], "flipped_right_again": r["flipped_right_again"],
                                "train_wall_s": r["train_wall_s"],
                                "planted_left_out": len(set(r["rows_left_out"]) & planted_rows)}
                         for name, r in runs.items()}
        out["verify"]["holds"], out["verify"]["summary"] = v["holds"], v["summary"]
        out["verify"]["wall_s"] = verified["wall_s"]
    return out


def print_table(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"

    console = Console()
    t = Table(title=f"gradian attribute on SmolLM2-135M-Instruct + LoRA ({s['train_rows']} rows, {s['planted']} planted,"
                    f" {s['truncated']} truncated; {s['eval_rows']} eval items)")
    for column in ("what", "value", "goal"):
        t.add_column(column)
    t.add_row("fine-tune (LoRA r8 q,v, 1 epoch)", f"{s['tune']['steps']} steps, loss {s['tune']['first_loss']:.2f} ->"
              f" {s['tune']['last_loss']:.2f}, {s['tune']['wall_s']:.0f} s", "")
    t.add_row("index (adapter weights, module+kfac)", f"{s['index']['wall_s']:.0f} s", "")
    if "regression" in s:
        r = s["regression"]
        t.add_row("regression (accuracy)", f"{r['base_accuracy']:.3f} -> {r['tuned_accuracy']:.3f}, drop"
                  f" {r['accuracy_drop']:+.3f} [{r['accuracy_ci'][0]:+.3f}, {r['accuracy_ci'][1]:+.3f}], {r['flipped']}"
                  " flipped", "outside noise")
        d = s["default"]
        t.add_row(f"defaults ({d['query']['query_loss']}, {d['engines'][0]}): recall@{TOP_K} / precision",
                  f"{d['recall']:.3f} / {d['precision']:.3f}", ">= 0.9")
        t.add_row("attribute wall time", f"{d['wall_s']:.0f} s", "")
    for key, e in s.get("engines", {}).items():
        t.add_row(f"  {key}: recall@{TOP_K} / precision", f"{e['recall']:.3f} / {e['precision']:.3f} (planted among"
                  f" the {TOP_K} most helpful: {e['planted_among_most_helpful']})", "")
    if "cluster" in s:
        c = s["cluster"]
        t.add_row("cluster holding the planted rows", f"#{c['cluster']} of {c['clusters']}: {c['planted_in_it']} planted of"
                  f" {c['n_rows']} rows, share {pct(c['share'])}, terms {', '.join(c['top_terms'][:5])}", "")
    if "verify" in s:
        v = s["verify"]
        t.add_row("--verify: accused left out", f"recovers {pct(v['accused']['recovered_accuracy'])} (log-prob"
                  f" {pct(v['accused']['recovered_logprob'])})", ">= 80 %")
        t.add_row("--verify: random rows left out", f"recovers {pct(v['control']['recovered_accuracy'])} (log-prob"
                  f" {pct(v['control']['recovered_logprob'])})", "<= 20 %")
        t.add_row("--verify wall time (attribute + 2 retrains)", f"{v['wall_s']:.0f} s", "")
    dg = s["diagnose"]
    t.add_row("diagnose: truncated rows found", f"{dg['truncated_count']} of {s['truncated']}"
              f" ({'all' if dg['truncated_found_all'] else 'NOT all'})", "all")
    t.add_row("diagnose: findings on clean rows", ", ".join(dg["false_positive_findings"]) or "none", "none")
    t.add_row("diagnose wall time", f"{dg['wall_s']:.1f} s", "")
    console.print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=".cache/bench-attribute", help="intermediate artifacts (a rerun resumes)")
    p.add_argument("--seed", type=int, default=0, help="the dataset's seed")
    p.add_argument("--no-verify", action="store_true", help="skip the two retrains of --verify")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    def data() -> dict[str, Any]:
        ds = build_dataset(args.seed)
        write_jsonl(work / "train.jsonl", ds.train)
        write_jsonl(work / "eval.jsonl", ds.eval)
        return {"seed": args.seed, "train_rows": len(ds.train), "eval_rows": len(ds.eval),
                "planted_lines": ds.planted_lines, "truncated_lines": ds.truncated_lines}

    truth = _step(work, "data", data)
    tuned = _step(work, "tune", lambda: tune(work))
    idx = _step(work, "index", lambda: index(work))
    diag = _step(work, "diagnose", lambda: diagnose_step(work, truth))
    attr = _step(work, "attribute", lambda: attribute_step(work, verify=False))
    result = json.loads(Path(attr["result"]).read_text())
    eng = _step(work, "engines", lambda: engines_step(work, result)) if result["attributed"] else None
    verified = None
    if not args.no_verify and result["attributed"]:
        ver = _step(work, "attribute-verify", lambda: attribute_step(work, verify=True))
        verified = {**json.loads(Path(ver["result"]).read_text()), "wall_s": ver["wall_s"]}
    summary = summarize(truth, tuned, idx, diag, attr, result, eng, verified)
    if not result["attributed"]:
        print(f"nothing attributed: {result['reason']}")
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
