"""Edge pruning warm-started from attribution scores (`pruning.selection: edge_pruning`).

One of the winning ideas of the BlackboxNLP 2025 MIB shared task (after Bhaskar et al. 2024,
"Finding Transformer Circuits with Edge Pruning"): a continuous mask over the edges, optimized
by gradient descent so that the masked model matches the full one, with a penalty on the
mask's density, and initialised from EAP / EAP-IG scores instead of from scratch.

    mask      m_uv = sigmoid(θ_uv) on every existing edge u→v
    circuit   in_v = resid_v - Σ_u (1 - m_uv) (write_u(live) - write_u(corrupted))
              (`circuitkit.discovery.pruning.edges`, soft mode: counterfactual ablation, as MIB)
    loss      mean over examples of (m(circuit) - m(full))² / (m̄(full) - m̄(corrupted))²
              + penalty x mean_uv m_uv
    start     θ_uv = init_scale x (logit(q_uv) - logit(1 - init_density)), q_uv the rank quantile
              of |s_uv|: the top init_density of the edges by |score| start above 0.5

Adam on θ for `steps` steps over the attribution pairs (one batch per step, cycling; only the
first steps x batch_size pairs are used, and their runs recorded). The
trained θ ranks the edges: the circuit at any size n keeps the n edges of highest θ, so one
optimization serves every point of the faithfulness curve. Cost: `steps` forward and backward
passes of one batch through the masked model (plus one clean and one corrupted forward per
batch, recorded once), on top of the attribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from circuitkit.discovery.attribution.eap import record_head_runs
from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
from circuitkit.discovery.pruning.edges import EdgeEvaluator, _install_edge_circuit
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet

log = logging.getLogger(__name__)


def warm_start(scores: torch.Tensor, valid: torch.Tensor, init_density: float = 0.05,
               init_scale: float = 2.0) -> torch.Tensor:
    """Initial mask logits θ (shape of `scores`) from the rank of |score| among the `valid` edges.

    With q the rank quantile in (0, 1) (1 = highest |score|), θ = init_scale x (logit(q) -
    logit(1 - init_density)): the top init_density of the edges start above 0.5, the order is
    the score's, and ties or zero scores need no special case. 0 outside `valid` (never used).
    """
    key = scores.abs().float()[valid]
    n = key.numel()
    rank = torch.empty(n)
    rank[key.argsort(stable=True)] = torch.arange(n, dtype=torch.float32)
    q = (rank + 0.5) / n
    theta = torch.zeros(scores.shape)
    theta[valid] = init_scale * (torch.logit(q) - torch.logit(torch.tensor(1 - init_density)))
    return theta


def _train_mask(adapter: ModelAdapter, theta: torch.Tensor, runs: list[tuple[TaskData, torch.Tensor]],
                masked_forward: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]], metric: str,
                gap: float, steps: int, lr: float, penalty: float,
                progress: Callable[[int, float, float, float], None] | None) -> torch.Tensor:
    """Adam on the mask logits θ, one recorded batch per step, cycling: loss = mean over the batch of
    (m(circuit) - m(full))² / gap² + penalty x density. runs[i] = (batch, its clean answer logits);
    masked_forward(θ, i) -> (answer logits of batch i through the soft circuit, the mask's density).
    The model's parameters are frozen meanwhile. Returns the trained θ on the CPU."""
    theta = theta.requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    targets = [compute_metric(metric, answer, batch, answer) for batch, answer in runs]
    requires = [p.requires_grad for p in adapter.model.parameters()]
    for p in adapter.model.parameters():
        p.requires_grad_(False)
    try:
        for step in range(steps):
            i = step % len(runs)
            batch, clean_answer = runs[i]
            logits, density = masked_forward(theta, i)
            faith = ((compute_metric(metric, logits, batch, clean_answer) - targets[i]) ** 2).mean() / gap ** 2
            loss = faith + penalty * density
            opt.zero_grad()
            loss.backward()
            opt.step()
            if progress is not None:
                progress(step + 1, loss.item(), faith.item(), density.item())
    finally:
        for p, r in zip(adapter.model.parameters(), requires, strict=True):
            p.requires_grad_(r)
    return theta.detach().cpu().clone()


def learn_edge_mask(adapter: ModelAdapter, data: TaskData, scores: torch.Tensor, valid: torch.Tensor,
                    metric: str = "logit_diff", steps: int = 40, lr: float = 0.05, penalty: float = 1.0,
                    batch_size: int = 8, init_density: float = 0.05,
                    progress: Callable[[int, float, float, float], None] | None = None) -> torch.Tensor:
    """Trained mask logits θ (shape of `scores`, float32; -inf outside `valid`): rank edges by them.

    data: the pairs to optimize on (the attribution pairs). progress(step, loss, faithfulness
    loss, mean mask) after every step.
    """
    if steps < 1:
        raise ValueError(f"pruning.mask_steps={steps} must be at least 1")
    data = data[:steps * batch_size]  # the batches the steps reach: only those are recorded
    ev = EdgeEvaluator(adapter, data, metric, "corrupted", None, batch_size)  # clean, corrupted, ablated writes
    gap = (ev.m_clean - ev.m_corrupted) / ev.n
    if abs(gap) < 1e-6:
        raise ValueError("edge pruning needs the clean and corrupted runs to differ on the metric (their mean"
                         f" {metric} gap is {gap:.2e}); use pairs whose corruption changes the answer.")
    theta = warm_start(scores, valid, init_density).to(ev.batches[0][0].clean_ids.device)
    valid_f = valid.to(theta.device).float()
    n_valid = valid_f.sum()
    runs = [(batch, answer) for batch, answer, _ in ev.batches]

    def masked_forward(theta: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = runs[i][0]
        mask = torch.sigmoid(theta) * valid_f
        with HookSet() as hk:
            _install_edge_circuit(adapter, hk, mask, ev.ablated(i), soft=True)
            logits = answer_forward(adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        return logits, mask.sum() / n_valid

    out = _train_mask(adapter, theta, runs, masked_forward, metric, gap, steps, lr, penalty, progress)
    out[~valid] = -torch.inf
    return out


def install_head_mask(adapter: ModelAdapter, hk: HookSet, mask: torch.Tensor, corrupted_z: list[torch.Tensor]) -> None:
    """Hooks that make head h's output m_h z(live) + (1 - m_h) z(corrupted): mask (L, H) in [0, 1]
    (differentiable), corrupted_z[layer] (B, T, H x head_dim) from the corrupted run. A 0/1 mask is
    the pruning evaluator's counterfactual ablation (`circuitkit.discovery.pruning.heads.ablate_heads`)."""
    dh = adapter.head_dim
    for layer in range(adapter.n_layers):
        def hook(module, args, layer=layer):
            z = args[0]
            m = mask[layer].repeat_interleave(dh).to(z.dtype)
            cz = corrupted_z[layer][..., :z.shape[-2], :].to(z.dtype)
            return (cz + m * (z - cz), *args[1:])
        hk.pre(adapter.z_input(layer), hook)


def learn_head_mask(adapter: ModelAdapter, data: TaskData, scores: torch.Tensor, metric: str = "logit_diff",
                    steps: int = 40, lr: float = 0.1, penalty: float = 1.0, batch_size: int = 8,
                    init_density: float = 0.1,
                    progress: Callable[[int, float, float, float], None] | None = None,
                    others: list[TaskData] | None = None, rule: str = "worst") -> torch.Tensor:
    """Trained head-mask logits θ (L, H) float32, warm-started from |scores| (L, H): rank heads by them.

    The head-scope twin of `learn_edge_mask`: head h's output z is m_h z(live) + (1 - m_h)
    z(corrupted), m = sigmoid(θ), with the same loss (squared metric error against the full model,
    normalized by the clean-corrupted gap, + penalty x mean mask) and Adam, one batch of `data`
    per step, cycling.

    others: the same clean pairs under other corruptions (several corruptions in one discovery).
    Each step then runs the step's batch under every corruption c, each loss ℓ_c normalized by c's
    own gap, and folds them as `discovery.corruption_faithfulness` folds faithfulness: rule worst =
    the step follows the gradient of max_c ℓ_c (the corruption the mask serves least), mean = of
    mean_c ℓ_c; one corruption's backward at a time.
    """
    if steps < 1:
        raise ValueError(f"pruning.mask_steps={steps} must be at least 1")
    recorded = [_recorded_head_runs(adapter, d, metric, steps, batch_size) for d in [data, *(others or [])]]
    batches, gap = recorded[0]
    theta = warm_start(scores, torch.ones(scores.shape, dtype=torch.bool), init_density).to(batches[0][0].clean_ids.device)

    def forward_under(c: int) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
        def masked_forward(theta: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            batch, mask = recorded[c][0][i][0], torch.sigmoid(theta)
            with HookSet() as hk:
                install_head_mask(adapter, hk, mask, recorded[c][0][i][2])
                logits = answer_forward(adapter.model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
            return logits, mask.mean()
        return masked_forward

    if len(recorded) == 1:
        runs = [(batch, answer) for batch, answer, _, _ in batches]
        return _train_mask(adapter, theta, runs, forward_under(0), metric, gap, steps, lr, penalty, progress)
    every = [([(batch, answer) for batch, answer, _, _ in b], forward_under(c), g)
             for c, (b, g) in enumerate(recorded)]
    return _train_mask_several(adapter, theta, every, metric, steps, lr, penalty, rule, progress)


def _recorded_head_runs(adapter: ModelAdapter, data: TaskData, metric: str, steps: int, batch_size: int
                        ) -> tuple[list, float]:
    """(`record_head_runs` of the batches the steps reach, the mean clean - corrupted metric gap)."""
    batches = record_head_runs(adapter, data[:steps * batch_size], batch_size)  # the steps' batches only
    corrupted_total = sum(compute_metric(metric, logits, batch).sum().item() for batch, _, _, logits in batches)
    n = sum(len(batch.clean_ids) for batch, _, _, _ in batches)
    clean_total = sum(compute_metric(metric, answer, batch, answer).sum().item() for batch, answer, _, _ in batches)
    gap = (clean_total - corrupted_total) / n
    if abs(gap) < 1e-6:
        raise ValueError("head mask learning needs the clean and corrupted runs to differ on the metric (their"
                         f" mean {metric} gap is {gap:.2e}); use pairs whose corruption changes the answer.")
    return batches, gap


def _train_mask_several(adapter: ModelAdapter, theta: torch.Tensor, every: list, metric: str, steps: int, lr: float,
                        penalty: float, rule: str,
                        progress: Callable[[int, float, float, float], None] | None) -> torch.Tensor:
    """`_train_mask` under several corruptions. every[c] = (runs, masked_forward, gap) of corruption c,
    as `_train_mask` takes them (the same clean batches, each with c's incorrect answers). Per step,
    ℓ_c = mean over the batch of (m_c(circuit) - m_c(full))² / gap_c² + penalty x density, each
    backward on its own; θ moves along ∇ℓ_c of the largest faithfulness term (rule worst) or the
    mean of the ∇ℓ_c (mean): the density term is the same in each."""
    theta = theta.requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    targets = [[compute_metric(metric, answer, batch, answer) for batch, answer in runs] for runs, _, _ in every]
    requires = [p.requires_grad for p in adapter.model.parameters()]
    for p in adapter.model.parameters():
        p.requires_grad_(False)
    try:
        for step in range(steps):
            faiths, grads = [], []
            for (runs, masked_forward, gap), target in zip(every, targets, strict=True):
                i = step % len(runs)
                batch, clean_answer = runs[i]
                logits, density = masked_forward(theta, i)
                faith = ((compute_metric(metric, logits, batch, clean_answer) - target[i]) ** 2).mean() / gap ** 2
                grads.append(torch.autograd.grad(faith + penalty * density, theta)[0])
                faiths.append(faith.detach())
            faith = torch.stack(faiths)
            folded = faith.max() if rule == "worst" else faith.mean()
            grad = torch.stack(grads)
            opt.zero_grad()
            theta.grad = grad[faith.argmax()] if rule == "worst" else grad.mean(0)
            opt.step()
            if progress is not None:
                progress(step + 1, (folded + penalty * density).item(), folded.item(), density.item())
    finally:
        for p, r in zip(adapter.model.parameters(), requires, strict=True):
            p.requires_grad_(r)
    return theta.detach().cpu().clone()
