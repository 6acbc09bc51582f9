"""The verdict of a circuit the pruning stage found: the pillars of `pillars.py`, measured.

`circuit_verdict` measures every pillar that applies with the pruning stage's own evaluator: the
held-out pairs, metric and ablation of its faithfulness. At head scope that is the very
`Evaluator` that `prune` built (`PrunedCircuit.evaluator`). The pillars are head-level, so an
edge circuit is judged by its head set (the heads with a kept outgoing edge, every MLP live),
through a head evaluator on the same pairs with the same ablation; the verdict says so in its
`scope` and in its faithfulness row, which then holds the head set's figure beside the edge
circuit's own.

A pillar that does not apply has no figure, and its row says why (a task with one corruption
has no robustness, a task without held-out templates no generalization, ...):

    {"scope": "heads" | "head set of an edge circuit", "n_heads": k, "seed": s,
     "figures": {pillar: figure}, "notes": {pillar: text}, "rows": [{pillar, value, detail, definition}]}

and beside it the seconds it took ({"random": ..., "total": ...}), for the manifest (circuit.pt
stays a function of its inputs).

What it costs: one pass over the held-out pairs per random circuit (`pruning.random_baselines`,
0 = no baselines), three more for magnitude, Wanda and necessity, one pass over the attribution
pairs for Wanda's input norms, and per other corruption the pairs regenerated, recorded once and
run twice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from circuitkit.core.config import choices
from circuitkit.discovery.config import DataParams, PruningConfig
from circuitkit.discovery.pruning.heads import Evaluator, PrunedCircuit, faithfulness, mean_z
from circuitkit.discovery.pruning.pillars import (
    magnitude_scores,
    random_baseline,
    top_heads_like,
    verdict_rows,
    wanda_scores,
)
from circuitkit.discovery.tasks import HELDOUT_TEMPLATE_TASKS, TaskData, TaskError, build_task
from circuitkit.models.adapters import ModelAdapter

EDGE_SCOPE = "head set of an edge circuit"


def other_corruptions(task: str, dp: DataParams) -> tuple[tuple[str, ...], str]:
    """The corruptions `task` offers besides the configured one, and why there are none when empty
    (ioi: s2 / abc, `ioi_corruption`; induction, repeat format: swap / fresh, `induction_corruption`)."""
    if task == "ioi":
        return tuple(c for c in choices(DataParams, "ioi_corruption") if c != dp.ioi_corruption), ""
    if task == "induction":
        if dp.induction_format != "repeat":
            return (), ("the induction task's single format has one corruption (key); the repeat format has two"
                        " (discovery.data_params.induction_format=repeat)")
        return tuple(c for c in choices(DataParams, "induction_corruption") if c != dp.induction_corruption), ""
    if task == "jsonl":
        return (), "the jsonl task's corrupted prompts come from its file (or one generated corruption); none other"
    return (), f"the {task} task has one corruption"


def robustness_pairs(task: str, dp: DataParams, tokenizer, model_dir: str | None, n_attr: int, n_total: int,
                     seed: int, max_tokens: int | None = None, skip: tuple[str, ...] = ()
                     ) -> tuple[dict[str, TaskData], dict[str, str]]:
    """The held-out pairs regenerated under each other corruption: ({corruption: pairs}, {corruption or
    "robustness": why not}). The task is built again with the data stage's seed and size, so the
    clean prompts are the held-out ones (ioi and induction draw them independently of the corruption).
    `skip`: corruptions discovery already measured (several corruptions in one discovery)."""
    others, why = other_corruptions(task, dp)
    others = tuple(c for c in others if c not in skip)
    if not others and skip:
        return {}, {}
    if not others:
        return {}, {"robustness": why}
    key = "ioi_corruption" if task == "ioi" else "induction_corruption"
    pairs, failed = {}, {}
    for corruption in others:
        try:
            data = build_task(task, tokenizer, model_dir, dataclasses.replace(dp, **{key: corruption}), n_total, seed,
                              max_tokens=max_tokens)
        except TaskError as err:
            failed[corruption] = f"{corruption} not measured: {err}"
            continue
        pairs[corruption] = data[n_attr:]
    return pairs, failed


def _heads(mask: torch.Tensor) -> str:
    return ", ".join(f"L{layer}H{head}" for layer, head in mask.nonzero().tolist()) or "none"


def circuit_verdict(adapter: ModelAdapter, found: PrunedCircuit, p: PruningConfig, metric: str, task: str,
                    held_out: TaskData, attr_data: TaskData, batch_size: int, seed: int,
                    robustness: tuple[dict[str, TaskData], dict[str, str]] = ({}, {}),
                    heldout: TaskData | None = None) -> tuple[dict, dict[str, float]]:
    """(verdict, wall_s): every applicable pillar of the circuit `found` (see the module docstring),
    plain types only, and the seconds the random circuits and the whole verdict took.

    `robustness`: `robustness_pairs`' answer. `heldout`: the held-out templates' pairs, or None
    (then generalization says why); at head scope their figure is the one `prune` measured.
    Memory: `found.evaluator` (its recorded runs) is released once the pillars on the held-out
    pairs are measured, so each later evaluator records its pairs where that one's were, and the
    Wanda pass keeps nothing of its runs: the verdict stays within the pruning stage's estimate.
    """
    start = time.perf_counter()
    kept = found.head_mask.bool()  # (L, H)
    means = found.ablation_values.get("mean_z")  # head scope: the stage's; edge scope: head means made here
    if p.scope != "heads" and p.ablation == "mean":
        means = mean_z(adapter, attr_data, batch_size)
    figures, notes, wall = _on_held_out_pairs(adapter, found, p, metric, held_out, attr_data, batch_size, seed,
                                              means)
    found.evaluator = None

    def make(pairs: TaskData) -> Evaluator:
        return Evaluator(adapter, pairs, metric, p.ablation, means, batch_size)

    figures["robustness"] = {**_discovery_corruptions(found), **_robustness(make, kept, robustness[0])} or None
    if robustness[1]:  # {"robustness": why none} or {corruption: why not that one}
        notes["robustness"] = "; ".join(robustness[1].values())
    if found.extra.get("corruptions"):
        notes["faithfulness"] = (f"the {found.extra['corruptions']['rule']} over the corruptions discovery used"
                                 f" ({', '.join(found.extra['corruptions']['names'])}; robustness lists each)")
    figures["generalization"], notes["generalization"] = _generalization(found, p, make, kept, task, heldout)
    stable = found.extra.get("stability")
    if stable:
        figures["stability"] = stable["jaccard_mean"]
        notes["stability"] = (f"5th percentile {stable['jaccard_p5']:.3f} over {stable['n_resamples']} resamples"
                              + (" (of the kept edges)" if p.scope == "edges" else ""))
    else:
        notes["stability"] = ("not measured: pruning.bootstrap_resamples=0" if p.bootstrap_resamples == 0 else
                              "not measured: it needs per-example scores (discovery.per_example=true; exact"
                              " patching keeps none)")
    wall["total"] = time.perf_counter() - start
    return {"scope": "heads" if p.scope == "heads" else EDGE_SCOPE, "n_heads": int(kept.sum()), "seed": seed,
            "figures": figures, "notes": notes, "rows": verdict_rows(figures, notes)}, wall


def _on_held_out_pairs(adapter: ModelAdapter, found: PrunedCircuit, p: PruningConfig, metric: str,
                       held_out: TaskData, attr_data: TaskData, batch_size: int, seed: int,
                       means: torch.Tensor | None) -> tuple[dict, dict[str, str], dict[str, float]]:
    """(figures, notes, wall_s) of the pillars measured on the held-out pairs: faithfulness, the
    baselines and necessity, by the pruning stage's evaluator (at edge scope, a head evaluator with
    the stage's ablation on the same pairs)."""
    kept = found.head_mask.bool()
    notes, wall = {}, {}
    if p.scope == "heads" and found.evaluator is not None:
        evaluate = found.evaluator
        m_full, m_empty, ours = found.metrics["full"], found.metrics["empty"], found.metrics["faithfulness"]
    else:
        evaluate = Evaluator(adapter, held_out, metric, p.ablation, means, batch_size)
        m_full, m_empty, m_circuit = _full_empty_circuit(evaluate, kept)
        ours = faithfulness(m_circuit, m_full, m_empty)
        if p.scope != "heads":
            notes["faithfulness"] = (f"of the edge circuit's head set ({int(kept.sum())} heads, every MLP live); the"
                                     f" edge circuit itself: {found.metrics['faithfulness']:.3f}")

    figures: dict = {"faithfulness": ours}
    joint = found.extra.get("corruptions")
    if joint:  # the row shows the folded figure; the baselines compare like with like, on the primary's pairs
        ours = joint["by_corruption"][joint["names"][0]]["faithfulness"]
        notes["baseline_random"] = f"against the circuit's {ours:.3f} under {joint['names'][0]}"
    others: dict[str, torch.Tensor] = {}  # the baselines of weights alone and necessity: one batched evaluation
    if p.random_baselines > 0:
        t = time.perf_counter()
        figures["baseline_random"] = random_baseline(evaluate, kept, ours, m_full, m_empty, p.random_baselines, seed)
        wall["random"] = time.perf_counter() - t
        notes["baseline_random"] = f"seed {seed}" + (f"; {notes['baseline_random']}" if joint else "")
        k = int(kept.sum())
        for name, scores in (("baseline_magnitude", magnitude_scores(adapter)),
                             ("baseline_wanda", wanda_scores(adapter, attr_data, batch_size))):
            others[name] = top_heads_like(scores, k)
            notes[name] = (f"heads {_heads(others[name])} ({int((others[name] & kept).sum())} of {k} shared with"
                           " the circuit)")
    else:
        for name in ("baseline_random", "baseline_magnitude", "baseline_wanda"):
            notes[name] = "not measured: pruning.random_baselines=0"
    others["necessity"] = ~kept
    for name, m in zip(others, evaluate.many(torch.stack(list(others.values()))), strict=True):
        figures[name] = faithfulness(m, m_full, m_empty)
    return figures, notes, wall


