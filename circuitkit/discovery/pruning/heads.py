"""Pruning to a target sparsity, and faithfulness: `prune` is what the pruning stage runs.

`pruning.scope: heads` removes heads, `edges` removes edges (`circuitkit.discovery.pruning.edges` runs
the edge circuits); both select with `keep_top` (`select_heads`, `select_edges`), or with
`pruning.selection: bootstrap` (`circuitkit.discovery.pruning.selection`), `positive` (`circuitkit.discovery.pruning.selection_ip`),
`mask` (a soft mask over heads, or edges, optimized on the attribution pairs:
`circuitkit.discovery.pruning.optimize`) or, for edges, `edge_pruning` (the same as `mask` there) or `ip`
(integer programming, `circuitkit.discovery.pruning.selection_ip`), and both evaluators take the kept
mask. Heads are removed lowest score first (`rank_by: abs` on |score|, `signed` on the score)
and ablated through a hook on z, the input of the attention output projection:

    corrupted  z from the corrupted prompt of the same example (the default: what the scores measure)
    mean       the mean of z over the task's clean examples at each position
    zero       0

Faithfulness on held-out examples: f = (m(circuit) - m(empty)) / (m(full) - m(empty)), where
"empty" ablates every head (MLPs and embeddings always stay).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from circuitkit.discovery.attribution.eap import AttributionScores, cached_run
from circuitkit.discovery.config import PruningConfig, mask_steps_of
from circuitkit.discovery.pruning.circuit_forward import ablate_heads  # noqa: F401  (re-exported)
from circuitkit.discovery.pruning.edges import EdgeEvaluator, mean_writes
from circuitkit.discovery.pruning.evaluator import (  # noqa: F401  (re-exported: the names callers know)
    CURVE_PERCENTS,
    Evaluator,
    curve_areas,
    curve_count,
    curve_masks,
    evaluate_each,
    faithfulness,
    sparsity_curve,
)
from circuitkit.discovery.pruning.optimize import learn_edge_mask, learn_head_mask
from circuitkit.discovery.pruning.selection import BootstrapSelector, RankSelector, keep_top  # noqa: F401  (keep_top: re-exported)
from circuitkit.discovery.pruning.selection_ip import IPSelector, positive_select
from circuitkit.discovery.pruning.stability import selector_stability, stability
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """What a target sparsity keeps: heads (n_layers, n_heads) or edges (n_upstream, n_downstream)."""

    mask: torch.Tensor  # bool, True = kept
    n_removed: int
    achieved_sparsity: float


def select_heads(head_scores: torch.Tensor, target_sparsity: float, rank_by: str = "abs") -> Selection:
    """Keep the highest-ranked heads; remove round(target_sparsity * n_heads) of them.

    Warns when the target rounds to no head removed although it is above 0.
    """
    if not 0.0 <= target_sparsity < 1.0:
        raise ValueError(f"pruning.target_sparsity={target_sparsity} must be in [0, 1)")
    n_total = head_scores.numel()
    n_removed = round(target_sparsity * n_total)
    if target_sparsity > 0 and n_removed == 0:
        log.warning("pruning.target_sparsity=%s removes 0 of %d heads after rounding to whole heads;"
                    " achieved sparsity 0.0 (the circuit is the full model). Raise it to at least %.3g to"
                    " remove one head.", target_sparsity, n_total, 0.5 / n_total)
    return Selection(keep_top(head_scores, n_total - n_removed, rank_by), n_removed, n_removed / n_total)


def select_edges(edge_scores: torch.Tensor, valid: torch.Tensor, target_sparsity: float,
                 rank_by: str = "abs") -> Selection:
    """Keep the highest-ranked of the edges that exist (`valid`, (n_upstream, n_downstream));
    remove round(target_sparsity * n_edges) of them."""
    n_total = int(valid.sum())
    n_removed = round(target_sparsity * n_total)
    return Selection(keep_top(edge_scores, n_total - n_removed, rank_by, valid), n_removed, n_removed / n_total)


@torch.no_grad()
def mean_z(adapter: ModelAdapter, data: TaskData, batch_size: int) -> torch.Tensor:
    """Mean of z over the clean examples at each position: (n_layers, T, n_heads * head_dim) float32.

    Positions past an example's end are left out of that position's mean.
    """
    device = input_device(adapter.model)
    total, count = None, None
    for batch in data.batches(batch_size):
        batch = batch.to(device)
        rec = cached_run(adapter, batch.clean_ids, batch.attention_mask, batch.answer_pos, edges=False)
        z = torch.stack([zl.float() for zl in rec.z])  # (L, B, T, H*dh)
        w = batch.attention_mask.float()[None, :, :, None]
        part, n = (z * w).sum(1), w.sum(1)
        total = part if total is None else total + part
        count = n if count is None else count + n
    return (total / count.clamp(min=1)).cpu()


@torch.no_grad()
def head_means(adapter: ModelAdapter, data: TaskData, batch_size: int) -> torch.Tensor:
    """Mean of z over every token of the clean examples, one vector per head (not per position):
    (n_layers, n_heads * head_dim) float32. What a weight export folds into the output
    projection's bias (`circuitkit.discovery.export.hf`); padding is left out."""
    device = input_device(adapter.model)
    total, count = None, 0.0
    for batch in data.batches(batch_size):
        batch = batch.to(device)
        rec = cached_run(adapter, batch.clean_ids, batch.attention_mask, batch.answer_pos, edges=False)
        w = batch.attention_mask.float()[:, :, None]  # (B, T, 1)
        part = torch.stack([(zl.float() * w).sum((0, 1)) for zl in rec.z])  # (L, H*dh)
        total = part if total is None else total + part
        count += float(w.sum())
    return (total / max(count, 1.0)).cpu()


