"""Progress of long work: a rich bar on a terminal, a plain line every few seconds in a log.

A bar redraws itself in place, which a log file or a CI console cannot show: there rich's
transient bar prints nothing, and minutes of work pass in silence. `Progress` draws the bar when
the console is a terminal and otherwise writes one plain line every `LOG_EVERY_S` seconds (and
one at the end):

    indexing: 1,200 of 5,000 rows (24%), 15.2 rows/s, 3,120 tok/s, padding 2.1%, ETA 4m10s
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

LOG_EVERY_S = 10.0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """`with Progress(console, "indexing", total, "rows") as bar: bar.advance(n, rates="...")`."""

    def __init__(self, console: Console, what: str, total: int, unit: str, every_s: float = LOG_EVERY_S) -> None:
        self.console, self.what, self.total, self.unit, self.every_s = console, what, total, unit, every_s
        self.done = 0
        self.rates = ""
        self.terminal = console.is_terminal
        self._bar: RichProgress | None = None
        self._t0 = self._last = time.perf_counter()

    def __enter__(self) -> Progress:
        if self.terminal:
            self._bar = RichProgress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TextColumn(self.unit),
                                     TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.unit, total=self.total, rates="")
        return self

    def advance(self, n: int, rates: str = "") -> None:
        self.done += n
        self.rates = rates
        if self._bar is not None:
            self._bar.update(self._task, advance=n, rates=rates)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self.console.print(self.line(now - self._t0), highlight=False, soft_wrap=True)

    def line(self, elapsed_s: float) -> str:
        """The plain line: done of total, the rates, and the time left at the pace so far."""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = (self.total - self.done) * elapsed_s / self.done if self.done else None
        eta = "" if left is None or self.done >= self.total else f", ETA {_duration(left)}"
        rates = f", {self.rates}" if self.rates else ""
        return f"{self.what}: {self.done:,} of {self.total:,} {self.unit}{share}{rates}{eta}"

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif exc[0] is None and self.done and time.perf_counter() - self._t0 >= self.every_s:
            self.console.print(self.line(time.perf_counter() - self._t0), highlight=False, soft_wrap=True)
