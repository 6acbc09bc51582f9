"""The pipeline's attribute stage (after grads): `gradian attribute` on this run's index.

    reads   the index the grads stage wrote (grads.index_dir, or <run dir>/index), attribute.eval_path,
            the tuned model (model.name with model.adapter) and its base model (model.name without the
            adapter, or model.base_name for a full fine-tune), the index's training data
    writes  <run dir>/attribute.json, `gradian.attribute.result`'s format (what `--out` writes)

Everything it reads is a fingerprinted input (the index through its manifest, which records every
shard's and the curvature file's sha256), so a changed eval set, index, training data or model reruns
it; a rerun first removes the old result, so a failed rerun leaves no result of other inputs behind.
`--verify`'s retraining is the command's only (it needs the fine-tune's trainer settings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from circuitkit.core.pipeline import RunContext, Stage, StageResult
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import check_model, model_inputs
from gradian.build.checks import check_input_file
from gradian.stage import grads_data_file, run_index_dir

RESULT_FILE = "attribute.json"


def _base_model(cfg: Any) -> str | None:
    """The base model to name explicitly: model.base_name for a full fine-tune; None for a LoRA tune
    (the index's model without its adapter)."""
    return cfg.model.base_name if not cfg.model.adapter else None


def _summary(result, path: Path) -> dict[str, Any]:
    """The manifest's headline numbers of one result (flat values, for sweep summaries)."""
    r = result.regression
    top = max(result.clusters or [], key=lambda c: c["share"], default=None)
    low = [a["engine"] for a in result.agreement if a["low_confidence"]]
    return {"result": str(path), "attributed": result.attributed, "reason": result.reason,
            "n_items": r["n_items"], "accuracy_drop": r["accuracy_drop"], "accuracy_ci_low": r["accuracy_ci"][0],
            "accuracy_ci_high": r["accuracy_ci"][1], "logprob_drop": r["logprob_drop"], "flipped": len(r["flipped"]),
            "query_loss": result.query["query_loss"], "engines": ",".join(result.engines),
            "accused": len(result.accused), "clusters": len(result.clusters or []),
            "top_cluster_share": top["share"] if top else None, "low_confidence_engines": ",".join(low) or None,
            "eval_sha256": result.eval_sha256}


def _attribute(ctx: RunContext) -> StageResult:
    """Measure the regression on attribute.eval_path and accuse the index's rows that caused it."""
    from gradian.attribute.command import print_result
    from gradian.attribute.run import attribute

    cfg, a = ctx.cfg, ctx.cfg.attribute
    out = ctx.run_dir / RESULT_FILE
    out.unlink(missing_ok=True)  # a result of other inputs must not outlive a rerun that fails
    index_dir = run_index_dir(cfg, ctx.run_dir)
    if not (index_dir / "manifest.json").is_file():
        raise UserError(f"the attribute stage reads the gradient index of this run ({index_dir}), which does not"
                        " exist: run the grads stage first (stages=[...,grads,attribute]) or set grads.index_dir to"
                        " an index made before.", exit_code=1)
    ctx.release_model()  # attribute loads the tuned and the base model itself, one view at a time
    result = attribute(index_dir, Path(a.eval_path).expanduser(), base_model=_base_model(cfg),
                       adapter=cfg.model.adapter, top_k=a.top_k, query_loss=a.query_loss, engines=list(a.engines),
                       out_path=out, seed=cfg.seed, resamples=a.bootstrap, thin_margin=a.thin_margin,
                       span_min_tokens=a.span_min_tokens, console=ctx.console, precision=a.precision,
                       checkpoints=a.checkpoints, checkpoint_lrs=a.checkpoint_lrs)
    print_result(result, ctx.console)
    return StageResult([out], _summary(result, out))


def _attribute_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    if cfg.attribute.eval_path is None:
        return {}
    inputs: dict[str, Path | str] = {**model_inputs(cfg.model),
                                     "attribute.eval_path": Path(cfg.attribute.eval_path).expanduser(),
                                     "index": run_index_dir(cfg, run_dir) / "manifest.json"}
    base = _base_model(cfg)
    if base is not None:
        inputs["model.base_name"] = model_inputs(ModelConfig(name=base))["model"]
    data = grads_data_file(cfg)
    if data.is_file():  # the accused rows' texts, clusters and diagnose findings come from it
        inputs["grads.data_path"] = data
    for i, path in enumerate(_checkpoint_paths(cfg)):  # the tracin engines' adapters and trainer_state.json
        inputs[f"attribute.checkpoints[{i}]"] = path
    return inputs


def _checkpoint_paths(cfg: Any) -> list[Path]:
    spec = cfg.attribute.checkpoints
    return [] if spec is None else [Path(p.strip()).expanduser() for p in spec.split(",") if p.strip()]


def _check_attribute(cfg: Any) -> None:
    """Configs and files only: the model and its base resolve, the eval set is a readable file.
    (That the stage is listed with an eval set, a base model and an index is the config's rule.)"""
    if cfg.attribute.eval_path is None:
        return
    check_model(cfg.model)
    check_input_file(Path(cfg.attribute.eval_path).expanduser(), "attribute.eval_path")
    a = cfg.attribute
    tracin = [e for e in a.engines if e in ("tracin", "tracin-dot")]
    if a.checkpoints is None and (tracin or a.checkpoint_lrs is not None):
        what = f"attribute.engines lists {tracin[0]}" if tracin else "attribute.checkpoint_lrs is set"
        raise UserError(f"{what}, which reads the fine-tune's checkpoints: set attribute.checkpoints to its Trainer"
                        " output directory (or a comma list of adapter directories).", exit_code=2)
    if a.checkpoints is not None and not tracin:
        raise UserError(f"attribute.checkpoints is read by the tracin engines, and attribute.engines={list(a.engines)}"
                        " lists none: add one, e.g. attribute.engines=[tracin,auto].", exit_code=2)
    missing = [str(p) for p in _checkpoint_paths(cfg) if not p.is_dir()]
    if missing:
        raise UserError(f"attribute.checkpoints: {missing[0]} is not a directory; give the fine-tune's Trainer output"
                        " directory or adapter directories.", exit_code=2)


ATTRIBUTE_STAGE = Stage("attribute", ("model", "grads", "attribute", "seed"), _attribute, inputs=_attribute_inputs,
                        check=_check_attribute)
