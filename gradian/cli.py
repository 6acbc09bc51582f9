"""`gradian` command line: index, rank, inspect, report, doctor, diagnose, attribute.

    gradian index [overrides]  build a gradient index with the pipeline's config keys, e.g.
                               gradian index model=gpt2 grads.data_path=train.jsonl grads.index_dir=idx
    gradian inspect INDEX [--verify] [--row N]
                               manifest summary and sizes of a gradient index; --verify checks
                               every shard and lists what is wrong (exit 1 if anything is);
                               --row N shows training row N's tokens and which are supervised
    gradian rank --index DIR --queries FILE [--top-k K] [--score auto|cosine|dot|influence|whitened|kfac|ekfac]
                 [--damping D] [--aggregate mean|max] [--out FILE] [--skip-checksums] [--append-eos true|false]
                 [--adapter DIR|none]
                               training rows most similar (by gradient) to each query row and overall
                 [--report [FILE]]   also the ranked rows as a page (needs --out; default FILE: OUT.html)
    gradian report RANK.jsonl --index DIR [--queries FILE] [--out FILE]
                               ranked rows as one self-contained page: per query its top rows, supervised
                               tokens marked (circuitkit_app.report, which the installed command reaches)
    gradian doctor [--json]    versions, devices, determinism, backends and self-tests (Markdown)
    gradian diagnose --dataset TRAIN.jsonl [--eval-dataset EVAL.jsonl] [--run DIR | --trainer-args ARGS.json]
                 [--trainer-log LOG.json|.jsonl] [--model M] [--max-seq-length N] [--json]
                               checks of a fine-tuning set, its trainer settings and logs (gradian.diagnose;
                               tokenizer only, no GPU): each finding's rows, evidence and fix; exit 1 on errors
    gradian attribute --index DIR --eval-dataset EVAL.jsonl [--base-model M] [--adapter DIR] [--top-k K]
                 [--query-loss contrastive|ce|margin] [--engines auto,dot] [--out OUT.json] [--span-min-tokens N]
                 [--verify --lr LR --epochs E|--steps S [--batch-size B] [--train-seed S] [--train-data FILE]]
                               which training rows broke a behaviour the base model had (gradian.attribute):
                               the regression with a bootstrap CI, accused rows, the sentences of long ones,
                               their clusters; --verify retrains without them and against a random control

Every command ends through `circuitkit.core.errors.run_entry`: an error prints one line naming the
problem and the fix (CIRCUITKIT_DEBUG=1 shows the traceback), Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from circuitkit.core.errors import UserError, error_console, print_error, run_entry
from circuitkit.core.flags import MAX_COUNT, bounded, check_numeric_flags, subparser
from gradian.rank.checksum_flag import add_skip_checksums, skip_checksums

# Each subcommand imports its module when it runs: `gradian --help` loads no torch (fast).
# With --out, the terminal shows this much of the ranking; the file gets all of it. Rendering
# thousands of table rows takes minutes (600 ranks x 10 queries: ~3 min on 2 cores).
SUMMARY_QUERIES = 3
SUMMARY_RANKS = 5


def _t(value: object) -> Text:
    """A table cell shown as written: `[INST]` in a preview or a path is text, not rich markup."""
    return Text(str(value))


def inspect_index(index_dir: str, verify: bool = False, row: int | None = None) -> int:
    """Print how an index was made, its shards and its size on disk; with `verify`, check it all;
    with `row`, that training row's tokens and supervised mask as indexed.

    Returns 0, or 1 when `verify` finds a problem (each printed on its own line).
    """
    from gradian.curvature.factors import has_kfac
    from gradian.index.header import describe_index
    from gradian.index.reader import IndexReader

    reader = IndexReader(index_dir)
    summary = reader.summary()
    table = Table(title=_t(f"gradient index {index_dir}"), show_header=False)
    table.add_column("key")
    table.add_column("value")
    rows = describe_index(summary)
    for key, value in rows:
        table.add_row(_t(key), _t(value))
    Console().print(table)
    if row is not None:
        from gradian.rank.tokens import indexed_row, load_index_tokenizer, row_table

        tokenizer = load_index_tokenizer(reader.manifest)
        indexed = indexed_row(index_dir, row, tokenizer)
        Console().print(row_table(indexed, tokenizer, f"row {row} (source position {indexed.line}):"
                                  f" {sum(indexed.supervised)} of {len(indexed.input_ids)} tokens supervised"))
    if not verify:
        return 0
    problems = reader.verify()
    console = error_console()
    if not problems:
        from gradian.curvature.factors import has_module

        checked = ["sha256", "row ranges", "shapes", "dtypes", "norms of the stored rows", "projection fingerprint"]
        precond = summary.get("preconditioner", "none")
        if has_module(precond):
            checked.append("second moments (recomputed from the stored rows)")
        if has_kfac(precond):
            checked.append("K-FAC factors (symmetric, finite)")
            if summary.get("curvature"):
                rows_of = ("the sampled-label rows" if summary.get("fisher") == "sampled" else "the stored rows")
                checked.append("curvature.safetensors (eigenbases of the summed factors; EK-FAC eigenvalues"
                               f" recomputed from {rows_of})")
        console.print(Text(f"verified {index_dir}: {summary['n_shard_files']} shards; {', '.join(checked)} all"
                           " match the manifest"))
        return 0
    for problem in problems:
        print_error(problem, console, label="problem")
    from gradian.curvature.allocation import ALLOCATION_FILE
    from gradian.curvature.factors import CURVATURE_FILE
    from gradian.projection.projector import WHITENING_FILE

    # The index's files the problems name, so the last line says where they are.
    named = [n for n in (*sorted(reader.manifest["shards"]), WHITENING_FILE, ALLOCATION_FILE, CURVATURE_FILE)
             if any(n in p for p in problems)]
    where = f" (in {', '.join(named[:5])}{' …' if len(named) > 5 else ''})" if named else ""
    print_error(f"{index_dir}: {len(problems)} problem(s){where}; rebuild the index into an empty grads.index_dir"
                " (or resume it with the same command if only shards are missing).", console)
    return 1


def index_help() -> str:
    """`gradian index --help`: the command, then every grads key with its doc and default."""
    from gradian.settings.grads import GradsConfig

    lines = ["usage: gradian index [KEY=VALUE ...]", "",
             "Build a gradient index of grads.data_path into grads.index_dir (default ./index) with the",
             "pipeline's config keys (Hydra overrides, as for `python -m circuitkit.run`). A killed run",
             "resumes with the same command. Model keys: model=NAME (a conf/model/ file) or",
             "model.name=HUB_NAME|LOCAL_DIR|builtin:tiny-gpt2, model.precision=auto|bfloat16|float32.", "",
             "grads keys (docs/configuration.md has them all):"]
    for f in dataclasses.fields(GradsConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  grads.{f.name:<16} {f.metadata.get('doc', '')} (default {default})")
    return "\n".join(lines)


def bad_override(overrides: list[str]) -> str | None:
    """A message naming the first override Hydra cannot parse, or None if each parses alone."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as err:
            reason = " ".join(str(err).split("See https")[0].split())
            return (f"cannot parse the override {override!r} ({reason}); write KEY=VALUE, quote values with"
                    f" brackets or spaces (KEY='a[1] b'), lists as KEY=[a,b].")
    return None


