"""The pipeline's stages: preflight -> data -> attribution -> pruning -> grads.

A stage that does not exist in this version is registered with `run=None` and a reason, so
selecting it fails before any work instead of pretending.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.table import Table

from circuitkit.pipeline import RunContext, Stage, StageResult, register_stage

DATA_FILE = "data.safetensors"
SCORES_FILE = "scores.safetensors"
HEATMAP_FILE = "head_scores.png"


def _data(ctx: RunContext) -> StageResult:
    """Build the task's clean/corrupted pairs: attribution examples, then held-out examples."""
    from circuitkit.tasks import build_task

    d = ctx.cfg.discovery
    loaded = ctx.model()
    n_attr, n_eval = d.data_params.num_examples, d.data_params.eval_examples
    data = build_task(d.task, loaded.tokenizer, loaded.path, d.data_params, n_attr + n_eval, ctx.cfg.seed)
    path = data.save(ctx.run_dir / DATA_FILE, metadata={
        "task": d.task, "num_examples": str(n_attr), "eval_examples": str(n_eval), "model": ctx.cfg.model.name})
    ctx.state["data"] = data
    ctx.console.print(f"{d.task}: {n_attr} attribution + {n_eval} held-out pairs,"
                      f" {data.clean_ids.shape[1]} tokens (padded)")
    return StageResult([path], {"task": d.task, "num_examples": n_attr, "eval_examples": n_eval,
                                "seq_len": int(data.clean_ids.shape[1])})


def task_data(ctx: RunContext):
    """The data stage's pairs: from this run, or from data.safetensors in the run dir."""
    from circuitkit.tasks import TaskData

    if "data" not in ctx.state:
        path = ctx.run_dir / DATA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run the data stage first (add 'data' to stages).")
        ctx.state["data"] = TaskData.load(path)
    return ctx.state["data"]


def _attribution(ctx: RunContext) -> StageResult:
    """EAP / EAP-IG / exact scores on the attribution examples; scores.safetensors + heatmap."""
    from circuitkit.attribution import run_attribution, save_scores, top_heads
    from circuitkit.plots import head_heatmap

    d = ctx.cfg.discovery
    loaded = ctx.model()
    data = task_data(ctx)[: d.data_params.num_examples]
    scores = run_attribution(loaded.adapter, data, d)
    ctx.state["scores"] = scores
    path = save_scores(ctx.run_dir / SCORES_FILE, scores, {"model": ctx.cfg.model.name, "task": d.task})
    steps = "" if d.algorithm != "eap-ig" else f", ig_steps={scores.info['ig_steps']}"
    plot = head_heatmap(scores.head, ctx.run_dir / HEATMAP_FILE,
                        f"{d.algorithm} head scores ({d.task}, {d.metric}{steps})")
    best = top_heads(scores.head, k=min(5, scores.head.numel()))
    table = Table(title=f"top heads by |score| ({d.algorithm}, {d.level} level, {len(data)} examples)")
    for col in ("layer", "head", "score"):
        table.add_column(col, justify="right")
    for layer, head, value in best:
        table.add_row(str(layer), str(head), f"{value:+.4g}")
    ctx.console.print(table)
    ctx.console.print(f"metric {d.metric}: clean {scores.metric_clean:.4g}, corrupted {scores.metric_corrupted:.4g}")
    summary = {"algorithm": d.algorithm, "level": d.level, "metric": d.metric, "n_examples": len(data),
               "metric_clean": scores.metric_clean, "metric_corrupted": scores.metric_corrupted,
               "embed_score": float(scores.embed), "top_head": f"L{best[0][0]}H{best[0][1]}",
               "top_head_score": best[0][2]}
    if scores.edges is not None:
        summary["n_edges"] = scores.graph.n_edges
    return StageResult([path, plot], summary)


def attribution_scores(ctx: RunContext):
    """The attribution stage's scores: from this run, or from scores.safetensors in the run dir."""
    from circuitkit.attribution import load_scores

    if "scores" not in ctx.state:
        path = ctx.run_dir / SCORES_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: pruning needs attribution scores; add 'attribution'"
                                    " to stages (e.g. stages=[data,attribution,pruning]).")
        ctx.state["scores"] = load_scores(path)
    return ctx.state["scores"]


