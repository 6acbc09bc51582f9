"""The circuit's verdict, pillar by pillar: how it compares with circuits chosen without the task's
attribution, whether the model needs it, and how it holds under other corruptions and prompts.

Every figure is a faithfulness, (m(circuit) - m(empty)) / (m(full) - m(empty)), measured by the
pruning stage's own evaluator (same held-out pairs, metric and ablation), so the rows of the
verdict compare like with like:

* baseline, random: the circuit's percentile among `n` random circuits with its per-layer head
  counts (each layer keeps as many heads as the circuit keeps there, chosen at random);
* baseline, magnitude / wanda: the circuit of the same size from weights alone, heads ranked by
  ||W_O[h]||_F (magnitude pruning), or by Wanda's |W| * ||x|| (Sun et al. 2023: each output
  projection weight times the norm of its input over the task's tokens, summed per head);
* necessity: the full model with only the circuit removed (its heads ablated, every other head
  live): near 0 when the model needs the circuit, near 1 when other heads do the task without it;
* robustness: the circuit under each other corruption the task offers (ioi: s2 / abc; induction:
  swap / fresh), with the pairs regenerated under that corruption;
* generalization: the circuit on the task's held-out templates (where the task has them);
* stability: the Jaccard of the kept set over resamples of the examples (pruning.stability_resamples).

`verdict_rows` assembles the table that circuit.pt, `circuitkit show` and the report print.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from circuitkit.discovery.attribution.metrics import answer_forward
from circuitkit.discovery.pruning.heads import evaluate_each, faithfulness
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet
from circuitkit.models.placement import input_device

PILLARS = ("baseline_random", "baseline_magnitude", "baseline_wanda", "necessity", "robustness", "generalization",
           "stability")
DEFINITIONS = {
    "faithfulness": "(m(circuit) - m(empty)) / (m(full) - m(empty)) on the held-out pairs",
    "baseline_random": "percentile of the circuit's faithfulness among random circuits with its per-layer head"
                       " counts (100 = above every one)",
    "baseline_magnitude": "faithfulness of the same number of heads with the largest ||W_O[h]||_F",
    "baseline_wanda": "faithfulness of the same number of heads with the largest Wanda score (|W_O| x ||z|| over"
                      " the task's tokens, summed per head)",
    "necessity": "faithfulness of the full model with only the circuit's heads ablated (low = the model needs"
                 " the circuit)",
    "robustness": "faithfulness of the circuit on the held-out prompts corrupted by the task's other corruption(s)"
                  " (the lowest, when several)",
    "generalization": "faithfulness of the circuit on the task's held-out templates",
    "stability": "Jaccard of the kept set over resamples of the attribution examples",
}


def random_same_shape(kept: torch.Tensor, n: int, seed: int) -> list[torch.Tensor]:
    """`n` random (L, H) masks with `kept`'s number of heads in every layer."""
    g = torch.Generator().manual_seed(seed)
    per_layer = kept.sum(dim=1).tolist()
    masks = []
    for _ in range(n):
        m = torch.zeros_like(kept, dtype=torch.bool)
        for layer, k in enumerate(per_layer):
            m[layer, torch.randperm(kept.shape[1], generator=g)[:int(k)]] = True
        masks.append(m)
    return masks


def random_baseline(evaluate: Callable[[torch.Tensor], float], kept: torch.Tensor, ours: float, m_full: float,
                    m_empty: float, n: int = 100, seed: int = 0) -> dict:
    """The circuit's percentile among `n` random circuits of its per-layer shape (ties count half).

    A head `Evaluator` runs the random circuits side by side in batched forwards (`evaluate_each`).
    A random circuit that is the circuit itself scores `ours`, exactly: a tie, whatever the
    round-off of the forward it would have shared with others.
    """
    masks = random_same_shape(kept, n, seed)
    others = [m for m in masks if not torch.equal(m, kept)]
    measured = iter(evaluate_each(evaluate, others))
    values = [ours if torch.equal(m, kept) else faithfulness(next(measured), m_full, m_empty) for m in masks]
    below = sum(v < ours for v in values) + 0.5 * sum(v == ours for v in values)
    ordered = sorted(values)
    return {"percentile": 100.0 * below / n, "n": n, "mean": sum(values) / n,
            "p95": ordered[min(n - 1, int(0.95 * n))], "max": ordered[-1]}