def _full_empty_circuit(evaluate: Evaluator, kept: torch.Tensor) -> tuple[float, float, float]:
    """(m(full), m(empty), m(circuit)) in one batched evaluation."""
    full, empty, circuit = evaluate.many(torch.stack([torch.ones_like(kept), torch.zeros_like(kept), kept]))
    return full, empty, circuit


def _discovery_corruptions(found: PrunedCircuit) -> dict[str, float]:
    """{"<corruption> (discovery)": faithfulness} of the corruptions the circuit was selected under."""
    joint = found.extra.get("corruptions") or {}
    return {f"{c} (discovery)": b["faithfulness"] for c, b in joint.get("by_corruption", {}).items()}


def _robustness(make: Callable[[TaskData], Evaluator], kept: torch.Tensor, pairs: dict[str, TaskData]) -> dict:
    out = {}
    for corruption, data in pairs.items():
        full, empty, circuit = _full_empty_circuit(make(data), kept)  # its own full and empty: the corruption moves m(empty)
        out[corruption] = faithfulness(circuit, full, empty)
    return out


def _generalization(found: PrunedCircuit, p: PruningConfig, make: Callable[[TaskData], Evaluator],
                    kept: torch.Tensor, task: str, heldout: TaskData | None) -> tuple[float | None, str]:
    if heldout is None or len(heldout) == 0:
        if task not in HELDOUT_TEMPLATE_TASKS:
            return None, (f"not measured: the {task} task has no held-out templates (tasks with them:"
                          f" {', '.join(HELDOUT_TEMPLATE_TASKS)})")
        return None, "not measured: discovery.data_params.heldout_template_examples=0"
    measured = found.extra.get("heldout_templates")
    if p.scope == "heads" and measured:
        return measured["faithfulness"], f"{measured['n_examples']} pairs"
    full, empty, circuit = _full_empty_circuit(make(heldout), kept)
    return faithfulness(circuit, full, empty), f"{len(heldout)} pairs"