def index_command(cfg: Any) -> int:
    """`gradian index [overrides]`: the grads stage on its own, on the composed config (the app's
    AppConfig; index_dir default ./index). The installed `gradian` composes it
    (circuitkit_app.gradian_cli): the config's root knows both domains, which this module may not."""
    from gradian.build.indexer import build_index

    index_dir = cfg.grads.index_dir or "index"
    from circuitkit.models.loading import check_model
    from gradian.build.memory import GRADS_MEMORY

    check_model(cfg.model)  # the model reference and its adapter, before anything runs (the stage's check)

    if line := GRADS_MEMORY.note(cfg):  # what the width costs on disk, and what it measured (the preflight's line)
        error_console().print(line, markup=False, highlight=False)
    build_index(cfg.model, cfg.grads, index_dir, error_console())
    return inspect_index(index_dir)


def _results_table(title: str, results: list[dict]) -> Table:
    table = Table(title=_t(title))
    for column, justify in (("query", "left"), ("rank", "right"), ("row", "right"), ("score", "right"),
                            ("line", "right"), ("preview", "left")):
        table.add_column(column, justify=justify)
    for r in results:
        table.add_row(_t(r["query"]), _t(r["rank"]), _t(r["row_id"]), _t(f"{r['score']:.4f}"),
                      _t("-" if r["source_line"] is None else r["source_line"]),
                      _t(r["text_preview"] if r["text_preview"] is not None else "(data file not available)"))
    return table


