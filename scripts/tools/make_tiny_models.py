"""Build the local fixture models (tiny random models of every family + the trained induction
model) and print what was built.

    python scripts/tools/make_tiny_models.py                    # all, into the cache
    python scripts/tools/make_tiny_models.py --only induction --force
    python scripts/tools/make_tiny_models.py --out /tmp/fixtures --only tiny-llama tiny-gemma3

Nothing is downloaded: every model and the tokenizer are built from code in
`circuitkit.fixtures` (`models`, `induction`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from circuitkit.fixtures.cache import fixtures_dir
from circuitkit.fixtures.models import FIXTURE_NAMES, ensure_fixture


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for the fixtures (default: the cache, {fixtures_dir()})")
    parser.add_argument("--only", nargs="+", choices=FIXTURE_NAMES, metavar="NAME",
                        help=f"build only these (choices: {', '.join(FIXTURE_NAMES)})")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    return parser.parse_args(argv)


def _fmt_head(info: dict, key: str) -> str:
    head, score = info.get(f"{key}_head"), info.get(f"{key}_score")
    return "" if head is None else f"L{head[0]}H{head[1]} ({score:.3f})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A pipe/CI log has no width; do not squeeze the table into 80 columns there.
    console = Console(width=None if sys.stdout.isatty() else 200)
    names = args.only or list(FIXTURE_NAMES)
    table = Table(title="CircuitKit fixture models")
    for col in ("name", "family", "params", "path", "built in", "accuracy", "prev-token head",
                "induction head", "train s"):
        table.add_column(col, overflow="fold", no_wrap=col != "path")
    total = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        with console.status(f"building {name} ..."):
            path = ensure_fixture(name, out_dir=args.out, force=args.force)
        took = time.perf_counter() - start
        info = json.loads((path / "fixture_info.json").read_text())
        train = info.get("train", {})
        table.add_row(
            name,
            info.get("family", ""),
            f"{info.get('n_params', 0):,}",
            str(path),
            f"{took:.1f}s",
            f"{info['accuracy']:.3f}" if "accuracy" in info else "",
            _fmt_head(info, "prev_token"),
            _fmt_head(info, "induction"),
            f"{train['wall_seconds']:.1f}" if "wall_seconds" in train else "",
        )
    console.print(table)
    console.print(f"total {time.perf_counter() - total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