def magnitude_scores(adapter: ModelAdapter) -> torch.Tensor:
    """(L, H) on the CPU: ||W_O[h]||_F, the Frobenius norm of each head's slice of the output projection."""
    return torch.stack([adapter.o_weights(layer)[0].detach().float().flatten(1).norm(dim=1).cpu()
                        for layer in range(adapter.n_layers)])


@torch.no_grad()
def wanda_scores(adapter: ModelAdapter, data: TaskData, batch_size: int) -> torch.Tensor:
    """(L, H): Wanda's per-weight score |W_ij| * ||x_j||_2 (x = the output projection's input z over
    every real token of the clean prompts), summed over each head's weights.

    The squares of z are summed by a hook as each batch runs: nothing of the run is kept, so this
    costs one plain forward per batch."""
    L, H, dh = adapter.n_layers, adapter.n_heads, adapter.head_dim
    sq = [torch.zeros(H * dh) for _ in range(L)]
    device = input_device(adapter.model)
    real: list[torch.Tensor] = []  # the batch's attention mask, read by the hooks

    def add(layer: int):
        def hook(module, args):
            z = args[0]  # (B, T, H * dh)
            sq[layer] += z[real[0].to(z.device)].float().pow(2).sum(0).cpu()
        return hook

    with HookSet() as hooks:
        for layer in range(L):
            hooks.pre(adapter.z_input(layer), add(layer))
        for batch in data.batches(batch_size):
            b = batch.to(device)
            real[:] = [b.attention_mask.bool()]
            answer_forward(adapter.model, b.clean_ids, b.attention_mask, b.answer_pos)  # logits at the answer only
    scores = torch.zeros(L, H)
    for layer in range(L):
        w = adapter.o_weights(layer)[0].detach().float().abs().cpu()  # (H, d_model, dh)
        scores[layer] = (w * sq[layer].sqrt().view(H, 1, dh)).sum(dim=(1, 2))
    return scores


def top_heads_like(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(L, H) bool: the `k` heads with the largest scores."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[scores.flatten().argsort(descending=True)[:k]] = True
    return mask.view(scores.shape)


def verdict_rows(figures: dict, notes: dict[str, str] | None = None) -> list[dict]:
    """The verdict table: one row per measured pillar, {pillar, value, detail, definition}.

    `notes` ({pillar: text}): appended to a measured pillar's detail; a pillar with no figure but
    a note gets a row whose value is None and whose detail is the note (why it was not measured).
    A value taken from a dict (robustness by corruption) is its lowest finite figure.
    """
    notes = notes or {}
    rows = []
    for name in ("faithfulness", *PILLARS):
        if figures.get(name) is None:
            if name in notes:
                rows.append({"pillar": name, "value": None, "detail": notes[name], "definition": DEFINITIONS[name]})
            continue
        value = figures[name]
        detail = ""
        if isinstance(value, dict):  # random baseline, robustness / generalization by set
            if name == "baseline_random":
                detail = (f"{value['n']} random circuits: mean {value['mean']:.3f}, 95th percentile {value['p95']:.3f},"
                          f" max {value['max']:.3f}")
                value = value["percentile"]
            else:
                detail = ", ".join(f"{k} {v:.3f}" for k, v in value.items())
                value = min((v for v in value.values() if math.isfinite(v)), default=float("nan")) if value else None
        if name in notes:
            detail = f"{detail}; {notes[name]}" if detail else notes[name]
        rows.append({"pillar": name, "value": value, "detail": detail, "definition": DEFINITIONS[name]})
    return rows
