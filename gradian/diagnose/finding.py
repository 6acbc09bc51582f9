"""One diagnose finding: what was found, where (rows or steps), one piece of evidence, the fix.

Every finding has the same keys in the same order (`Finding.as_dict`), so `--json` output and
the report read one shape:

    id        the check's stable name (`truncated_completion`, `eval_contamination`, ...)
    severity  error | warning | info; any error makes `gradian diagnose` exit 1
    source    train | eval | config | log: what `rows` / `steps` point into
    file      the file the rows or steps were read from ("" when the finding is about settings)
    message   what is wrong, in one line
    count     how many rows (or log steps) show it, exactly
    rows      the first `SHOWN` positions (1-based JSONL line numbers; 0-based row indices for a table)
    all_rows  every position behind `count` (what `--json` readers act on; `rows` is for reading)
    steps     the first `SHOWN` trainer steps (log findings)
    evidence  one concrete instance (a row's tail, a setting and its value, a log point)
    fix       what to change
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("error", "warning", "info")
SOURCES = ("train", "eval", "config", "log")
SHOWN = 10  # positions listed per finding; `count` is exact
EVIDENCE_CHARS = 160


@dataclass
class Finding:
    """One check's result (see the module docstring for the fields)."""

    id: str
    severity: str
    source: str
    message: str
    fix: str
    evidence: str = ""
    file: str = ""
    count: int = 0
    rows: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # Every position behind `count` (`rows` keeps the first SHOWN): what joins findings to other
    # row sets (`gradian attribute`'s clusters), and the whole list in `as_dict`.
    all_rows: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES or self.source not in SOURCES:
            raise ValueError(f"finding {self.id}: severity {self.severity!r} / source {self.source!r}")
        self.all_rows = list(self.all_rows or self.rows)
        self.rows = list(self.rows[:SHOWN])
        self.steps = list(self.steps[:SHOWN])
        self.evidence = clip(self.evidence, EVIDENCE_CHARS)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, keys in a fixed order."""
        d = asdict(self)
        return {k: d[k] for k in ("id", "severity", "source", "file", "message", "count", "rows", "all_rows",
                                  "steps", "evidence", "fix")}


def clip(text: str, limit: int) -> str:
    """`text` on one line, at most `limit` characters (an ellipsis marks the cut)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def tail(text: str, chars: int = 50) -> str:
    """The last `chars` characters of `text`, shown as a Python repr (whitespace visible)."""
    return repr(text[-chars:] if len(text) <= chars else "…" + text[-chars:])


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; the checks' own order within a severity."""
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def exit_status(findings: list[Finding] | list[dict[str, Any]]) -> int:
    """1 when any finding is an error, else 0."""
    sev = [f["severity"] if isinstance(f, dict) else f.severity for f in findings]
    return 1 if "error" in sev else 0
