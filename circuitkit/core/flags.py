"""Numeric command-line options: each declares its allowed range where it is added, and one check
after parsing refuses NaN, infinity and a value out of range in one line naming the flag (exit 2).

    bounded(parser.add_argument("--top-k", type=int, default=10), ge=1, le=MAX_COUNT)
    ...
    args = parser.parse_args(argv)
    check_numeric_flags(parser, args)     # UserError: "--top-k 0: it must be an integer from 1 to 1000000."

argparse itself refuses text that is not a number (`--top-k abc`); NaN, ``inf``, ``1e400`` and a
400-digit integer parse, so they are refused here. A numeric option added without `bounded` is a
bug the test sweep finds (`numeric_actions` lists every one of a parser, its subparsers included).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from circuitkit.core.errors import EXIT_USAGE, UserError

MAX_COUNT = 1_000_000  # counts a person types (rows, items, resamples): far above any real use
MAX_SEED = 2**32 - 1  # what every seeded generator here accepts (NumPy's limit)


@dataclass(frozen=True)
class Bounds:
    """The allowed range of one numeric option (None: no bound on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    why: str = ""  # what the option is, for the message

    def allows(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def text(self, integer: bool) -> str:
        low = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}" if self.gt is not None else ""
        high = f"<= {_num(self.le)}" if self.le is not None else ""
        where = " and ".join(t for t in (low, high) if t)
        return where if integer else f"a finite number {where}".rstrip()


def _num(bound: float) -> str:
    """A bound as a person writes it: 1000000, 0.5, 1e+12."""
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e15 else f"{bound:g}"


def bounded(action: argparse.Action, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            why: str = "") -> argparse.Action:
    """Declare `action`'s (an int or float option's) allowed range; returns it."""
    action.bounds = Bounds(ge, gt, le, why)  # type: ignore[attr-defined]
    return action


def numeric_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every int or float option of `parser` and of its subparsers."""
    out = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list of its actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in dict.fromkeys(action.choices.values()):
                out.extend(numeric_actions(sub))
        elif action.type in (int, float):
            out.append(action)
    return out


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of `command` in `parser` (KeyError if it has none)."""
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:  # noqa: SLF001
            return action.choices[command]
    raise KeyError(command)


def flag_name(action: argparse.Action) -> str:
    """The option as a user types it: its longest spelling (`--top-k`)."""
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def _shown(value: float) -> str:
    text = repr(value) if isinstance(value, float) else str(value)
    return text if len(text) <= 24 else f"{text[:12]}…({len(text)} digits)"


def check_numeric_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """UserError (exit 2) naming the first numeric option of `parser` whose value in `args` is NaN,
    infinite or out of its declared range; options left at None are not checked."""
    for action in numeric_actions(parser):
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        bounds: Bounds | None = getattr(action, "bounds", None)
        if bounds is None:
            raise RuntimeError(f"{flag_name(action)} declares no range (circuitkit.core.flags.bounded).")
        integer = action.type is int
        finite = integer or math.isfinite(value)
        if not finite or not bounds.allows(value):
            why = f" ({bounds.why})" if bounds.why else ""
            raise UserError(f"{flag_name(action)} {_shown(value)}: it must be {bounds.text(integer)}{why}.",
                            exit_code=EXIT_USAGE)