def rank_inputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """What `gradian rank` reads (the queries, the index and its training data, the circuit): no file
    it writes (--out, --report) may be one of them (`circuitkit.core.io.check_not_an_input`)."""
    import json

    inputs = [("--queries", Path(args.queries)), ("the index", Path(args.index))]
    if args.circuit:
        inputs.append(("--circuit", Path(args.circuit)))
    try:
        data = json.loads((Path(args.index) / "manifest.json").read_text()).get("data_file")
    except (OSError, ValueError, AttributeError):
        data = None  # the index's reader names what is wrong with it
    if isinstance(data, str) and data:
        inputs.append(("the index's training data", Path(data)))
    return inputs


def rank_command(args: argparse.Namespace) -> int:
    """`gradian rank`: print the top rows per query and for the aggregate; exit 2 on bad input.

    With --out every row goes to the file and the terminal gets a short summary (the first
    queries' first ranks and the aggregate's).
    """
    from circuitkit.core.io import check_not_an_input
    from gradian.rank.ranking import rank

    if args.out:
        check_not_an_input(Path(args.out), "--out", rank_inputs(args))
    try:
        results = rank(args.index, args.queries, top_k=args.top_k, score=args.score, aggregate=args.aggregate,
                       out_path=args.out, verify=not skip_checksums(args), circuit=args.circuit,
                       append_eos=args.append_eos, damping=args.damping, adapter=args.adapter)
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as err:  # IndexMismatchError, DataError: the input is wrong
        raise UserError(str(err), exit_code=2) from err
    score = args.score
    if score == "auto":
        from gradian.index.reader import IndexReader
        from gradian.rank.ranking import default_score

        score = default_score(IndexReader(args.index).manifest)
    title = f"{score} ranking of {args.index} against {args.queries}"
    if not args.out:
        Console().print(_results_table(title, results))
        return 0
    queries = list(dict.fromkeys(r["query"] for r in results if r["query"] != "aggregate"))
    shown_queries = set(queries[:SUMMARY_QUERIES]) | {"aggregate"}
    ranks = min(SUMMARY_RANKS, args.top_k)
    shown = [r for r in results if r["query"] in shown_queries and r["rank"] <= ranks]
    Console().print(_results_table(f"{title} (first {ranks} ranks of {min(len(queries), SUMMARY_QUERIES)}"
                                   f" of {len(queries)} queries and the aggregate; all in {args.out})", shown))
    error_console().print(Text(f"wrote {len(results)} rows ({len(queries)} queries and the aggregate, top"
                               f" {args.top_k} each) to {args.out}"))
    return 0


