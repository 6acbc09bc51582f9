"""`gradian` command line: index, rank, inspect, doctor.

    gradian index [overrides]  build a gradient index with the pipeline's config keys, e.g.
                               gradian index model=gpt2 grads.data_path=train.jsonl grads.index_dir=idx
    gradian inspect INDEX      manifest summary and sizes of a gradient index
    gradian rank --index DIR --queries FILE [--top-k K] [--score cosine|dot] [--aggregate mean|max] [--out FILE]
                               training rows most similar (by gradient) to each query row and overall
    gradian doctor [--json]    versions, devices, determinism, backends and self-tests (Markdown)
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

_console = Console(stderr=True)


def inspect_index(index_dir: str) -> int:
    """Print how an index was made, its shards and its size on disk."""
    from gradian.index import IndexReader

    try:
        summary = IndexReader(index_dir).summary()
    except FileNotFoundError as err:
        _console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    table = Table(title=f"gradient index {index_dir}", show_header=False)
    table.add_column("key")
    table.add_column("value")
    proj, report = summary.get("projection", {}), summary.get("data_report") or {}
    if not isinstance(proj, dict):  # a bare kind, as in hand-made headers
        proj = {"kind": proj, "projection_dim": summary.get("projection_dim"), "seed": summary.get("projection_seed")}
    modules = list(proj.get("modules", {}))
    rows = [
        ("model", f"{summary.get('model')} ({summary.get('precision')}), weights sha256 "
                  f"{str(summary.get('weights_sha256'))[:12]}…"),
        ("projection", f"{proj.get('kind')}, dim {proj.get('projection_dim')} per module, seed {proj.get('seed')}"),
        ("modules", f"{len(modules)}: {', '.join(modules[:4])}{' …' if len(modules) > 4 else ''}"),
        ("row width", f"{summary.get('row_width')} ({summary.get('storage_dtype')})"),
        ("circuit", "none (unrestricted)" if not summary.get("circuit") else
         f"sha256 {summary['circuit']['sha256'][:12]}…: heads {summary['circuit']['heads']},"
         f" MLPs {summary['circuit']['mlps']}"),
        ("loss", f"{summary.get('loss_reduction')} over supervised tokens"),
        ("data", f"{summary.get('data_file')} (sha256 {str(summary.get('data_sha256'))[:12]}…)"),
        ("rows", f"{report.get('rows_read')} read, {report.get('kept')} kept, {report.get('truncated')} truncated,"
                 f" {report.get('dropped_truncated', 0) + report.get('dropped_unsupervised', 0)} dropped"),
        ("stored", f"{summary['rows_stored']} of {summary.get('n_rows')} rows in {summary['n_shard_files']} shards"
                   f" ({'complete' if summary.get('complete') else 'incomplete: resume with the same command'})"),
        ("size on disk", f"{summary['bytes'] / 2**20:.2f} MiB ({summary['bytes']} bytes)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    return 0


def index_command(overrides: list[str]) -> int:
    """`gradian index [overrides]`: the grads stage on its own (index_dir default ./index)."""
    from circuitkit.config import ConfigError, compose
    from gradian.indexer import build_index

    try:
        _, cfg = compose(overrides)
    except ConfigError as err:
        _console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    index_dir = cfg.grads.index_dir or "index"
    try:
        build_index(cfg.model, cfg.grads, index_dir, _console)
    except (ValueError, FileNotFoundError, OverflowError) as err:
        _console.print(f"[bold red]error:[/bold red] {err}")
        return 1
    return inspect_index(index_dir)


def rank_command(args: argparse.Namespace) -> int:
    """`gradian rank`: print the top rows per query and for the aggregate; exit 2 on bad input."""
    from gradian.data import DataError
    from gradian.rank import rank

    try:
        results = rank(args.index, args.queries, top_k=args.top_k, score=args.score, aggregate=args.aggregate,
                       out_path=args.out, circuit=args.circuit)
    except (ValueError, FileNotFoundError, DataError) as err:  # IndexMismatchError is a ValueError
        _console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    table = Table(title=f"{args.score} ranking of {args.index} against {args.queries}")
    for column, justify in (("query", "left"), ("rank", "right"), ("row", "right"), ("score", "right"),
                            ("line", "right"), ("preview", "left")):
        table.add_column(column, justify=justify)
    for r in results:
        table.add_row(str(r["query"]), str(r["rank"]), str(r["row_id"]), f"{r['score']:.4f}",
                      "-" if r["source_line"] is None else str(r["source_line"]),
                      r["text_preview"] if r["text_preview"] is not None else "(data file not available)")
    Console().print(table)
    if args.out:
        _console.print(f"wrote {len(results)} rows to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gradian", description="Gradient indexing of training data.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("index", help="build a gradient index (config overrides follow)", add_help=False)
    inspect = sub.add_parser("inspect", help="summary and sizes of a gradient index")
    inspect.add_argument("index", help="index directory (holds manifest.json)")
    rank = sub.add_parser("rank", help="rank training rows of an index against query rows")
    rank.add_argument("--index", required=True, help="index directory (holds manifest.json)")
    rank.add_argument("--queries", required=True, help="JSONL of query rows (same format as training rows)")
    rank.add_argument("--top-k", type=int, default=10, help="rows kept per query and for the aggregate")
    rank.add_argument("--score", choices=("cosine", "dot"), default="cosine")
    rank.add_argument("--aggregate", choices=("mean", "max"), default="mean",
                      help="how the per-query scores of a row combine into one ranking")
    rank.add_argument("--out", default=None, help="also write the results as JSONL here")
    rank.add_argument("--circuit", default=None,
                      help="circuit.pt the queries are for; refused unless the index was built with it")
    sub.add_parser("doctor", help="versions, devices, backends and self-tests as Markdown ([--json])",
                   add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "index":
        return index_command(argv[1:])
    if argv[0] == "inspect":
        return inspect_index(parser.parse_args(argv).index)
    if argv[0] == "rank":
        return rank_command(parser.parse_args(argv))
    if argv[0] == "doctor":
        from gradian.doctor import main as doctor_main

        return doctor_main(argv[1:])
    parser.parse_args(argv)  # unknown command: argparse prints the usage and exits 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
