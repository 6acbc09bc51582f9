"""EAP-IG speed / accuracy advice from the measured table (`ig_tradeoffs.json` next to this file).

The table is written by `scripts/bench/bench_tradeoffs.py --write-data`: for each benchmark model and
quadrature rule, ig_steps -> relative L2 error of the node and edge scores against a 100-point
float32 reference, and the wall seconds of that run. The advice is conservative: a setting's
estimated error is the worst over the measured models, and only measured settings are
suggested. Read by the preflight and by `circuitkit discover-smart`.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from circuitkit.discovery.attribution.quadrature import DEFAULT_IG_STEPS, IG_RULES, resolved_steps

TABLE_PATH = Path(__file__).resolve().parent / "ig_tradeoffs.json"


@dataclass(frozen=True)
class Setting:
    """An (ig_rule, ig_steps) pair with its worst measured error and its time relative to another."""

    rule: str
    steps: int
    error: float  # worst relative L2 error over the measured models (node or edge scores)
    time_ratio: float = 1.0  # wall time / wall time of the setting it is compared with

    def describe(self, level: str = "node") -> str:
        return (f"discovery.ig_rule={self.rule} discovery.ig_steps={self.steps}: est. {level}-score error"
                f" <= {self.error:.1%} at {self.time_ratio:.2g}x the time")


@functools.cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """The measured table ({} when it is missing: then no advice is given)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _key(level: str) -> str:
    return "rel_l2_edge" if level == "edge" else "rel_l2_node"


def worst_error(rule: str, steps: int, level: str = "node", table: dict | None = None) -> float | None:
    """Worst measured error of (rule, steps) over the table's models; None if any model lacks it.

    The benchmark stops a rule's sweep once it has converged (two grid points in a row within the
    30-step right-sum error); beyond its last point that model counts with the last point's error.
    """
    models = (table if table is not None else load_table()).get("models", {})
    errs = []
    for model in models.values():
        mine = sorted((p["steps"], p[_key(level)]) for p in model["points"] if p["rule"] == rule)
        match = [e for m, e in mine if m == steps]
        if not match and mine and steps > mine[-1][0] and len(mine) >= 2:
            match = [mine[-1][1]]
        if not match:
            return None
        errs.append(match[0])
    return max(errs) if errs else None


def time_ratio(steps: int, than_steps: int, table: dict | None = None) -> float:
    """Measured time of `steps` passes over that of `than_steps`: per model a line a + b·m fitted to
    the right-rule runs (every rule costs the same per pass), the median ratio over models."""
    models = (table if table is not None else load_table()).get("models", {})
    ratios = []
    for model in models.values():
        pts = [(p["steps"], p["wall_s"]) for p in model["points"] if p["rule"] == "right"]
        if len(pts) < 2:
            continue
        mean_m = sum(m for m, _ in pts) / len(pts)
        mean_t = sum(t for _, t in pts) / len(pts)
        b = sum((m - mean_m) * (t - mean_t) for m, t in pts) / max(sum((m - mean_m) ** 2 for m, _ in pts), 1e-12)
        a = max(mean_t - b * mean_m, 0.0)
        if b > 0:
            ratios.append((a + b * steps) / (a + b * than_steps))
    # Without measurements: time is one pass per point plus about one pass for the two cached runs.
    return statistics.median(ratios) if ratios else (steps + 1) / (than_steps + 1)


def cheapest_within(budget: float, level: str = "node", than_steps: int = DEFAULT_IG_STEPS,
                    table: dict | None = None) -> Setting | None:
    """The fewest passes whose worst measured error is <= budget (ties: the rule listed first)."""
    table = table if table is not None else load_table()
    candidates = set()
    for model in table.get("models", {}).values():
        candidates.update((p["rule"], p["steps"]) for p in model["points"])
    best = None
    for rule, steps in sorted(candidates, key=lambda rs: (rs[1], IG_RULES.index(rs[0]))):
        err = worst_error(rule, steps, level, table)
        if err is not None and err <= budget:
            best = Setting(rule, steps, err, time_ratio(steps, than_steps, table))
            break
    return best


def advice_line(algorithm: str, level: str, ig_steps: int | None, ig_rule: str, budget: float) -> str | None:
    """One line for the user: the current setting's estimated error and the cheapest setting within
    `budget` (None for algorithms without an integral, or without a measured table)."""
    if algorithm != "eap-ig" or not load_table():
        return None
    steps = resolved_steps(ig_steps)
    current = worst_error(ig_rule, steps, level)
    now = (f"ig_rule={ig_rule} ig_steps={steps}: est. {level}-score error <= {current:.1%}" if current is not None
           else f"ig_rule={ig_rule} ig_steps={steps}: error not measured")
    best = cheapest_within(budget, level, steps)
    if best is None:
        return f"{now}; no measured setting reaches an error budget of {budget:.1%} (docs/memory.md)."
    if (best.rule, best.steps) == (ig_rule, steps):
        return f"{now}: the cheapest measured setting within the {budget:.1%} error budget."
    verb = "cheaper" if best.steps < steps else "needed"
    return (f"{now}; {verb} within a {budget:.1%} error budget: {best.describe(level)}"
            f" (worst of the models measured in docs/memory.md).")
