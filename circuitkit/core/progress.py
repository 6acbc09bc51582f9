"""Progress of long work: a rich bar on a terminal, a plain line every few seconds in a log.

A bar redraws itself in place, which a log file or a CI console cannot show: there rich's
transient bar prints nothing, and minutes of work pass in silence. `Progress` draws the bar when
the console is a terminal and otherwise writes one plain line every `LOG_EVERY_S` seconds
($CIRCUITKIT_PROGRESS_EVERY_S when set), and one at the end:

    indexing: 1,200 of 5,000 rows (24%), 15.2 rows/s, 3,120 tok/s, padding 2.1%, ETA 4m10s

With `announce`, a log also gets a first line saying what is being done before any of it is
("scoring the eval set on the tuned model: 24 items to go"), so a step that ends within the
interval is not silent either. The counts are the caller's host-side numbers (batches, rows, items
from collate-time sizes): advancing a bar never reads a device tensor.

`Tasks` speaks rich's `Progress` API (`add_task`, `advance(task, n)`) for loops written against
it, with the same two faces.
"""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

LOG_EVERY_S = 10.0
EVERY_ENV = "CIRCUITKIT_PROGRESS_EVERY_S"  # seconds between a log's plain lines (tests set it small)


def log_every_s() -> float:
    """Seconds between a log's plain lines: $CIRCUITKIT_PROGRESS_EVERY_S when it is a number >= 0,
    else `LOG_EVERY_S`."""
    try:
        value = float(os.environ.get(EVERY_ENV, ""))
    except ValueError:
        return LOG_EVERY_S
    return value if value >= 0 else LOG_EVERY_S


def duration(seconds: float) -> str:
    """`seconds` as people read them: 42s, 4m10s, 2h05m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


_duration = duration


class Progress:
    """`with Progress(console, "indexing", total, "rows") as bar: bar.advance(n, rates="...")`.

    `every_s`: seconds between a log's lines (None: `log_every_s()`); `announce`: a log's first line
    says what is being done; `enabled` False: nothing is drawn or printed. Without `rates` a line
    shows the pace so far in `unit`/s."""

    def __init__(self, console: Console, what: str, total: int, unit: str, every_s: float | None = None,
                 announce: bool = False, enabled: bool = True) -> None:
        self.console, self.what, self.total, self.unit = console, what, total, unit
        self.every_s = log_every_s() if every_s is None else every_s
        self.announce, self.enabled = announce, enabled
        self.done = 0
        self.rates = ""
        self.terminal = console.is_terminal
        self._bar: RichProgress | None = None
        self._shown = 0  # the count in the last plain line printed
        self._t0 = self._last = time.perf_counter()

    def __enter__(self) -> Progress:
        self._t0 = self._last = time.perf_counter()
        if not self.enabled:
            return self
        if self.terminal:
            self._bar = RichProgress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TextColumn(self.unit),
                                     TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.unit, total=self.total, rates="")
        elif self.announce:
            self.console.print(f"{self.what}: {self.total:,} {self.unit} to go", markup=False, highlight=False,
                               soft_wrap=True)
        return self

    def advance(self, n: int = 1, rates: str = "") -> None:
        self.done += n
        self.rates = rates
        if self._bar is not None:
            self._bar.update(self._task, advance=n, rates=rates)
            return
        if not self.enabled or self.terminal:
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last, self._shown = now, self.done
            self.console.print(self.line(now - self._t0), markup=False, highlight=False, soft_wrap=True)

    def line(self, elapsed_s: float) -> str:
        """The plain line: done of total, the rates (or the pace so far), and the time left at that pace."""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = (self.total - self.done) * elapsed_s / self.done if self.done else None
        eta = "" if left is None or self.done >= self.total else f", ETA {duration(left)}"
        rates = self.rates or (f"{self.done / elapsed_s:.3g} {self.unit}/s" if elapsed_s > 0 and self.done else "")
        rates = f", {rates}" if rates else ""
        return f"{self.what}: {self.done:,} of {self.total:,} {self.unit}{share}{rates}{eta}"

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif (self.enabled and not self.terminal and exc[0] is None and self.done and self.done != self._shown
              and time.perf_counter() - self._t0 >= self.every_s):  # the last count, unless just printed
            self.console.print(self.line(time.perf_counter() - self._t0), markup=False, highlight=False,
                               soft_wrap=True)


class Tasks:
    """rich's `Progress(disable=..., transient=True)` for loops written against it: `add_task(what,
    total=N)` gives a task, `advance(task, n)` moves it; each task is a `Progress` (bar on a
    terminal, plain lines with done/total, pace and ETA in a log, announced). Columns passed
    positionally are ignored."""

    def __init__(self, *columns, disable: bool = False, transient: bool = True, console: Console | None = None,
                 unit: str = "batches", every_s: float | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled, self.unit, self.every_s = not disable, unit, every_s
        self._tasks: list[Progress] = []

    def __enter__(self) -> Tasks:
        return self

    def add_task(self, description: str, total: int | float | None = None, **_fields) -> int:
        """A new task of `total` steps (its first line in a log says `description`); returns its id."""
        if self._tasks:  # one bar at a time: the task before is finished when the next starts
            self._tasks[-1].__exit__(None, None, None)
        bar = Progress(self.console, description, int(total or 0), self.unit, self.every_s, announce=True,
                       enabled=self.enabled)
        self._tasks.append(bar.__enter__())
        return len(self._tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self._tasks[task].advance(int(advance))

    def update(self, task: int, advance: float = 0, **_fields) -> None:
        if advance:
            self.advance(task, advance)

    def __exit__(self, *exc) -> None:
        if self._tasks:
            self._tasks[-1].__exit__(*exc)