WEIGHT_ABLATIONS = ("mean", "zero")  # what a weight export can hold (one vector per head, or 0)


def weight_ablation_faithfulness(adapter: ModelAdapter, held_out: TaskData, metric: str, head_mask: torch.Tensor,
                                 means: torch.Tensor, batch_size: int, reference: tuple[str, float]) -> dict:
    """The circuit's faithfulness under the ablations a weight export can hold, on the held-out pairs:

        {"mean": {full, empty, circuit, faithfulness}, "zero": {...}, "reference_ablation": a,
         "reference_faithfulness": f, "n_heads_kept": k}

    mean: each removed head's z replaced by its mean over every token of the attribution examples
    (`head_means`, one vector per head); zero: 0. `reference` is (pruning.ablation, its
    faithfulness), the counterfactual figure by default, which no weights can hold.
    """
    out: dict = {"reference_ablation": reference[0], "reference_faithfulness": reference[1],
                 "n_heads_kept": int(head_mask.sum())}
    for ablation in WEIGHT_ABLATIONS:
        values = means[:, None, :] if ablation == "mean" else None  # (L, 1, H*dh): every position alike
        evaluate = Evaluator(adapter, held_out, metric, ablation, values, batch_size)
        full, empty, circuit = evaluate.many(torch.stack([torch.ones_like(head_mask), torch.zeros_like(head_mask),
                                                           head_mask]))
        out[ablation] = {"full": full, "empty": empty, "circuit": circuit,
                         "faithfulness": faithfulness(circuit, full, empty)}
    return out


@dataclass
class PrunedCircuit:
    """What `prune` found: the kept set, its masks, the metrics and the faithfulness curve."""

    selection: Selection  # heads (L, H) or edges (n_upstream, n_downstream); mask True = kept
    n_total: int  # heads or existing edges
    head_mask: torch.Tensor  # (L, H) bool: heads kept (edge scope: with any kept edge)
    mlp_mask: torch.Tensor  # (L,) bool
    metrics: dict[str, float]  # full, empty, circuit, faithfulness
    curve: list[dict]
    cpr: float
    cmd: float
    ablation_values: dict  # stored in circuit.pt: mean_z (heads) or the edge mask and node lists
    extra: dict = field(default_factory=dict)  # circuit.pt's selection and curve fields: see `circuit_fields`
    # Head scope: the Evaluator that measured `metrics` (the verdict reuses it; not stored).
    evaluator: Evaluator | None = field(default=None, repr=False)


# MIB's evaluation scores an importances submission twice (mttk/MIB-circuit-track-autoeval,
# eval_submissions.py: `for absolute in (True, False)`): the absolute=False run (edges ranked by
# signed score) is filed as CPR, the absolute=True run (ranked by |score|) as CMD.
MIB_RANK_BY = {"cpr": "signed", "cmd": "abs"}


def mib_setting(scope: str, ablation: str, selection: str) -> bool:
    """True when the curve is MIB's up to the ranking: edges, corrupted ablation, the top n by score."""
    return scope == "edges" and ablation == "corrupted" and selection == "top_k"


