"""The pipeline's stages: preflight -> data -> attribution -> pruning -> grads.

A stage that does not exist in this version is registered with `run=None` and a reason, so
selecting it fails before any work instead of pretending.
"""

from __future__ import annotations

from circuitkit.pipeline import RunContext, Stage, StageResult, register_stage

DATA_FILE = "data.safetensors"


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


register_stage(Stage("preflight", ("model", "discovery", "grads", "preflight"), None,
                     "the memory preflight arrives with circuitkit.memory (issue #5)"))
register_stage(Stage("data", ("model", "discovery.task", "discovery.data_params", "seed"), _data))
register_stage(Stage("attribution", ("model", "discovery"), None,
                     "EAP / EAP-IG attribution arrives with circuitkit.attribution (issue #3)"))
register_stage(Stage("pruning", ("pruning", "output_path"), None,
                     "head pruning and circuit.pt arrive with circuitkit.pruning (issue #4)"))
register_stage(Stage("grads", ("model", "grads"), None,
                     "gradient indexing arrives with gradian (issue #6)"))
