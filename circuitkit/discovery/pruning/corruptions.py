"""A head circuit's faithfulness under several corruptions, and the one figure pruning judges by.

Each corruption c has its held-out pairs (the same clean prompts), so its own m_c(full) and
m_c(empty) (the corruption moves m(empty) under corrupted ablation), and

    f_c(circuit) = (m_c(circuit) - m_c(empty)) / (m_c(full) - m_c(empty))

`discovery.corruption_faithfulness` folds them: worst = min_c f_c (a circuit holds only where it
holds under every corruption; NaN figures left out), mean = their mean. The curve, CPR/CMD and the
circuit's reported faithfulness are that figure; each corruption's stays beside it. Every
corruption's circuits run in batched forwards (`Evaluator.many`), one corruption's recorded runs
alive at a time.
"""

from __future__ import annotations

import math

import torch

from circuitkit.discovery.pruning.evaluator import Evaluator, curve_areas, faithfulness
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter


def fold(figures: list[float], rule: str) -> float:
    """`rule` (worst, mean) over the finite figures; NaN when none is."""
    finite = [f for f in figures if math.isfinite(f)]
    if not finite:
        return float("nan")
    return min(finite) if rule == "worst" else sum(finite) / len(finite)


def per_corruption_faithfulness(make: callable, pairs: dict[str, TaskData], masks: torch.Tensor
                                ) -> dict[str, dict]:
    """{corruption: {"full", "empty", "metric": [C floats], "faithfulness": [C floats]}} of the
    head masks (C, L, H) on each corruption's held-out `pairs`; `make(pairs)` builds its Evaluator."""
    out = {}
    for name, data in pairs.items():
        evaluate: Evaluator = make(data)
        full, empty, *metrics = evaluate.many(torch.cat([torch.ones_like(masks[:1]), torch.zeros_like(masks[:1]),
                                                         masks]))
        out[name] = {"full": full, "empty": empty, "metric": metrics,
                     "faithfulness": [faithfulness(m, full, empty) for m in metrics]}
        del evaluate  # its recorded runs go before the next corruption's are made
    return out


def joint_selection(adapter: ModelAdapter, primary: tuple[str, dict], others: dict[str, TaskData],
                    kept: torch.Tensor, points: dict[int, torch.Tensor], curve: list[dict], rule: str,
                    metric: str, ablation: str, means: torch.Tensor | None, batch_size: int) -> dict:
    """The circuit `kept` (L, H) and the curve's circuits `points` ({n_kept: mask}) under every corruption.

    primary: (its name, {"full", "empty", "circuit", "curve_metrics": {n_kept: metric}}) as `prune`
    measured it; others: {corruption: held-out pairs}. Returns {"names", "rule", "faithfulness":
    the folded figure, "by_corruption": {c: {full, empty, circuit, faithfulness}}, "curve": the
    curve's rows with the folded faithfulness and one `faithfulness_<c>` column per corruption,
    "cpr", "cmd"}.
    """
    name, mine = primary
    masks = torch.stack([kept, *points.values()])
    measured = per_corruption_faithfulness(
        lambda data: Evaluator(adapter, data, metric, ablation, means, batch_size), others, masks)
    on_primary = [mine["circuit"], *(mine["curve_metrics"][n] for n in points)]
    measured = {name: {"full": mine["full"], "empty": mine["empty"], "metric": on_primary,
                       "faithfulness": [faithfulness(m, mine["full"], mine["empty"]) for m in on_primary]},
                **measured}
    names = list(measured)
    at = {n: i + 1 for i, n in enumerate(points)}  # n_kept -> index in masks
    rows = []
    for row in curve:
        each = {c: measured[c]["faithfulness"][at[row["n_kept"]]] for c in names}
        rows.append({**row, "faithfulness": fold(list(each.values()), rule),
                     **{f"faithfulness_{c}": f for c, f in each.items()}})
    cpr, cmd = curve_areas(rows)
    by = {c: {"full": m["full"], "empty": m["empty"], "circuit": m["metric"][0], "faithfulness": m["faithfulness"][0]}
          for c, m in measured.items()}
    return {"names": names, "rule": rule, "faithfulness": fold([b["faithfulness"] for b in by.values()], rule),
            "by_corruption": by, "curve": rows, "cpr": cpr, "cmd": cmd}
