"""The trainer's log: read, then checked for overfitting, non-finite values, loss spikes and
exploding gradient norms.

Formats read (anything else is refused in one line, exit 2):

* Hugging Face Trainer's ``trainer_state.json``: an object whose ``log_history`` is a list of
  ``{step, loss | eval_loss, learning_rate, grad_norm, epoch}`` objects;
* a JSON list of such objects, or a JSONL file with one per line (each with ``step``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from circuitkit.core.errors import UserError
from gradian.diagnose.finding import Finding

KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm")
WINDOW, MIN_HISTORY = 10, 5  # a spike is judged against the median of the previous points
SPIKE_RATIO, SPIKE_ABS = 2.0, 0.25  # loss > 2 x median and at least 0.25 above it
GRAD_RATIO = 10.0  # grad_norm > 10 x median
OVERFIT_RISE = 1.05  # last eval_loss >= 1.05 x the lowest, with two evals after the lowest
EXPECTED = ("HF Trainer's trainer_state.json (an object with log_history), or a JSON list / JSONL of {step, loss,"
            " eval_loss, learning_rate, grad_norm} objects")


@dataclass
class LogPoint:
    step: int
    values: dict[str, float]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)  # "nan" / "inf" strings too
    except (TypeError, ValueError):
        return None


def _unknown(path: str, seen: str) -> UserError:
    return UserError(f"--trainer-log {path}: unknown trainer log format ({seen}); expected {EXPECTED}.", exit_code=2)


def points_of(entries: Any, path: str) -> list[LogPoint]:
    """Log points (sorted by step) of a list of log objects; refuses anything else (exit 2)."""
    if not isinstance(entries, list) or not entries:
        raise _unknown(path, "no list of log entries" if not isinstance(entries, list) else "an empty log")
    points = []
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict) or _number(entry.get("step")) is None:
            raise _unknown(path, f"entry {n + 1} is {json.dumps(entry)[:60]}, with no step")
        values = {k: v for k in KEYS if (v := _number(entry.get(k))) is not None}
        if values:
            points.append(LogPoint(int(_number(entry["step"])), values))
    if not points:
        raise _unknown(path, f"no entry has any of {', '.join(KEYS)}")
    return sorted(points, key=lambda p: p.step)


def read_log(path: str | Path) -> list[LogPoint]:
    """The log points of a trainer_state.json, a JSON list or a JSONL file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--trainer-log {path}: no such file.", exit_code=2)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise _unknown(str(path), f"not UTF-8 text: {type(err).__name__}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    obj.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise _unknown(str(path), f"line {n} is not JSON: {err.msg}") from None
    if isinstance(obj, dict):
        if "log_history" not in obj:
            raise _unknown(str(path), f"an object with keys {', '.join(sorted(obj)[:6]) or 'none'}, no log_history")
        obj = obj["log_history"]
    return points_of(obj, str(path))


def _log(id: str, severity: str, path: str, steps: list[int], message: str, evidence: str, fix: str) -> Finding:
    return Finding(id=id, severity=severity, source="log", file=path, message=message, count=len(steps),
                   steps=steps, evidence=evidence, fix=fix)


def _series(points: list[LogPoint], key: str) -> list[tuple[int, float]]:
    return [(p.step, p.values[key]) for p in points if key in p.values]


def not_finite(points: list[LogPoint], path: str) -> list[Finding]:
    """NaN or infinite loss, eval loss or gradient norm."""
    bad = [(p.step, k, v) for p in points for k, v in p.values.items() if k != "learning_rate" and not math.isfinite(v)]
    if not bad:
        return []
    steps = sorted({s for s, _, _ in bad})
    step, key, value = bad[0]
    return [_log("loss_not_finite", "error", path, steps, f"{key} is {value} from step {step} on ({len(steps)} logged"
                 " step(s)): training diverged", f"step {step}: {key}={value}",
                 "lower the learning rate, add warmup and gradient clipping (max_grad_norm=1.0), train in bfloat16"
                 " rather than float16, and check the rows of the first bad batch")]


def _jumps(series: list[tuple[int, float]], ratio: float, floor: float) -> list[tuple[int, float, float]]:
    """(step, value, median of the previous WINDOW finite values) where value jumps past them."""
    out, history = [], []
    for step, value in series:
        if not math.isfinite(value):
            continue
        if len(history) >= MIN_HISTORY:
            ref = median(history[-WINDOW:])
            if value > ratio * ref and value - ref >= floor:
                out.append((step, value, ref))
        history.append(value)
    return out


def spikes(points: list[LogPoint], path: str) -> list[Finding]:
    """Train loss spikes and gradient norm explosions."""
    out = []
    loss = _jumps(_series(points, "loss"), SPIKE_RATIO, SPIKE_ABS)
    if loss:
        step, value, ref = loss[0]
        out.append(_log("loss_spike", "warning", path, [s for s, _, _ in loss], f"the train loss spikes at"
                        f" {len(loss)} logged step(s)", f"step {step}: loss {value:.4g} against a median of {ref:.4g}"
                        f" over the previous {WINDOW} logs", "look at the rows of that step's batch (a broken or"
                        " very long row), lower the learning rate or lengthen warmup, clip gradients"))
    grad = _jumps(_series(points, "grad_norm"), GRAD_RATIO, 0.0)
    if grad:
        step, value, ref = grad[0]
        out.append(_log("grad_norm_explosion", "warning", path, [s for s, _, _ in grad], f"the gradient norm explodes"
                        f" at {len(grad)} logged step(s)", f"step {step}: grad_norm {value:.4g} against a median of"
                        f" {ref:.4g}", "clip gradients (max_grad_norm=1.0), lower the learning rate, check that batch's"
                        " rows"))
    return out


def _mean_loss(train: list[tuple[int, float]], lo: int, hi: int) -> float | None:
    values = [v for s, v in train if lo <= s <= hi and math.isfinite(v)][-MIN_HISTORY:]
    return sum(values) / len(values) if values else None


def overfitting(points: list[LogPoint], path: str) -> list[Finding]:
    """Eval loss rising after its lowest point while the train loss still falls."""
    evals = [(s, v) for s, v in _series(points, "eval_loss") if math.isfinite(v)]
    if len(evals) < 3:
        return []
    best = min(range(len(evals)), key=lambda i: evals[i][1])
    (best_step, best_loss), (last_step, last_loss) = evals[best], evals[-1]
    if len(evals) - 1 - best < 2 or last_loss < OVERFIT_RISE * best_loss:
        return []
    train = _series(points, "loss")
    before, after = _mean_loss(train, -1, best_step), _mean_loss(train, best_step + 1, last_step)
    if before is None or after is None or after >= before:
        return []
    return [_log("overfitting", "warning", path, [best_step], f"the eval loss rises after step {best_step} while the"
                 " train loss still falls: the model memorises the training rows",
                 f"eval_loss {best_loss:.4g} at step {best_step} -> {last_loss:.4g} at step {last_step}; train loss"
                 f" {before:.4g} -> {after:.4g}", f"keep the checkpoint of step {best_step} (load_best_model_at_end=true,"
                 " metric_for_best_model=eval_loss), or train fewer epochs / at a lower learning rate")]


def peak_learning_rate(points: list[LogPoint]) -> float | None:
    """The largest learning rate logged (the schedule's peak), or None."""
    rates = [v for _, v in _series(points, "learning_rate") if math.isfinite(v)]
    return max(rates) if rates else None
