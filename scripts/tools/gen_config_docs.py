"""Regenerate the key tables of docs/configuration.md from the schema (AppConfig, circuitkit_app/config.py).

The tables sit between `<!-- keys:GROUP -->` and `<!-- /keys:GROUP -->` markers; the prose
around them is written by hand. `--check` exits 1 when the file is out of date (used by tests).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from circuitkit.core.config import _describe_allowed, _unwrap_optional, iter_keys
from circuitkit_app.config import AppConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _default(path: str):
    node = AppConfig()
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _fmt(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[" + ", ".join(map(str, value)) + "]`"
    return f"`{value}`"


def table(group: str) -> str:
    rows = ["| key | default | allowed | effect |", "|---|---|---|---|"]
    for path, tp, meta in iter_keys(AppConfig):
        top = path.split(".")[0]
        in_group = top == group if group != "top" else "." not in path
        if not in_group:
            continue
        base, optional = _unwrap_optional(tp)
        allowed = _describe_allowed(base, optional, meta)
        rows.append(f"| `{path}` | {_fmt(_default(path))} | {allowed} | {meta['doc']} |")
    return "\n".join(rows)


def render(text: str) -> str:
    def sub(m: re.Match) -> str:
        return f"<!-- keys:{m.group(1)} -->\n{table(m.group(1))}\n<!-- /keys:{m.group(1)} -->"
    return re.sub(r"<!-- keys:(\w+) -->.*?<!-- /keys:\1 -->", sub, text, flags=re.S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/tools/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
