"""The report's HTML building blocks: escaped text and tables (`page.py` and the sections use them).

Every value goes through `esc` (or is a `Raw` string a section escaped itself): text from a run,
a model or a data row never becomes markup.
"""

from __future__ import annotations

import html
from typing import Any


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


class Raw(str):
    """HTML that `table` inserts as it is (already escaped)."""


def table(header: list[str], rows: list[list[Any]], numeric: set[int] = frozenset(),
          row_class: list[str] | None = None) -> str:
    """An HTML table; cells are escaped unless given as `Raw`."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = "".join(f'<td{" class=num" if j in numeric else ""}>{c if isinstance(c, Raw) else esc(c)}</td>'
                        for j, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
