"""`gradian attribute`: which training rows broke a behaviour the base model had.

    1. the regression, measured   both models on the eval set; accuracy drop with a paired bootstrap
                                  CI (`regression`); inside the noise band: stop, nothing attributed
    2. query gradients            of the flipped items on the tuned model, through the index's
                                  capture and projection (`queries`: contrastive, ce or margin)
    3. ranking                    every indexed row scored by each engine (`engines`); the first
                                  engine's most negative rows are accused, the others say how far
                                  they agree
    3b. --checkpoints             the tracin engines: steps 2-3 on every checkpoint of the run, each
                                  with its own index, weighted by its learning rate (`checkpoints`)
    4. spans                      the sentences of long accused rows, each with its own gradient
                                  and score (`spans`)
    5. clusters                   of the accused rows, with the `gradian diagnose` findings they
                                  share (`clusters`, `rows`), grouped into the lessons their rows
                                  teach, with the rows teaching them that were not accused (`lessons`)
    6. base-model blame           items the base model got wrong already or barely right (`regression`)
    7. --verify                   the fine-tune redone without the accused rows and without as many
                                  random rows, both scored on the eval set (`verify`, `retrain`)

The tuned model is the index's (`model`, with the adapter it records); the base model is that model
without its adapter, or `--base-model`, or the index's `model.base_name` for a full fine-tune.
Everything that can be refused without a model (arguments, the eval set's rows, the index, where
`--out` goes, --verify's settings and data) is refused before one loads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from circuitkit.core.device import release_memory
from circuitkit.core.errors import UserError
from circuitkit.core.io import check_not_an_input, check_writable, sha256_file
from circuitkit.core.progress import Progress
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import (
    ModelReferenceError,
    check_base_model,
    context_length,
    load_model,
    load_tokenizer,
    pretrained_args,
)
from circuitkit.models.lora import read_adapter
from gradian.attribute import checkpoints as tracing
from gradian.attribute import clusters as clustering
from gradian.attribute import engines as scoring
from gradian.attribute import lessons as teaching
from gradian.attribute import precision as precisions
from gradian.attribute import spans as drilling
from gradian.attribute.embeddings import choose_method
from gradian.attribute.evaluate import (
    EvalItem,
    ItemScores,
    ended_by,
    greedy_continuations,
    preview,
    read_eval_rows,
    score_items,
    tokenize_items,
)
from gradian.attribute.queries import QUERY_LOSSES, query_gradients, query_record
from gradian.attribute.regression import BOOTSTRAP_RESAMPLES, THIN_MARGIN, base_blame, measure_regression
from gradian.attribute.result import AttributionResult, write_result
from gradian.attribute.rows import BACKGROUND_ROWS, read_texts, row_lines, training_findings
from gradian.attribute.verify import VerifyOptions, plan_verify, run_verify
from gradian.build.checks import check_input_file, tokenizer_hash
from gradian.data.rows import policy_of
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.rank.checks import asked_adapter, check_compatible, compare_adapter
from gradian.rank.ranking import check_output_file
from gradian.rank.results import training_source

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 40
QUERY_CHUNK = 64  # regressed items whose query gradients are held at once


def attribute_inputs(index_dir: str | Path, eval_path: str | Path, adapter: str | None = None) -> list[tuple[str, Path]]:
    """What the command reads (no output may be one of them): the eval set, the index, its training
    data, the adapter directory."""
    inputs = [("--eval-dataset", Path(eval_path)), ("the index", Path(index_dir))]
    try:
        data = IndexReader(Path(index_dir)).manifest.get("data_file")
    except (UserError, ValueError, OSError):
        data = None
    if isinstance(data, str) and data:
        inputs.append(("the index's training data", Path(data)))
    if adapter not in (None, "index"):
        inputs.append(("--adapter", Path(adapter)))
    return inputs


def _check_index(index_dir: str | Path) -> IndexReader:
    """The index, with every row stored: UserError (exit code 1) when rows are missing."""
    reader = IndexReader(Path(index_dir))
    manifest = reader.manifest
    if not isinstance(manifest.get("model"), str) or not manifest.get("tokenizer_sha256"):
        raise UserError(f"{index_dir} is not an index `gradian index` made (its manifest names no model or tokenizer):"
                        " attribute needs the model the rows were indexed on; rebuild it with `gradian index`.",
                        exit_code=1)
    if int(manifest.get("n_rows") or 0) == 0:
        raise UserError(f"{index_dir} holds no rows (n_rows 0): index the training data first (`gradian index"
                        " grads.data_path=TRAIN.jsonl ...`).", exit_code=1)
    if not reader.complete:
        why = "; ".join(reader.missing()) or "its manifest says it is incomplete"
        raise UserError(f"{index_dir} does not hold every training row ({why}): an accusation over part of the rows"
                        " would miss the others; resume the index with the `gradian index` command that made it.",
                        exit_code=1)
    return reader


def _base_config(manifest: dict[str, Any], base_model: str | None) -> tuple[ModelConfig, str]:
    """(the base model's config, how it was chosen), checked to resolve (exit code 2 otherwise)."""
    precision = manifest.get("precision", "bfloat16")
    if base_model:
        cfg, how, named = ModelConfig(name=base_model, precision=precision), "--base-model", "--base-model"
    elif manifest.get("adapter"):
        cfg = ModelConfig(name=manifest["model"], revision=manifest.get("revision"),
                          gguf_file=manifest.get("gguf_file"), precision=precision)
        how, named = "the index's model without its adapter", "the index's model"
    elif manifest.get("base_name"):
        cfg = ModelConfig(name=manifest["base_name"], precision=precision)
        how = named = "the index's model.base_name"
    else:
        raise UserError(f"the index's model {manifest['model']!r} has no adapter and the index records no"
                        " model.base_name: give the model it was fine-tuned from with --base-model NAME_OR_DIR.",
                        exit_code=2)
    try:
        pretrained_args(cfg)
    except ModelReferenceError as err:  # its message says model.name: here that is the base model
        raise ModelReferenceError(str(err).replace("model.name", named, 1)) from None
    if cfg.name != manifest["model"]:  # a full fine-tune keeps its base model's shape
        try:
            check_base_model(ModelConfig(name=manifest["model"], revision=manifest.get("revision"),
                                         gguf_file=manifest.get("gguf_file"), base_name=cfg.name, precision=precision))
        except ModelReferenceError as err:
            text = str(err).replace("model.base_name", named, 1).replace("model.name", "the index's model", 1)
            raise ModelReferenceError(text) from None
    return cfg, how


def _tuned_config(manifest: dict[str, Any], adapter: str | None, precision: str | None = None) -> ModelConfig:
    """The tuned model's config: the index's model with `adapter` ("index": the one it records), in
    `precision` (default: the index's)."""
    cfg = ModelConfig(name=manifest["model"], revision=manifest.get("revision"), gguf_file=manifest.get("gguf_file"),
                      precision=precision or manifest.get("precision", "bfloat16"))
    return dataclasses.replace(cfg, adapter=adapter if adapter not in (None, "index")
                               else asked_adapter(manifest, adapter))


def _tuned_model(manifest: dict[str, Any], adapter: str | None, precision: str | None = None):
    """The tuned model: the index's, with `adapter` ("index": the one it records) kept as LoRA linears,
    in `precision` (default: the index's, the one its rows were made in).

    An adapter directory other than the index's is loaded first, so that one made for another base
    model is refused by `circuitkit.models.lora`'s fit check (naming both), then compared with the
    index's record (IndexMismatchError)."""
    cfg = _tuned_config(manifest, adapter, precision)
    if adapter not in (None, "index"):
        read_adapter(adapter, "--adapter")
        loaded = load_model(cfg, keep_adapter=True)
        compare_adapter(manifest.get("adapter"), loaded.lora, "--adapter")
        return loaded
    return load_model(cfg, keep_adapter=True)



def _item_records(items: list[EvalItem], base: ItemScores, tuned: ItemScores, flipped: list[int],
                  said: dict[int, tuple[str, str]], near_ties: list[int] | None = None) -> list[dict[str, Any]]:
    def scores(s: ItemScores, i: int) -> dict[str, Any]:
        return {"logprob": float(s.logprob[i]), "margin": float(s.margin[i]), "first": bool(s.first[i]),
                "exact": bool(s.exact[i])}
    flips = set(flipped)
    return [{"item": it.item, "line": it.line, "prompt": preview(it.prompt), "answer": it.answer,
             "base": scores(base, it.item), "tuned": scores(tuned, it.item), "flipped": it.item in flips,
             "tuned_says": said[it.item][0] if it.item in said else None,
             "tuned_says_end": said[it.item][1] if it.item in said else None,
             "near_tie": (it.item in near_ties) if near_ties is not None and it.item in flips else None}
            for it in items]


def attribute(index_dir: str | Path, eval_path: str | Path, base_model: str | None = None,
              adapter: str | None = "index", top_k: int = DEFAULT_TOP_K, query_loss: str = "contrastive",
              engines: list[str] | tuple[str, ...] = ("auto",), out_path: str | Path | None = None, seed: int = 0,
              resamples: int = BOOTSTRAP_RESAMPLES, thin_margin: float = THIN_MARGIN, verify: bool = True,
              span_min_tokens: int = drilling.DEFAULT_MIN_TOKENS, retrain: VerifyOptions | None = None,
              console: Console | None = None, checkpoints: str | None = None,
              checkpoint_lrs: list[float] | None = None, precision: str = "index") -> AttributionResult:
    """Measure the tuned model's regression on `eval_path` against its base model and, when it is
    outside the noise band, rank the index's training rows by how much they caused it.

    `adapter`: "index" (the index's recorded adapter), None (none), or a directory (refused unless it
    is the index's). `engines`: engine names (`gradian.attribute.engines`, "auto" = gradian rank's
    default score); the first accuses. `seed` / `resamples`: the paired bootstrap's (`seed` also draws
    --verify's control rows). `verify`: check each shard's sha256 while streaming. `span_min_tokens`:
    accused rows with at least this many supervised tokens are drilled into (0: none). `retrain`:
    --verify's settings (None: nothing is retrained). `checkpoints` / `checkpoint_lrs`: the run's
    checkpoints and their learning rates, read by the tracin engines (`gradian.attribute.checkpoints`,
    `plan_checkpoints`). `precision`: the dtype both models are evaluated in
    (`gradian.attribute.precision`; the query gradients stay in the index's). Writes the result to `out_path` (atomic JSON)
    when given. Raises UserError (exit code 2: an argument or a model that
    does not fit; 1: bad file content) and IndexMismatchError (another model than the index's).
    """
    start = time.perf_counter()
    console = console or Console(stderr=True)
    say = console.print
    if query_loss not in QUERY_LOSSES:
        raise UserError(f"--query-loss {query_loss!r}; valid: {', '.join(QUERY_LOSSES)}.", exit_code=2)
    if top_k < 1:
        raise UserError(f"--top-k {top_k}: it must be >= 1.", exit_code=2)
    if resamples < 100:
        raise UserError(f"--bootstrap {resamples}: at least 100 resamples are needed for a 95 % interval.", exit_code=2)
    if span_min_tokens < 0:
        raise UserError(f"--span-min-tokens {span_min_tokens}: give 0 (no drill-down) or more.", exit_code=2)
    check_input_file(Path(eval_path), "--eval-dataset")
    if out_path is not None:
        check_output_file(Path(out_path), "--out")
        check_not_an_input(Path(out_path), "--out", attribute_inputs(index_dir, eval_path, adapter))
    reader = _check_index(index_dir)
    manifest = reader.manifest
    names = scoring.resolve_engines(list(engines), manifest)
    evaluated = precisions.eval_precision(precision, manifest)
    index_precision = str(manifest.get("precision", "bfloat16"))
    if retrain is not None and evaluated.used != index_precision:
        raise UserError(f"--verify scores its retrained models in the index's precision ({index_precision}), against"
                        f" base and tuned scores that --precision {precision} puts in {evaluated.used}: leave"
                        " --precision out (or give --precision index) with --verify.", exit_code=2)
    say(precisions.precision_line(evaluated, index_precision), markup=False, highlight=False)
    traced_plan = _checkpoint_plan(names, manifest, checkpoints, checkpoint_lrs, say)
    rows = read_eval_rows(eval_path)
    base_cfg, how = _base_config(manifest, base_model)
    plan = None
    if retrain is not None:
        if retrain.keep_dir:
            check_not_an_input(Path(retrain.keep_dir), "--verify-dir", attribute_inputs(index_dir, eval_path, adapter))
            check_writable(Path(retrain.keep_dir), "--verify-dir", directory=True)
        plan = plan_verify(manifest, base_cfg, retrain, seed, adapter if adapter not in (None, "index") else None)
    if tokenizer_hash(load_tokenizer(base_cfg)) != manifest.get("tokenizer_sha256"):
        raise IndexMismatchError(f"the base model {base_cfg.name!r} ({how}) has another tokenizer than the index's"
                                 " model: their answers' log-probabilities are not comparable; give the model the"
                                 " index's model was tuned from (--base-model).")

    tuned = _tuned_model(manifest, adapter)
    projector = check_compatible(manifest, tuned, index_dir)
    items = tokenize_items(rows, tuned.tokenizer, policy_of(manifest), context_length(tuned.model.config),
                           f"--eval-dataset {eval_path}")
    if evaluated.used != index_precision:  # the eval's own dtype now; the gradients' model is loaded again
        del tuned
        release_memory()
        tuned = _tuned_model(manifest, adapter, evaluated.used)
    say(f"scoring {len(items)} eval items on the tuned model and on the base model ({base_cfg.name}) …",
        markup=False, highlight=False)
    with Progress(console, "scoring the eval set on the tuned model", len(items), "items", announce=True) as bar:
        tuned_scores = score_items(tuned, items, bar=bar)
    base = load_model(dataclasses.replace(base_cfg, precision=evaluated.used))
    with Progress(console, "scoring the eval set on the base model", len(items), "items", announce=True) as bar:
        base_scores = score_items(base, items, bar=bar)
    del base  # the gradients below need the tuned model only
    release_memory()
    regression = measure_regression(base_scores, tuned_scores, seed, resamples)
    blame = base_blame(base_scores, tuned_scores, thin_margin)
    flipped = [items[i] for i in regression.flipped]
    said_ids = greedy_continuations(tuned, flipped) if flipped else []
    said = {it.item: (tuned.tokenizer.decode(ids), ended_by(ids, tuned.tokenizer))
            for it, ids in zip(flipped, said_ids, strict=True)}
    near_tie = None
    if regression.significant and flipped:
        say(f"checking the {len(flipped)} flipped items in {precisions.other_precision(evaluated.used)} (near-ties) …",
            markup=False, highlight=False)
        near_tie = precisions.near_tie_check(base_cfg, _tuned_config(manifest, adapter), items, regression.flipped,
                                             evaluated.used)
    if regression.significant and evaluated.used != index_precision:
        del tuned  # the query gradients need the index's weights
        release_memory()
        tuned = _tuned_model(manifest, adapter)
    eval_sha = sha256_file(Path(eval_path))
    models = {"tuned": {"name": manifest["model"], "revision": manifest.get("revision"),
                        "precision": manifest.get("precision"), "weights_sha256": manifest.get("weights_sha256"),
                        "adapter": manifest.get("adapter")},
              "base": {"name": base_cfg.name, "revision": base_cfg.revision, "precision": evaluated.used,
                       "how": how}}
    result = AttributionResult(
        attributed=False, reason=regression.reason, index=str(index_dir), eval_dataset=str(eval_path),
        eval_sha256=eval_sha, models=models, query=query_record(query_loss, manifest), engines=names,
        damping={}, seeds={"bootstrap": seed, **({"control": seed, "train": plan.settings.seed} if plan else {})},
        regression=regression.as_dict(), base_blame=blame.as_dict(),
        items=_item_records(items, base_scores, tuned_scores, regression.flipped, said,
                            near_tie["items"] if near_tie else None), top_k=top_k,
        precision={"requested": evaluated.requested, "used": evaluated.used, "note": evaluated.note,
                   "index": index_precision, "queries": index_precision, "near_tie": near_tie})
    if regression.significant:
        _rank(result, reader, tuned, projector, flipped, said_ids, query_loss, names, top_k, verify, say,
              span_min_tokens, traced_plan)
        if plan is not None and result.accused:
            tokenizer = tuned.tokenizer
            del tuned  # the retrains load their own models
            release_memory()
            result.verify = run_verify(plan, manifest, tokenizer, {a["row_id"]: a["line"] for a in result.accused},
                                       items, base_scores, tuned_scores, regression.flipped, said_ids, say)
    result.wall_s = time.perf_counter() - start
    if out_path is not None:
        write_result(out_path, result)
    return result


def _checkpoint_plan(names: list[str], manifest: dict[str, Any], checkpoints: str | None,
                     lrs: list[float] | None, say) -> tracing.CheckpointPlan | None:
    """The run's checkpoints when a tracin engine is asked (UserError, exit code 2, when they are given
    without one or one is asked without them), before any model loads; its note said."""
    asked = [n for n in names if tracing.is_tracin(n)]
    if checkpoints is None:
        if asked or lrs is not None:
            raise UserError(f"{'--engines ' + asked[0] if asked else '--checkpoint-lrs'} reads the fine-tune's"
                            " checkpoints: give them with --checkpoints DIR (the Trainer's output directory) or"
                            " --checkpoints A,B,C (adapter directories).", exit_code=2)
        return None
    if not asked:
        raise UserError(f"--checkpoints is read by the tracin engines, and --engines {','.join(names)} names none:"
                        " add one, e.g. --engines tracin,auto.", exit_code=2)
    plan = tracing.plan_checkpoints(checkpoints, manifest, lrs)
    say(f"{len(plan.checkpoints)} checkpoints ({', '.join(c.name for c in plan.checkpoints)}), learning rates from"
        f" {plan.lr_source}", markup=False, highlight=False)
    if plan.note:
        say(f"note: {plan.note}", markup=False, highlight=False)
    return plan


def _rank(result: AttributionResult, reader: IndexReader, tuned, projector, flipped: list[EvalItem],
          said_ids: list[list[int]], query_loss: str, names: list[str], top_k: int, verify: bool, say,
          span_min_tokens: int, traced_plan: tracing.CheckpointPlan | None = None) -> None:
    """Steps 2-5 (module docstring), filled into `result`."""
    manifest = reader.manifest
    console = getattr(say, "__self__", None) or Console(stderr=True)  # progress goes where `say` prints
    say(f"query gradients of {len(flipped)} regressed items ({query_loss}); scoring every row with"
        f" {', '.join(names)} …", markup=False, highlight=False)
    engines = [scoring.build_engine(reader, name) for name in names if not tracing.is_tracin(name)]
    with Progress(console, f"query gradients of the {len(flipped)} regressed items ({query_loss})", len(flipped),
                  "items", announce=True, enabled=bool(engines)) as bar:
        for start in range(0, len(flipped) if engines else 0, QUERY_CHUNK):  # one chunk of full-width gradients at a time
            queries = query_gradients(tuned, projector, flipped[start:start + QUERY_CHUNK], query_loss,
                                      said_ids[start:start + QUERY_CHUNK], manifest.get("loss_reduction", "sum"),
                                      manifest.get("activations", "model"))
            for engine in engines:
                engine.add(queries)
            del queries
            bar.advance(len(flipped[start:start + QUERY_CHUNK]))
    n_rows = int(manifest["n_rows"])
    with Progress(console, f"scoring every indexed row ({', '.join(e.name for e in engines)}) from the shards", n_rows,
                  "rows", announce=True, enabled=bool(engines)) as bar:
        scores = scoring.stream_scores(reader, engines, verify, bar=bar) if engines else None
    traced = None
    if traced_plan is not None:
        traced = tracing.tracin_scores(traced_plan, reader, flipped, said_ids, query_loss,
                                       [n for n in names if tracing.is_tracin(n)], verify, say, QUERY_CHUNK)
        scores = traced.merge(names, [e.name for e in engines], scores)
    accused = scoring.accused_rows(scores[0], top_k)
    lines = row_lines(reader.index_dir, manifest, accused)
    source = training_source(manifest)
    missing = clustering.sklearn_missing()  # without it no clusters, so no background to sample
    texts, background = (read_texts(source, lines.values(), 0 if missing else BACKGROUND_ROWS)
                         if source is not None else ({}, []))
    rows = [clustering.AccusedRow(r, lines.get(r), texts.get(lines.get(r)), float(scores[0, r])) for r in accused]
    result.attributed = True
    result.damping = {e.name: e.damping for e in engines} | (traced.damping if traced else {})
    result.engine_notes = {e.name: e.note for e in engines if e.note} or None
    if traced is not None:
        result.checkpoints = traced.record(accused)
    result.agreement = scoring.agreement(names, scores, top_k)
    result.accused = [{"rank": i, "row_id": r.row_id, "line": r.line, "score": r.score,
                       "text_preview": preview(r.text) if r.text is not None else None, "cluster": None}
                      for i, r in enumerate(rows, start=1)]
    if span_min_tokens > 0 and rows and tracing.is_tracin(names[0]):
        result.spans = {"min_tokens": span_min_tokens, "engine": names[0], "rows": [], "skipped": [],
                        "note": "the sentences are scored on the final adapter only; tracin accuses across the"
                                " checkpoints: no row was drilled into."}
    elif span_min_tokens > 0 and rows:
        result.spans = drilling.drill_down(tuned, projector, engines[0], manifest, reader.index_dir,
                                           [(r.row_id, r.line, r.score) for r in rows], span_min_tokens)
    if missing:
        result.clusters_note = missing
        return
    if not texts:
        result.clusters_note = "the training data cannot be read any more: no clusters (the rows have no text)."
        return
    findings, note = training_findings(manifest, tuned.tokenizer)
    method = choose_method()
    if method.note:
        say(method.note, markup=False, highlight=False)
    special = [t for t in getattr(tuned.tokenizer, "all_special_tokens", None) or [] if isinstance(t, str)]
    result.clusters = clustering.cluster_rows(rows, findings, background, special, method)
    result.clusters_method = method.name
    result.lessons = teaching.lessons_of(rows, result.clusters, source, reader.index_dir, manifest, scores[0],
                                         background, special)
    result.clusters_note = note
    result.lesson_accused = teaching.following_lessons(result.accused, result.lessons, len(result.accused))
    cluster_of = {row: c["cluster"] for c in result.clusters for row in c["rows"]}
    for entry in result.accused:
        entry["cluster"] = cluster_of.get(entry["row_id"])