def _pruning(ctx: RunContext) -> StageResult:
    """Remove the lowest-ranked heads, measure faithfulness on held-out pairs, write circuit.pt."""
    import csv

    from circuitkit.circuit import save_circuit
    from circuitkit.config import to_dict
    from circuitkit.pipeline import package_versions
    from circuitkit.plots import faithfulness_curve, head_heatmap
    from circuitkit.pruning import Evaluator, curve_areas, faithfulness, head_curve, mean_z, select_heads

    p, d = ctx.cfg.pruning, ctx.cfg.discovery
    if p.scope != "heads":
        raise ValueError(f"pruning.scope={p.scope!r}: edge-level circuits are not evaluated in this version;"
                         " use pruning.scope=heads.")
    scores = attribution_scores(ctx)
    loaded = ctx.model()
    adapter = loaded.adapter
    data = task_data(ctx)
    n_attr = d.data_params.num_examples
    held_out = data[n_attr:]
    if len(held_out) == 0:
        raise ValueError("no held-out examples for faithfulness: set discovery.data_params.eval_examples >= 1.")
    means = mean_z(adapter, data[:n_attr], d.batch_size) if p.ablation == "mean" else None
    evaluate = Evaluator(adapter, held_out, d.metric, p.ablation, means, d.batch_size)
    selection = select_heads(scores.head, p.target_sparsity, p.rank_by)
    all_heads = torch.ones_like(selection.mask)
    m_full, m_empty = evaluate(None), evaluate(all_heads)
    m_circuit = evaluate(~selection.mask)
    f = faithfulness(m_circuit, m_full, m_empty)
    curve = head_curve(evaluate, scores.head, p.rank_by, m_full, m_empty)
    cpr, cmd = curve_areas(curve)

    curve_csv = ctx.run_dir / "faithfulness_curve.csv"
    with open(curve_csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    curve_png = faithfulness_curve(curve, ctx.run_dir / "faithfulness_curve.png",
                                   f"{d.task}: CPR {cpr:.3f}, CMD {cmd:.3f}")
    circuit_png = head_heatmap(scores.head, ctx.run_dir / "circuit_heads.png",
                               f"kept heads (outlined), sparsity {selection.achieved_sparsity:.2f}", selection.mask)
    metrics = {"full": m_full, "empty": m_empty, "circuit": m_circuit, "faithfulness": f}
    out_path = Path(ctx.cfg.output_path) if ctx.cfg.output_path else ctx.run_dir / "circuit.pt"
    save_circuit(out_path, {
        "model_name": ctx.cfg.model.name, "model_revision": ctx.cfg.model.revision,
        "head_mask": selection.mask, "head_scores": scores.head, "mlp_scores": scores.mlp,
        "embed_score": scores.embed, "edge_scores": scores.edges, "mean_z": means,
        "ablation": p.ablation, "rank_by": p.rank_by, "target_sparsity": p.target_sparsity,
        "achieved_sparsity": selection.achieved_sparsity, "n_heads_removed": selection.n_removed,
        "metrics": metrics, "curve": curve, "cpr": cpr, "cmd": cmd, "n_eval_examples": len(held_out),
        "config": to_dict(ctx.cfg), "versions": package_versions(),
    })
    ctx.state["circuit_mask"] = selection.mask
    table = Table(title=f"circuit: {int(selection.mask.sum())} of {selection.mask.numel()} heads kept")
    for col in ("target sparsity", "achieved", "m(full)", "m(empty)", "m(circuit)", "faithfulness", "CPR", "CMD"):
        table.add_column(col, justify="right")
    table.add_row(f"{p.target_sparsity:.3f}", f"{selection.achieved_sparsity:.3f}", f"{m_full:.4g}", f"{m_empty:.4g}",
                  f"{m_circuit:.4g}", f"{f:.3f}", f"{cpr:.3f}", f"{cmd:.3f}")
    ctx.console.print(table)
    return StageResult([out_path, curve_csv, curve_png, circuit_png], {
        "faithfulness": f, "achieved_sparsity": selection.achieved_sparsity,
        "heads_kept": int(selection.mask.sum()), "metric_full": m_full, "metric_empty": m_empty,
        "metric_circuit": m_circuit, "cpr": cpr, "cmd": cmd, "circuit_path": str(out_path)})


register_stage(Stage("preflight", ("model", "discovery", "grads", "preflight"), None,
                     "the memory preflight arrives with circuitkit.memory (issue #5)"))
register_stage(Stage("data", ("model", "discovery.task", "discovery.data_params", "seed"), _data))
register_stage(Stage("attribution", ("model", "discovery"), _attribution))
register_stage(Stage("pruning", ("pruning", "output_path"), _pruning))
register_stage(Stage("grads", ("model", "grads"), None,
                     "gradient indexing arrives with gradian (issue #6)"))