def mib_pair(curves: dict[str, list[dict]], gqa: bool = False) -> dict:
    """MIB's (CPR, CMD) from the two rankings' curves: CPR = area under f of the signed ranking,
    CMD = area between f and 1 of the |score| ranking (`MIB_RANK_BY`). `curves`: {rank_by: rows}."""
    out = {"cpr": curve_areas(curves[MIB_RANK_BY["cpr"]])[0], "cmd": curve_areas(curves[MIB_RANK_BY["cmd"]])[1],
           "cpr_rank_by": MIB_RANK_BY["cpr"], "cmd_rank_by": MIB_RANK_BY["cmd"],
           "curve_signed": curves["signed"], "curve_abs": curves["abs"]}
    if gqa:
        out["note"] = ("GQA: edges counted as CircuitKit's (one key/value edge per KV head); MIB counts one per"
                       " query head, so its shares select slightly different sets")
    return out


def curve_definition(scope: str, ablation: str, rank_by: str, selection: str, metric: str,
                     mib: dict | None = None) -> str:
    """One line saying what the faithfulness curve is, whether it is MIB's, and MIB's pair when measured."""
    unit = "heads (node level)" if scope == "heads" else "edges"
    rule = "positive scores only, by signed score" if selection == "positive" else f"{selection} by {rank_by} score"
    text = (f"share of {unit} kept over MIB's grid 0.1%..100%, {ablation} ablation, {rule},"
            f" {metric}; CPR/CMD trapezoids on a linear axis")
    if not mib_setting(scope, ablation, selection):
        return text + ("; not MIB's setting (MIB: edges, corrupted ablation, top_k; its CPR ranks by signed"
                       " score, its CMD by |score|)")
    which = "CPR" if rank_by == MIB_RANK_BY["cpr"] else "CMD"
    text += (f"; MIB's circuit-track setting for its {which} (MIB ranks by signed score for CPR, by |score|"
             " for CMD)")
    if mib is not None:
        text += (f"; MIB's pair: CPR {mib['cpr']:.4f} (signed ranking), CMD {mib['cmd']:.4f} (|score| ranking),"
                 " circuit.pt `mib`")
    return text


def circuit_fields(found: PrunedCircuit) -> dict:
    """The circuit.pt fields of the selection and its curve, in one place (for the typed Circuit artifact):

        curve_definition  str: what the curve is (`curve_definition`)
        selection         str: pruning.selection (top_k / bootstrap / edge_pruning / mask / ...)
        stability         dict | None: Jaccard of the kept set over bootstrap resamples of the
                          examples (`circuitkit.discovery.pruning.stability.stability`), None without per-example scores
        heldout_templates dict | None: {n_examples, full, empty, circuit, faithfulness} of the same
                          circuit and ablation on the task's held-out templates (`prune(heldout=...)`)
        mib               dict | None: MIB's (CPR, CMD) pair at edge scope, corrupted ablation, top_k
                          (`mib_pair`: cpr from the signed ranking's curve, cmd from the |score|
                          ranking's, both curves); None in any other setting
        head_means        (L, H*head_dim) float32: each head's mean z over every token of the
                          attribution examples (`head_means`), what a weight export folds in
        weight_ablations  dict: the kept heads' faithfulness under mean / zero ablation with those
                          means, beside pruning.ablation's (`weight_ablation_faithfulness`)
        corruptions       dict | None: several corruptions in one discovery (`prune(corruptions=...)`):
                          names, rule, the folded faithfulness, each corruption's full / empty /
                          circuit / faithfulness, and the folded curve's CPR / CMD
    """
    return dict(found.extra)