def diagnose_command(args: argparse.Namespace) -> int:
    """`gradian diagnose`: the findings as a table (or `--json`); 1 when any is an error, else 0."""
    import json

    from gradian.diagnose import diagnose, exit_status

    if args.run and args.trainer_args:
        raise UserError("give --run DIR or --trainer-args ARGS.json, not both.", exit_code=2)
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise UserError(f"--max-seq-length {args.max_seq_length}: must be >= 2 tokens.", exit_code=2)
    result = diagnose(args.dataset, args.eval_dataset, args.run, args.trainer_args, args.trainer_log, args.model,
                      args.max_seq_length, check_eos=args.check_eos)
    if args.json:
        print(json.dumps(result.as_dicts(), indent=2, ensure_ascii=False))
        return exit_status(result.findings)
    table = Table(title=_t(f"gradian diagnose {args.dataset}"), show_lines=True)
    for column in ("severity", "check", "rows", "evidence", "fix"):
        table.add_column(column, overflow="fold")
    styles = {"error": "bold red", "warning": "yellow", "info": "dim"}
    for f in result.findings:
        where = f.rows or f.steps
        shown = ", ".join(map(str, where)) + (" …" if f.count > len(where) and where else "")
        label = "steps" if f.steps else f"{f.source} lines" if f.rows else f.source
        table.add_row(Text(f.severity, style=styles[f.severity]), Text(f"{f.id}\n{f.message}"),
                      _t(f"{f.count} {label}: {shown}" if where else (f"{f.count} rows" if f.count else "-")),
                      _t(f.evidence or "-"), _t(f.fix))
    if result.findings:
        Console().print(table)
    counts = {s: sum(f.severity == s for f in result.findings) for s in ("error", "warning", "info")}
    error_console().print(Text(f"{result.rows} training rows{f', {result.eval_rows} eval rows' if args.eval_dataset else ''}"
                               f" checked in {result.wall_s:.1f} s: {counts['error']} error(s), {counts['warning']}"
                               f" warning(s), {counts['info']} note(s)"))
    return exit_status(result.findings)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradian", description="Gradient indexing of training data.",
                                     epilog="Set CIRCUITKIT_DEBUG=1 to see the Python traceback of an error.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("index", help="build a gradient index (config overrides follow; `gradian index --help`)",
                   add_help=False)
    inspect = sub.add_parser("inspect", help="summary and sizes of a gradient index")
    inspect.add_argument("index", help="index directory (holds manifest.json)")
    inspect.add_argument("--verify", action="store_true",
                         help="check every shard (presence, size, sha256, tensors, row ranges), unlisted files,"
                              " the complete flag and the projection fingerprint; exit 1 on any problem")
    bounded(inspect.add_argument("--row", type=int, default=None,
                                 help="show this training row's tokens (re-read from the indexed data) and which of"
                                      " them the loss supervised"), ge=0)
    rank = sub.add_parser("rank", help="rank training rows of an index against query rows")
    rank.add_argument("--index", required=True, help="index directory (holds manifest.json)")
    rank.add_argument("--queries", required=True, help="JSONL of query rows (same format as training rows)")
    bounded(rank.add_argument("--top-k", type=int, default=10, help="rows kept per query and for the aggregate"),
            ge=1, le=MAX_COUNT)
    rank.add_argument("--score", choices=("auto", "cosine", "dot", "influence", "whitened", "kfac", "ekfac"),
                      default="auto",
                      help="auto (default): ekfac if the index holds K-FAC factors (grads.preconditioner=kfac, the"
                           " default), else cosine. influence / whitened need an index built with grads.preconditioner=module: qᵀAg and"
                           " the cosine after whitening with each module's damped second moment A; kfac / ekfac"
                           " need grads.preconditioner=kfac: qᵀ(F + λI)⁻¹g with K-FAC's or EK-FAC's F")
    bounded(rank.add_argument("--damping", type=float, default=None,
                              help="for influence / whitened / kfac / ekfac: λ as a share of each module's mean"
                                   " eigenvalue (default 0.01 for kfac / ekfac, 0.1 for influence / whitened); refused"
                                   " with cosine and dot"),
            gt=0, le=1e6, why="a share of each module's mean eigenvalue")
    rank.add_argument("--aggregate", choices=("mean", "max"), default="mean",
                      help="how the per-query scores of a row combine into one ranking")
    rank.add_argument("--out", default=None,
                      help="write all results as JSONL here (checked before any work); the terminal then shows"
                           " a summary")
    add_skip_checksums(rank, "skip checking each shard's sha256 against the manifest while streaming (faster on"
                             " a slow disk; see docs/benchmarks.md for the cost)")
    rank.add_argument("--append-eos", choices=("true", "false"), default=None,
                      help="the token policy the queries are meant for; refused unless it is the index's"
                           " (grads.append_eos); by default queries follow the index")
    rank.add_argument("--adapter", default="index", metavar="DIR|none",
                      help="the LoRA adapter of the queries' model: by default the one the index was built with"
                           " (model.adapter, its recorded directory); another directory or none is refused unless it"
                           " is the index's (same weights sha256, r, alpha, targets)")
    rank.add_argument("--circuit", default=None,
                      help="circuit.pt the queries are for; refused unless the index was built with it")
    rank.add_argument("--report", nargs="?", const="", default=None, metavar="FILE",
                      help="also write the ranked rows as one self-contained page (needs --out; default FILE:"
                           " the --out path with .html)")
    report = sub.add_parser("report", help="ranked rows (gradian rank --out) as one self-contained page")
    report.add_argument("rank", help="the JSONL that `gradian rank --out` wrote")
    report.add_argument("--index", required=True, help="the index the ranking was made with")
    report.add_argument("--queries", default=None, help="the queries JSONL (to show each query's tokens)")
    report.add_argument("--out", default=None, help="where the page goes (default: RANK with .html)")
    diagnose = sub.add_parser("diagnose", help="checks of a fine-tuning set, its trainer settings and logs")
    diagnose.add_argument("--dataset", required=True, help="training rows (JSONL, Parquet, Arrow): prompt/completion"
                          " or messages")
    diagnose.add_argument("--eval-dataset", default=None, help="eval rows: checked for contamination and answer leakage")
    diagnose.add_argument("--run", default=None, help="the trainer's output_dir (adapter_config.json, *args*.json,"
                          " trainer_state.json)")
    diagnose.add_argument("--trainer-args", default=None, help="JSON of the trainer's arguments"
                          " (TrainingArguments.to_json_string(), TRL SFTConfig, ...)")
    diagnose.add_argument("--trainer-log", default=None, help="trainer_state.json, or JSONL of {step, loss, eval_loss,"
                          " learning_rate, grad_norm}")
    diagnose.add_argument("--model", default=None, help="model whose tokenizer measures the rows (no weights are"
                          " loaded): a local directory, builtin:NAME, or a cached hub name")
    bounded(diagnose.add_argument("--max-seq-length", type=int, default=None, help="the trainer's length limit in"
                                  " tokens (default: max_seq_length / max_length of the trainer args)"),
            ge=2, le=MAX_COUNT, why="tokens")
    diagnose.add_argument("--check-eos", action="store_true", help="look for completions without EOS even when the"
                          " trainer args say the trainer appends it (TRL's SFTConfig; otherwise the check is reported"
                          " as skipped)")
    diagnose.add_argument("--json", action="store_true", help="print the findings as a JSON list instead of a table"
                          " (each with every row it concerns in all_rows)")
    from gradian.attribute.command import add_parser as add_attribute

    add_attribute(sub)
    sub.add_parser("doctor", help="versions, devices, backends and self-tests as Markdown ([--json])",
                   add_help=False)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments of a `gradian` command (argparse errors exit 2), every numeric option checked
    against its range (`circuitkit.core.flags`); rank's --append-eos as a bool."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_numeric_flags(subparser(parser, args.command), args)
    if args.command == "rank":
        args.append_eos = None if args.append_eos is None else args.append_eos == "true"
        args.adapter = None if args.adapter.lower() == "none" else args.adapter
    return args


