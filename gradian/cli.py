"""`gradian` command line: index, rank, inspect, doctor.

    gradian index [overrides]  build a gradient index with the pipeline's config keys, e.g.
                               gradian index model=gpt2 grads.data_path=train.jsonl grads.index_dir=idx
    gradian inspect INDEX      manifest summary and sizes of a gradient index

Commands that do not exist in this version say so and exit non-zero.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

_console = Console(stderr=True)
PLANNED = {
    "rank": "ranking training rows against queries (issue #7)",
    "doctor": "environment report (issue #7)",
}


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gradian", description="Gradient indexing of training data.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("index", help="build a gradient index (config overrides follow)", add_help=False)
    inspect = sub.add_parser("inspect", help="summary and sizes of a gradient index")
    inspect.add_argument("index", help="index directory (holds manifest.json)")
    for name, what in PLANNED.items():
        sub.add_parser(name, help=f"{what}: not in this version yet", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "index":
        return index_command(argv[1:])
    if argv[0] == "inspect":
        return inspect_index(parser.parse_args(argv).index)
    args, _rest = parser.parse_known_args(argv[:1])
    _console.print(f"[bold red]error:[/bold red] `gradian {args.command}` ({PLANNED[args.command]}) is not"
                   " available in this version of Gradian.")
    return 2


if __name__ == "__main__":
    sys.exit(main())
