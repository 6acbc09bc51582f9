"""The pipeline's stages: preflight -> data -> attribution -> pruning -> grads.

A stage that does not exist in this version is registered with `run=None` and a reason, so
selecting it fails before any work instead of pretending.
"""

from __future__ import annotations

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


register_stage(Stage("preflight", ("model", "discovery", "grads", "preflight"), None,
                     "the memory preflight arrives with circuitkit.memory (issue #5)"))
register_stage(Stage("data", ("model", "discovery.task", "discovery.data_params", "seed"), _data))
register_stage(Stage("attribution", ("model", "discovery"), _attribution))
register_stage(Stage("pruning", ("pruning", "output_path"), None,
                     "head pruning and circuit.pt arrive with circuitkit.pruning (issue #4)"))
register_stage(Stage("grads", ("model", "grads"), None,
                     "gradient indexing arrives with gradian (issue #6)"))
