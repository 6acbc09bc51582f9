"""Long work talks in logs: a plain progress line every few seconds when the console is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from circuitkit.core.progress import Progress


def test_a_log_gets_plain_lines_with_counts_rates_and_time_left() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with Progress(console, "indexing", 400, "rows", every_s=0.0) as bar:
        bar.advance(100, rates="12.5 rows/s")
        bar.advance(300, rates="13.0 rows/s")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("indexing: 100 of 400 rows (25%), 12.5 rows/s, ETA ")
    assert lines[1] == "indexing: 400 of 400 rows (100%), 13.0 rows/s"
    assert "\x1b" not in out.getvalue()  # no terminal control codes in a log


def test_a_log_is_not_flooded() -> None:
    out = io.StringIO()
    with Progress(Console(file=out, force_terminal=False), "indexing", 10_000, "rows", every_s=3600) as bar:
        for _ in range(10_000):
            bar.advance(1)
    assert out.getvalue() == ""  # nothing within the first interval, nor a final line for short work


def test_a_terminal_gets_the_bar_not_lines() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with Progress(console, "indexing", 10, "rows", every_s=0.0) as bar:
        bar.advance(10)
    assert "indexing: 10 of 10" not in out.getvalue()