def prune(adapter: ModelAdapter, scores: AttributionScores, attr_data: TaskData, held_out: TaskData,
          p: PruningConfig, metric: str, batch_size: int, heldout: TaskData | None = None,
          corruptions: dict[str, TaskData] | None = None, corruption_faithfulness: str = "worst",
          corruption_attr: dict[str, TaskData] | None = None) -> PrunedCircuit:
    """Select the circuit at `p.target_sparsity`, and measure it on the held-out pairs.

    Mean ablation takes its means over `attr_data` (the attribution examples). Edge scope needs
    `scores.edges`. The faithfulness curve evaluates the same selection rule at CURVE_PERCENTS
    kept. With per-example scores (`scores.per_example`) the stability of the kept set is
    measured over `p.bootstrap_resamples` resamples, and `p.selection=bootstrap` can run.
    `heldout`: pairs from templates attribution never saw; the circuit's faithfulness on them
    (same kept set, ablation and means) goes to `extra["heldout_templates"]`.
    `corruptions`: several corruptions in one discovery, {name: held-out pairs}, the primary (the
    pairs of `held_out`) first; the circuit's faithfulness, the curve and CPR/CMD are then folded
    over them by `corruption_faithfulness` (worst, mean), each one's kept in `extra["corruptions"]`
    (`circuitkit.discovery.pruning.corruptions`; head scope). `corruption_attr`: the attribution
    pairs under each, primary first; selection=mask then learns its mask under every corruption,
    folded by `corruption_faithfulness` (`learn_head_mask(others=...)`).
    """
    g = scores.graph
    per_example = (scores.per_example or {}).get("head" if p.scope == "heads" else "edges")
    selection_rule = p.selection
    if selection_rule in ("bootstrap", "mean_rank", "vote") and per_example is None:
        log.warning("pruning.selection=%s needs per-example scores (discovery.per_example=true, not exact"
                    " patching; shards written by this version); selecting top_k instead.", selection_rule)
        selection_rule = "top_k"
    if selection_rule == "edge_pruning" and p.scope != "edges":
        log.warning("pruning.selection=edge_pruning optimizes a mask over edges and needs pruning.scope=edges;"
                    " selecting top_k heads instead (pruning.selection=mask optimizes one over heads).")
        selection_rule = "top_k"
    if selection_rule == "ip" and p.scope != "edges":
        log.warning("pruning.selection=ip: at head scope every head set is connected, so the integer program's"
                    " optimum is the top n by rank_by; selecting top_k heads.")
        selection_rule = "top_k"
    if selection_rule == "mask" and p.scope == "edges":
        selection_rule = "edge_pruning"  # the same optimization, by its edge-scope name
    if selection_rule in ("edge_pruning", "mask") and p.ablation != "corrupted":
        log.warning("pruning.selection=%s optimizes its mask under corrupted ablation (MIB's); the curve"
                    " is measured under pruning.ablation=%s.", selection_rule, p.ablation)
    if p.scope == "heads":
        means = mean_z(adapter, attr_data, batch_size) if p.ablation == "mean" else None
        evaluate = Evaluator(adapter, held_out, metric, p.ablation, means, batch_size)
        selection = select_heads(scores.head, p.target_sparsity, p.rank_by)
        valid, ranked = None, scores.head
    else:
        means = mean_writes(adapter, attr_data, batch_size) if p.ablation == "mean" else None
        evaluate = EdgeEvaluator(adapter, held_out, metric, p.ablation, means, batch_size)
        valid, ranked = g.edge_mask(), scores.edges
        selection = select_edges(scores.edges, valid, p.target_sparsity, p.rank_by)

    selector = (BootstrapSelector(per_example, p.rank_by, max(p.bootstrap_resamples, 1), 0, valid)
                if selection_rule == "bootstrap" else None)
    if selection_rule == "edge_pruning":
        theta = learn_edge_mask(adapter, attr_data, scores.edges, valid, metric, mask_steps_of(p), p.mask_lr,
                                p.mask_penalty, batch_size)
        selector = functools.partial(keep_top, theta, rank_by="signed", valid=valid)
    mask_under = list(corruption_attr or ())
    if selection_rule == "mask":  # several corruptions: learned under each (the primary's pairs are attr_data)
        others = [corruption_attr[c] for c in mask_under[1:]] if len(mask_under) > 1 else None
        theta = learn_head_mask(adapter, attr_data, scores.head, metric, mask_steps_of(p), p.mask_lr, p.mask_penalty,
                                batch_size, others=others, rule=corruption_faithfulness)
        selector = functools.partial(keep_top, theta, rank_by="signed")
    if selection_rule == "ip":
        selector = IPSelector(scores.edges, valid, g, p.rank_by, p.ip_connectivity, p.ip_time_limit_s)
    if selection_rule == "positive":
        selector = functools.partial(positive_select, ranked, valid=valid)
    if selection_rule in ("mean_rank", "vote"):
        selector = RankSelector(per_example, selection_rule, p.rank_by, valid)

    def choose(n_keep: int) -> torch.Tensor:
        if selector is not None:
            return selector(n_keep)
        return keep_top(ranked, n_keep, p.rank_by, valid)

    if selection_rule != "top_k":
        mask = choose(int(selection.mask.sum()))  # positive, ip by signed score: maybe fewer than asked
        n_total = mask.numel() if valid is None else int(valid.sum())
        selection = Selection(mask, n_total - int(mask.sum()), (n_total - int(mask.sum())) / n_total)
    kept = selection.mask
    if p.scope == "heads":
        head_mask = kept
        mlp_mask = torch.ones(g.n_layers, dtype=torch.bool)  # head pruning never removes an MLP
        stored = {"mean_z": means}
    else:
        head_mask = torch.tensor([[bool(kept[g.head_index(layer, h)].any()) for h in range(g.n_heads)]
                                  for layer in range(g.n_layers)])
        mlp_mask = kept[[g.mlp_index(layer) for layer in range(g.n_layers)]].any(dim=1)
        stored = {"edge_mask": kept, "mean_z": None, "upstream_nodes": g.upstream, "downstream_nodes": g.downstream}
    # The full model, the empty circuit, ours and the curve's points: one batched evaluation at head scope.
    points = curve_masks(ranked, p.rank_by, valid, choose)
    full_mask = torch.ones_like(kept) if valid is None else valid
    m_full, m_empty, m_circuit, *on_curve = evaluate_each(evaluate, [full_mask, torch.zeros_like(kept), kept,
                                                                     *points.values()])
    f = faithfulness(m_circuit, m_full, m_empty)
    curve = sparsity_curve(evaluate, ranked, p.rank_by, m_full, m_empty, valid, choose,
                           dict(zip(points, on_curve, strict=True)))
    cpr, cmd = curve_areas(curve)
    joint = None
    if corruptions and len(corruptions) > 1 and p.scope == "heads":
        from circuitkit.discovery.pruning.corruptions import joint_selection

        first, *others = corruptions
        joint = joint_selection(adapter, (first, {"full": m_full, "empty": m_empty, "circuit": m_circuit,
                                                  "curve_metrics": dict(zip(points, on_curve, strict=True))}),
                                {c: corruptions[c] for c in others}, kept, points, curve, corruption_faithfulness,
                                metric, p.ablation, means, batch_size)
        curve, cpr, cmd = joint.pop("curve"), joint["cpr"], joint["cmd"]
        if selection_rule == "mask":  # which corruptions the mask was learned under
            joint["mask_learned_under"] = mask_under if len(mask_under) > 1 else [first]
    mib = None
    if mib_setting(p.scope, p.ablation, selection_rule):  # MIB's pair needs the other ranking's curve too
        other_rank = "abs" if p.rank_by == "signed" else "signed"
        curves = {p.rank_by: curve, other_rank: sparsity_curve(evaluate, ranked, other_rank, m_full, m_empty, valid)}
        mib = mib_pair(curves, gqa=g.n_kv_heads < g.n_heads)
    stable = None
    if per_example is not None and p.bootstrap_resamples > 0:
        stable = stability(per_example, int(kept.sum()), p.rank_by, p.bootstrap_resamples, 0, valid, kept)
        if selection_rule in ("mean_rank", "vote"):  # the rule's own stability: rerun on each resample
            stable |= selector_stability(per_example.shape[0], functools.partial(selector, int(kept.sum())), kept,
                                         p.bootstrap_resamples, 0)
    extra = {"curve_definition": curve_definition(p.scope, p.ablation, p.rank_by, selection_rule, metric, mib),
             "selection": selection_rule, "stability": stable, "heldout_templates": None, "mib": mib,
             "corruptions": joint}
    # What a weight export can hold (mean or zero, never a counterfactual), measured on the same pairs.
    extra["head_means"] = head_means(adapter, attr_data, batch_size)
    extra["weight_ablations"] = weight_ablation_faithfulness(adapter, held_out, metric, head_mask,
                                                             extra["head_means"], batch_size, (p.ablation, f))
    if joint is not None:  # the primary's figure above (the pairs a weight export is measured on), the folded one below
        f = joint["faithfulness"]
    if heldout is not None and len(heldout) > 0:
        other = (Evaluator if p.scope == "heads" else EdgeEvaluator)(adapter, heldout, metric, p.ablation, means,
                                                                     batch_size)
        h_full, h_empty, h_circuit = evaluate_each(other, [full_mask, torch.zeros_like(kept), kept])
        extra["heldout_templates"] = {"n_examples": len(heldout), "full": h_full, "empty": h_empty,
                                      "circuit": h_circuit, "faithfulness": faithfulness(h_circuit, h_full, h_empty)}
    return PrunedCircuit(selection, kept.numel() if valid is None else int(valid.sum()), head_mask, mlp_mask,
                         {"full": m_full, "empty": m_empty, "circuit": m_circuit, "faithfulness": f},
                         curve, cpr, cmd, stored, extra, evaluate if p.scope == "heads" else None)
