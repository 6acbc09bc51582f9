"""`gradian` command line: index, rank, inspect, doctor.

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
    "index": "gradient indexing (issue #6)",
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
    for key, value in summary.items():
        text = f"{value / 2**20:.2f} MiB ({value} bytes)" if key == "bytes" else str(value)
        table.add_row(key, text)
    Console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gradian", description="Gradient indexing of training data.")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="summary and sizes of a gradient index")
    inspect.add_argument("index", help="index directory (holds manifest.json)")
    for name, what in PLANNED.items():
        sub.add_parser(name, help=f"{what}: not in this version yet", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "inspect":
        return inspect_index(parser.parse_args(argv).index)
    args, _rest = parser.parse_known_args(argv[:1])
    _console.print(f"[bold red]error:[/bold red] `gradian {args.command}` ({PLANNED[args.command]}) is not"
                   " available in this version of Gradian.")
    return 2


if __name__ == "__main__":
    sys.exit(main())
