"""`gradian attribute`'s arguments and terminal tables (`gradian.cli` hands the command over here).

Importing this module loads no torch (`gradian --help` stays fast): the work is imported when the
command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from circuitkit.core.config import add_schema_flag
from circuitkit.core.errors import UserError, error_console
from circuitkit.core.flags import MAX_COUNT, MAX_SEED, bounded
from gradian.rank.checksum_flag import add_skip_checksums, skip_checksums
from gradian.settings.attribute import AttributeConfig

MAX_LORA_RANK = 1 << 16  # circuitkit.models.lora.MAX_RANK (not imported: that module loads torch)
SHOWN_ITEMS = 10  # flipped items shown on the terminal (all are in --out)
SHOWN_ROWS = 20  # accused rows shown on the terminal
SHOWN_LINES = 8  # line numbers shown per cluster


def _t(value: object) -> Text:
    """A cell shown as written (`[INST]` is text, not rich markup)."""
    return Text(str(value))


def add_parser(sub) -> None:
    """The `attribute` subcommand's arguments (on `gradian.cli`'s subparsers)."""
    p = sub.add_parser("attribute", help="which training rows broke a behaviour the base model had")
    p.add_argument("--index", required=True, help="the gradient index of the fine-tuning data (its model is the tuned"
                   " model, with the adapter it records)")
    p.add_argument("--eval-dataset", required=True, help="JSONL of {prompt, completion} eval items; the completion"
                   " is the answer")
    p.add_argument("--base-model", default=None, metavar="NAME_OR_DIR",
                   help="the model before fine-tuning (default: the index's model without its adapter, or its"
                        " model.base_name for a full fine-tune)")
    p.add_argument("--adapter", default="index", metavar="DIR|none",
                   help="the tuned model's LoRA adapter; by default the index's (another one is refused)")
    # The flags that mirror the attribute stage's keys (attribute.top_k, ...) read them from its schema.
    add_schema_flag(p, AttributeConfig, "top_k")
    add_schema_flag(p, AttributeConfig, "query_loss")
    p.add_argument("--engines", default=None, metavar="E1,E2",
                   help="comma-separated scoring engines, the first accuses, the others report their agreement:"
                        " auto (gradian rank's default score), dot, cosine, influence, kfac, ekfac, datainf, and with"
                        " --checkpoints tracin, tracin-dot (default: auto; tracin,auto with --checkpoints)")
    p.add_argument("--checkpoints", default=None, metavar="DIR|A,B,C",
                   help="TracIn across the fine-tune: its Trainer output directory (checkpoint-*/ adapters, learning"
                        " rates from trainer_state.json) or a comma list of adapter directories; each gets its own"
                        " index under INDEX/checkpoints/ (reused on rerun)")
    p.add_argument("--checkpoint-lrs", default=None, metavar="LR1,LR2",
                   help="the learning rate of each checkpoint, in order (default: trainer_state.json's, else equal)")
    add_schema_flag(p, AttributeConfig, "precision")
    p.add_argument("--out", default=None, help="write the whole result as JSON here (atomic; not one of the inputs)")
    bounded(p.add_argument("--seed", type=int, default=0, help="the paired bootstrap's seed (default 0)"), ge=0,
            le=MAX_SEED)
    add_schema_flag(p, AttributeConfig, "bootstrap", why="at least 100 resamples for a 95 % interval")
    add_skip_checksums(p, "skip checking each shard's sha256 while streaming (not --verify's retraining)")
    add_schema_flag(p, AttributeConfig, "span_min_tokens", le=MAX_COUNT, why="0: no drill-down", metavar="N")
    v = p.add_argument_group("--verify: retrain without the accused rows (and, as a control, without as many random"
                             " rows) and measure the share of the regression each recovers")
    v.add_argument("--verify", action="store_true", help="retrain twice and score both models on the eval set")
    v.add_argument("--train-data", default=None, metavar="FILE", help="the fine-tune's data (default: the index's)")
    bounded(v.add_argument("--lr", type=float, default=None,
                           help="the fine-tune's learning rate (AdamW, constant; required)"),
            gt=0, le=10, why="the fine-tune's learning rate")
    bounded(v.add_argument("--epochs", type=int, default=None, help="passes over the rows (or --steps; one is"
                           " required)"), ge=1, le=MAX_COUNT)
    bounded(v.add_argument("--steps", type=int, default=None, help="optimizer steps (or --epochs)"), ge=0,
            le=MAX_COUNT)
    bounded(v.add_argument("--batch-size", type=int, default=None, help="rows per step (default 8)"), ge=1,
            le=MAX_COUNT)
    bounded(v.add_argument("--train-seed", type=int, default=0, help="the fine-tune's seed: LoRA init and row order"
                           " (default 0)"), ge=0, le=MAX_SEED)
    bounded(v.add_argument("--lora-r", type=int, default=None, help="LoRA rank (default: the adapter's"
                           " adapter_config.json)"), ge=1, le=MAX_LORA_RANK)
    bounded(v.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default:"
                           " adapter_config.json)"), gt=0, le=1e6)
    v.add_argument("--target-modules", default=None, metavar="M1,M2",
                   help="LoRA target modules, comma-separated (default: adapter_config.json)")
    v.add_argument("--verify-dir", default=None, metavar="DIR",
                   help="keep the two retrained models here (default: a temporary directory, removed)")


def _regression_table(result) -> Table:
    r = result.regression
    pct = f"{100 * r['confidence']:g} % CI"
    table = Table(title=_t(f"the regression on {result.eval_dataset} ({r['n_items']} items)"), show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row(_t("accuracy (greedy reproduces the answer)"),
                  _t(f"base {r['base_accuracy']:.3f} -> tuned {r['tuned_accuracy']:.3f}"))
    table.add_row(_t("accuracy drop"), _t(f"{r['accuracy_drop']:+.3f} ({pct} [{r['accuracy_ci'][0]:+.3f},"
                                           f" {r['accuracy_ci'][1]:+.3f}])"))
    table.add_row(_t("answer log-prob drop (nats)"), _t(f"{r['logprob_drop']:+.3f} ({pct} [{r['logprob_ci'][0]:+.3f},"
                                                         f" {r['logprob_ci'][1]:+.3f}])"))
    table.add_row(_t("first-token accuracy"), _t(f"base {r['base_first_token_accuracy']:.3f} -> tuned"
                                                  f" {r['tuned_first_token_accuracy']:.3f}"))
    table.add_row(_t("flipped right -> wrong"), _t(f"{len(r['flipped'])} (wrong -> right: {len(r['fixed'])})"))
    table.add_row(_t("bootstrap"), _t(f"{r['resamples']} paired resamples, seed {r['seed']}"))
    prec = result.precision
    if prec is not None:
        table.add_row(_t("precision"), _t(f"evaluated in {prec['used']} ({prec['note']}); query gradients in"
                                          f" {prec['queries']}"))
        tie = prec["near_tie"]
        if tie is not None:
            table.add_row(_t("near-ties"), _t(f"{len(tie['items'])} of {tie['checked']} flipped items flip on a margin"
                                              f" within {tie['eps']:g} nats of 0 in {tie['precision']}"))
    return table


def _flipped_table(result) -> Table:
    flipped = [it for it in result.items if it["flipped"]]
    table = Table(title=_t(f"flipped items (first {min(SHOWN_ITEMS, len(flipped))} of {len(flipped)})"))
    for column in ("line", "prompt", "answer", "tuned says", "base margin", "precision"):
        table.add_column(column, overflow="fold")
    for it in flipped[:SHOWN_ITEMS]:
        tie = {True: "near-tie", False: "holds"}.get(it.get("near_tie"), "-")
        table.add_row(_t(it["line"]), _t(it["prompt"]), _t(repr(it["answer"])), _t(repr(it["tuned_says"])),
                      _t(f"{it['base']['margin']:.2f}"), _t(tie))
    return table


def _accused_table(result) -> Table:
    shown = result.accused[:SHOWN_ROWS]
    table = Table(title=_t(f"accused training rows ({result.engines[0]}, {result.query['query_loss']} queries; first"
                           f" {len(shown)} of {len(result.accused)}; score < 0: training on the row pushed the"
                           " model off the answers)"))
    for column, justify in (("rank", "right"), ("row", "right"), ("line", "right"), ("score", "right"),
                            ("cluster", "right"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for a in shown:
        table.add_row(_t(a["rank"]), _t(a["row_id"]), _t("-" if a["line"] is None else a["line"]),
                      _t(f"{a['score']:.4g}"), _t("-" if a["cluster"] is None else a["cluster"]),
                      _t(a["text_preview"] if a["text_preview"] is not None else "(training data not available)"))
    return table


def clusters_method_label(method: str | None) -> str:
    """How the clusters were made, in words: "TF-IDF" or "sentence embeddings (MODEL), HDBSCAN"."""
    if method and method.startswith("embeddings:"):
        return f"sentence embeddings ({method.split(':', 1)[1].removesuffix('+hdbscan')}), HDBSCAN"
    return "TF-IDF"


def _clusters_table(clusters: list[dict[str, Any]], method: str | None = None) -> Table:
    table = Table(title=_t(f"clusters of the accused rows (by {clusters_method_label(method)})"), show_lines=True)
    for column in ("cluster", "share", "rows", "top terms", "lines", "lesson", "diagnose findings"):
        table.add_column(column, overflow="fold")
    for c in clusters:
        lines = ", ".join(map(str, c["lines"][:SHOWN_LINES])) + (" …" if len(c["lines"]) > SHOWN_LINES else "")
        found = "\n".join(f["text"] for f in c["findings"]) or "-"
        lesson = c.get("lesson")
        table.add_row(_t(c["cluster"]), _t(f"{100 * c['share']:.1f} %"), _t(c["n_rows"]), _t(", ".join(c["top_terms"])),
                      _t(lines), _t("-" if lesson is None else lesson), _t(found))
    return table


def _lessons_table(lessons: list[dict[str, Any]]) -> Table:
    table = Table(title=_t("lessons: the accused rows grouped by the answer template they teach (entities masked)"))
    for column, justify in (("lesson", "right"), ("share", "right"), ("rows", "right"), ("clusters", "left"),
                            ("template", "left"), ("in words", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for d in lessons:
        table.add_row(_t(d["lesson"]), _t(f"{100 * d['share']:.1f} %"), _t(d["n_rows"]),
                      _t(", ".join(map(str, d["clusters"])) or "-"), _t(repr(d["template"])), _t(d["said"]))
    return table


def _same_lesson_table(lesson: dict[str, Any]) -> Table:
    same = lesson["same_lesson"]
    shown = same["rows"][:SHOWN_ROWS]
    table = Table(title=_t(f"rows teaching the same lesson, not accused (lesson {lesson['lesson']}: {same['said']};"
                           f" first {len(shown)}, most negative score first)"))
    for column, justify in (("row", "right"), ("line", "right"), ("score", "right"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for r in shown:
        table.add_row(_t(r["row_id"]), _t(r["line"]), _t(f"{r['score']:.4g}"), _t(r["text_preview"]))
    return table


def _spans_table(spans: dict[str, Any]) -> Table:
    table = Table(title=_t(f"where the blame sits in the long accused rows (>= {spans['min_tokens']} supervised"
                           f" tokens; the sentence of most negative {spans['engine']} score)"))
    for column, justify in (("row", "right"), ("line", "right"), ("sentences", "right"), ("share", "right"),
                            ("tokens", "right"), ("sentence", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for r in spans["rows"]:
        top = r["sentences"][r["top"]]
        share = "-" if top["share"] is None else f"{100 * top['share']:.0f} %"
        table.add_row(_t(r["row_id"]), _t("-" if r["line"] is None else r["line"]), _t(len(r["sentences"])),
                      _t(share), _t(f"{top['token_span'][0]}-{top['token_span'][1]}"), _t(top["text"]))
    return table


def _checkpoints_table(traced: dict[str, Any]) -> Table:
    table = Table(title=_t(f"{traced['engine']} across the checkpoints (learning rates: {traced['lr_source']}); share:"
                           " of the accused rows' summed score"))
    for column in ("checkpoint", "step", "eta", "product", "index", "accused score", "share"):
        table.add_column(column, justify="left" if column in ("checkpoint", "index") else "right")
    for c in traced["checkpoints"]:
        share = "-" if c["accused_share"] is None else f"{100 * c['accused_share']:.0f} %"
        table.add_row(_t(c["name"]), _t("-" if c["step"] is None else c["step"]), _t(f"{c['weight']:.3g}"),
                      _t(c["inner"][traced["engine"]]), _t(c["index"]), _t(f"{c['accused_score']:.4g}"), _t(share))
    return table


def _verify_table(verify: dict[str, Any]) -> Table:
    s = verify["settings"]
    length = f"{s['steps']} steps" if s["steps"] is not None else f"{s['epochs']} epochs"
    how = f"{s['kind']}, lr {s['lr']:g}, {length}, batch {s['batch_size']}, seed {s['seed']}"
    table = Table(title=_t(f"--verify: the fine-tune redone ({how}) on {verify['rows']} rows"))
    for column in ("model", "rows", "accuracy", "answer log-prob", "recovered (accuracy)", "recovered (log-prob)",
                   "flipped items right again", "same mistake as tuned"):
        table.add_column(column, justify="left" if column == "model" else "right")

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"
    for name in ("base", "tuned"):
        ref = verify["reference"][name]
        table.add_row(_t(name), _t("-"), _t(f"{ref['accuracy']:.3f}"), _t(f"{ref['logprob_mean']:.2f}"),
                      _t("100 %" if name == "base" else "0 %"), _t("100 %" if name == "base" else "0 %"), _t("-"), _t("-"))
    for r in verify["runs"]:
        table.add_row(_t(r["label"]), _t(r["rows_trained"]), _t(f"{r['accuracy']:.3f}"), _t(f"{r['logprob_mean']:.2f}"),
                      _t(pct(r["recovered_accuracy"])), _t(pct(r["recovered_logprob"])),
                      _t(f"{r['flipped_right_again']} of {r['flipped']}"),
                      _t(f"{r['flipped_same_mistake']} of {r['flipped']}"))
    return table


def print_result(result, console: Console | None = None) -> None:
    """The result on the terminal: the regression, and when attributed the flipped items, the
    accused rows, the engines' agreement, the sentences of long accused rows, the clusters, the
    base-model blame and --verify's retrains."""
    out, err = console or Console(), error_console()
    out.print(_regression_table(result))
    if not result.attributed:
        err.print(Text(f"nothing to attribute: {result.reason}"))
        return
    out.print(_flipped_table(result))
    out.print(_accused_table(result))
    for a in result.agreement:
        rho = "n/a" if a["spearman"] is None else f"{a['spearman']:.3f}"
        flag = ": LOW CONFIDENCE, the engines disagree on the accused rows" if a["low_confidence"] else ""
        out.print(Text(f"agreement {a['against']} vs {a['engine']}: top-{a['k']} overlap {a['top_k_overlap']:.2f},"
                       f" Spearman {rho}{flag}"))
    for name, note in (result.engine_notes or {}).items():
        out.print(Text(f"{name}: {note}"))
    if result.checkpoints:
        out.print(_checkpoints_table(result.checkpoints))
    if result.spans and result.spans["rows"]:
        out.print(_spans_table(result.spans))
    if result.spans and result.spans["note"]:
        err.print(Text(f"note: {result.spans['note']}"))
    if result.clusters:
        out.print(_clusters_table(result.clusters, result.clusters_method))
    if result.lessons:
        out.print(_lessons_table(result.lessons))
        for lesson in result.lessons:
            if lesson["same_lesson"] is not None and lesson["same_lesson"]["n_rows"]:
                out.print(_same_lesson_table(lesson))
            elif lesson["same_lesson"] is not None:
                out.print(Text(f"lesson {lesson['lesson']}: no other training row teaches its template."))
    if result.lesson_accused and any(r["by"] == "lesson" for r in result.lesson_accused):
        brought = [r for r in result.lesson_accused if r["by"] == "lesson"]
        out.print(Text(f"following the lesson, the top {len(result.lesson_accused)}: the accused rows that teach"
                       f" it, then {len(brought)} row(s) teaching it that the engine ranked lower (lines"
                       f" {', '.join(str(r['line']) for r in brought[:SHOWN_ROWS])}), then the other accused rows"
                       " (result key lesson_accused)"))
    if result.clusters_note:
        err.print(Text(f"note: {result.clusters_note}"))
    out.print(Text(result.base_blame["summary"]))
    if result.verify is not None:
        if result.verify["runs"]:
            out.print(_verify_table(result.verify))
        out.print(Text(f"--verify: {result.verify['summary']}"))


