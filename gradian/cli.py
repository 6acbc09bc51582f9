"""`gradian` command line: index, rank, inspect, doctor.

Commands that do not exist in this version say so and exit non-zero.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

_console = Console(stderr=True)
PLANNED = {
    "index": "gradient indexing (issue #6)",
    "inspect": "index inspection (issue #6)",
    "rank": "ranking training rows against queries (issue #7)",
    "doctor": "environment report (issue #7)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gradian", description="Gradient indexing of training data.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in PLANNED.items():
        sub.add_parser(name, help=f"{what}: not in this version yet", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, _rest = parser.parse_known_args(argv[:1])
    _console.print(f"[bold red]error:[/bold red] `gradian {args.command}` ({PLANNED[args.command]}) is not"
                   " available in this version of Gradian.")
    return 2


if __name__ == "__main__":
    sys.exit(main())