def _main(argv: list[str]) -> int:
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "index":  # composing the pipeline's config is the entry layer's: circuitkit_app.gradian_cli
        if any(arg in ("-h", "--help") for arg in argv[1:]):
            print(index_help())
            return 0
        raise UserError("`gradian index` composes the pipeline's config (conf/), which the installed `gradian`"
                        " command does (circuitkit_app.gradian_cli); run it as `gradian index ...`.", exit_code=2)
    if argv[0] == "inspect":
        args = parse(argv)
        return inspect_index(args.index, verify=args.verify, row=args.row)
    if argv[0] in ("rank", "report"):
        args = parse(argv)
        if args.command == "report" or args.report is not None:  # a page: the entry layer draws it
            raise UserError(f"`gradian {argv[0]}{' --report' if argv[0] == 'rank' else ''}` writes a page, which the"
                            " installed `gradian` command does (circuitkit_app.gradian_cli); run it as `gradian ...`.",
                            exit_code=2)
        return rank_command(args)
    if argv[0] == "diagnose":
        return diagnose_command(parse(argv))
    if argv[0] == "attribute":
        from gradian.attribute.command import run as attribute_command

        return attribute_command(parse(argv))
    if argv[0] == "doctor":
        from gradian.doctor import main as doctor_main

        return doctor_main(argv[1:])
    parser.parse_args(argv)  # unknown command: argparse prints the usage and exits 2
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the exit code (0 ok, 1 failed, 2 bad command or input, 130 Ctrl-C)."""
    return run_entry(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