def run(args: argparse.Namespace) -> int:
    """`gradian attribute`: 0 whether or not there was something to attribute; UserError otherwise."""
    from gradian.attribute.run import attribute
    from gradian.attribute.verify import VerifyOptions
    from gradian.index.manifest import IndexMismatchError

    if args.adapter is not None and args.adapter.lower() == "none":
        args.adapter = None
    if args.engines is None:
        args.engines = "tracin,auto" if args.checkpoints is not None else "auto"
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    lrs = None
    if args.checkpoint_lrs is not None:
        try:
            lrs = [float(x) for x in args.checkpoint_lrs.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--checkpoint-lrs {args.checkpoint_lrs!r}: give numbers, comma-separated (one learning"
                            " rate per checkpoint).", exit_code=2) from None
    training = {k: getattr(args, k) for k in ("train_data", "lr", "epochs", "steps", "batch_size", "lora_r",
                                              "lora_alpha", "target_modules", "verify_dir")}
    if args.train_seed != 0:
        training["train_seed"] = args.train_seed
    given = [f"--{k.replace('_', '-')}" for k, v in training.items() if v is not None]
    if given and not args.verify:
        raise UserError(f"{', '.join(given)} set how --verify retrains; add --verify, or leave them out (without"
                        " --verify nothing is retrained).", exit_code=2)
    retrain = None
    if args.verify:
        targets = None if args.target_modules is None else [m.strip() for m in args.target_modules.split(",")
                                                              if m.strip()]
        retrain = VerifyOptions(lr=args.lr, epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
                                train_seed=args.train_seed, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                                target_modules=targets, train_data=args.train_data, keep_dir=args.verify_dir)
    try:
        result = attribute(args.index, args.eval_dataset, base_model=args.base_model, adapter=args.adapter,
                           top_k=args.top_k, query_loss=args.query_loss, engines=engines, out_path=args.out,
                           seed=args.seed, resamples=args.bootstrap, verify=not skip_checksums(args),
                           span_min_tokens=args.span_min_tokens, retrain=retrain, console=error_console(),
                           checkpoints=args.checkpoints, checkpoint_lrs=lrs, precision=args.precision)
    except IndexMismatchError as mismatch:  # another model, adapter or projection than the index's
        raise UserError(str(mismatch), exit_code=2) from mismatch
    print_result(result)
    if args.out:
        error_console().print(Text(f"wrote the result ({len(result.accused)} accused rows) to {args.out}"))
    return 0
