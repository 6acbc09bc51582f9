"""The circuit stages of the pipeline: data -> attribution -> pruning.

Each reads its inputs from `ctx.state` when the stage before it ran in this process, else
from that stage's artifact in the run directory (so a rerun can skip completed stages).
Each also declares the files it reads (`*_inputs`, fingerprinted by the pipeline) and a cheap
pre-run check (`_check_*`) that reads configs only.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from safetensors import safe_open

from circuitkit.core.config import ConfigError, to_dict
from circuitkit.core.errors import UserError
from circuitkit.core.io import check_writable
from circuitkit.core.pipeline import RunContext, Stage, StageResult, package_versions
from circuitkit.discovery.attribution import load_scores, run_attribution, save_scores, top_heads
from circuitkit.discovery.attribution.checks import (
    ArtifactMismatch,
    check_data_fits_model,
    check_scores_fit_model,
)
from circuitkit.discovery.attribution.eap import graph_of
from circuitkit.discovery.attribution.metrics import answer_forward
from circuitkit.discovery.circuit import Circuit, load_circuit, run_circuit_path, save_circuit, verdict_table
from circuitkit.discovery.circuit_graph import write_circuit_graph
from circuitkit.discovery.config import IG_ALGORITHMS
from circuitkit.discovery.data_lengths import (
    ATTRIBUTION_AT_DATA,
    PRUNING_AT_DATA,
    attribution_at,
    device_attribution_batch,
    pairs_lengths,
    split_sizes,
)
from circuitkit.discovery.plots import faithfulness_curve, head_heatmap
from circuitkit.discovery.pruning.heads import circuit_fields, prune
from circuitkit.discovery.pruning.memory import pruning_estimate
from circuitkit.discovery.pruning.verdict import circuit_verdict, robustness_pairs
from circuitkit.discovery.tasks import (
    SAMPLE_FILES,
    TaskData,
    TaskError,
    build_heldout_templates,
    build_task,
    corruption_of,
    heldout_template_count,
    keys_that_do_not_apply,
)
from circuitkit.discovery.tasks.corruption_sets import (
    build_corruption_set,
    check_corruptions,
    check_same_clean,
    corruption_file,
    discovery_corruptions,
    effective,
    single,
)
from circuitkit.models.loading import check_model, context_length, model_context, model_inputs

DATA_FILE = "data.safetensors"
HELDOUT_TEMPLATES_FILE = "data_heldout_templates.safetensors"  # pairs from templates attribution never saw
SCORES_FILE = "scores.safetensors"
HEATMAP_FILE = "head_scores.png"


def primary_params(cfg: Any):
    """discovery.data_params as the task builders read them: with several corruptions, the primary
    (first) one as the task's single corruption."""
    d = cfg.discovery
    names = discovery_corruptions(d.task, d.data_params)
    return single(d.task, d.data_params, names[0]) if names else effective(d.task, d.data_params)


def _data(ctx: RunContext) -> StageResult:
    """Build the task's clean/corrupted pairs: attribution examples, then held-out examples; with
    several corruptions, the same pairs under each other one beside them (`corruption_file`)."""
    d = dataclasses.replace(ctx.cfg.discovery, data_params=primary_params(ctx.cfg))
    names = discovery_corruptions(ctx.cfg.discovery.task, ctx.cfg.discovery.data_params)
    loaded = ctx.model()
    n_attr, n_eval = d.data_params.num_examples, d.data_params.eval_examples
    generated: dict = {}
    if names:
        several: dict = {}
        by = build_corruption_set(d.task, loaded.tokenizer, loaded.path, d.data_params, names, n_attr + n_eval,
                                  ctx.cfg.seed, max_tokens=context_length(loaded.model.config),
                                  pair_check=lambda pairs: answer_changed(loaded.model, pairs, d.batch_size),
                                  report=several)
        data = by[names[0]]
        if several:
            ctx.console.print(f"generated corruptions {', '.join(names)}: {several['valid_under_all']} rows valid under"
                              " every one (" + ", ".join(f"{c} {several[c]['valid_pairs']} of {several[c]['rows']}"
                                                         for c in names) + ")")
    else:
        data = build_task(d.task, loaded.tokenizer, loaded.path, d.data_params, n_attr + n_eval, ctx.cfg.seed,
                          max_tokens=context_length(loaded.model.config),
                          pair_check=lambda pairs: answer_changed(loaded.model, pairs, d.batch_size), report=generated)
    if generated:
        ctx.console.print(f"generated corruption {generated['corruption']}: {generated['valid_pairs']} valid pairs of"
                          f" {generated['rows']} rows ({generated['valid_share']:.0%}); the corruption changes the"
                          " model's greedy answer on each kept pair")
    attr, held_out = split_sizes(len(data), n_attr, n_eval)
    if (attr, held_out) != (n_attr, n_eval):
        ctx.console.print(f"[yellow]warning:[/yellow] {d.task} has {len(data)} rows, fewer than the"
                          f" {n_attr} + {n_eval} asked for: using {attr} for attribution and {held_out} held out.")
    corruption = corruption_of(d.task, d.data_params)
    task_meta = {"task": d.task, "model": ctx.cfg.model.name, **({"corruption": corruption} if corruption else {}),
                 **({"corruptions": ",".join(names)} if names else {})}
    path = data.save(ctx.run_dir / DATA_FILE, metadata={
        **task_meta, "num_examples": str(attr), "eval_examples": str(held_out)})
    ctx.state["data"], ctx.state["n_attr"] = data, attr
    files, n_templates = [path], heldout_template_count(d.task, d.data_params)
    if names:
        for other in names[1:]:
            files.append(by[other].save(corruption_file(path, other), metadata={**task_meta, "corruption": other}))
        ctx.state["by_corruption"] = by
    if n_templates:
        other = build_heldout_templates(d.task, loaded.tokenizer, d.data_params, n_templates, ctx.cfg.seed,
                                        max_tokens=context_length(loaded.model.config))
        files.append(other.save(ctx.run_dir / HELDOUT_TEMPLATES_FILE, metadata=task_meta))
        ctx.state["heldout_templates"] = other
    told = f"{', '.join(names)} corruptions" if names else f"{corruption} corruption" if corruption else ""
    ctx.console.print(f"{d.task}{f' ({told})' if told else ''}: {attr} attribution +"
                      f" {held_out} held-out pairs, {data.clean_ids.shape[1]} tokens (padded)"
                      + (f"; {n_templates} pairs from held-out templates" if n_templates else ""))
    if generated:
        meta_generated = {"generated_corruption": {k: v for k, v in generated.items() if k != "failures"}
                          | {"failures": generated["failures"][:100], "n_failures": len(generated["failures"])}}
    else:
        meta_generated = {}
    return StageResult(files, {**meta_generated, "task": d.task, "num_examples": attr, "eval_examples": held_out,
                               "seq_len": int(data.clean_ids.shape[1]), "heldout_template_examples": n_templates,
                               **({"corruption": corruption} if corruption else {}),
                               **({"corruptions": names} if names else {})})


def answer_changed(model, pairs: TaskData, batch_size: int) -> torch.Tensor:
    """(N,) bool: the model's greedy next token differs between each pair's clean and corrupted prompt."""
    device = next(model.parameters()).device
    changed = []
    with torch.no_grad():
        for batch in pairs.batches(batch_size):
            b = batch.to(device)
            clean = answer_forward(model, b.clean_ids, b.attention_mask, b.answer_pos).argmax(-1)
            corrupted = answer_forward(model, b.corrupted_ids, b.attention_mask, b.answer_pos).argmax(-1)
            changed.append((clean != corrupted).cpu())
    return torch.cat(changed)


def heldout_template_data(ctx: RunContext) -> TaskData | None:
    """Pairs from the task's held-out templates (None when discovery.data_params.heldout_template_examples
    is off for this task): from this run, or from the data stage's file in the run dir."""
    d = ctx.cfg.discovery
    if not heldout_template_count(d.task, d.data_params):
        return None
    if "heldout_templates" not in ctx.state:
        path = ctx.run_dir / HELDOUT_TEMPLATES_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run the data stage again (add 'data' to stages), or"
                                    " set discovery.data_params.heldout_template_examples=0.")
        ctx.state["heldout_templates"] = TaskData.load(path)
    return ctx.state["heldout_templates"]


def task_data(ctx: RunContext):
    """(pairs, number used for attribution): from this run, or from data.safetensors in the run dir.

    The pairs after the first `number` are the held-out ones. A file read from the run dir is
    checked against the model (vocabulary, context) before use.
    """
    if "data" not in ctx.state:
        path = ctx.run_dir / DATA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run the data stage first (add 'data' to stages).")
        data, n_attr = _read_task_data(path)
        config = ctx.model().model.config
        check_data_fits_model(data, getattr(getattr(config, "text_config", None) or config, "vocab_size", None),
                              context_length(config), path, ctx.cfg.model.name)
        ctx.state["data"], ctx.state["n_attr"] = data, n_attr
    return ctx.state["data"], ctx.state["n_attr"]


def corruption_pairs(ctx: RunContext) -> dict[str, TaskData]:
    """{corruption: its pairs (attribution, then held-out)}, primary first, when discovery uses
    several corruptions (data_params.corruptions); {} otherwise."""
    d = ctx.cfg.discovery
    names = discovery_corruptions(d.task, d.data_params)
    if not names:
        return {}
    if "by_corruption" not in ctx.state:
        primary, _ = task_data(ctx)
        by = {names[0]: primary}
        for other in names[1:]:
            path = corruption_file(ctx.run_dir / DATA_FILE, other)
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist: run the data stage again (add 'data' to stages).")
            pairs, _ = _read_task_data(path)
            try:
                check_same_clean(primary, pairs, other)
            except TaskError as err:
                raise ArtifactMismatch(f"{path}: {err}") from None
            by[other] = pairs
        ctx.state["by_corruption"] = by
    return ctx.state["by_corruption"]


def _read_task_data(path: Path) -> tuple[TaskData, int]:
    """data.safetensors -> (pairs, attribution count); one line naming the file if it is not one."""
    fix = "it is truncated, corrupted or not written by the data stage: rerun the data stage."
    try:
        data = TaskData.load(path)
        with safe_open(str(path), framework="pt") as fh:
            n_attr = int((fh.metadata() or {})["num_examples"])
    except KeyError as err:
        raise ArtifactMismatch(f"{path} is not CircuitKit task data (missing {err}); {fix}") from None
    except Exception as err:  # noqa: BLE001 - header, EOF and format errors all mean "not readable"
        if isinstance(err, OSError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise ArtifactMismatch(f"{path} cannot be read as task data ({reason}); {fix}") from None
    n = len(data)
    shapes = {f: tuple(getattr(data, f).shape) for f in ("clean_ids", "corrupted_ids", "attention_mask")}
    if len(set(shapes.values())) != 1 or any(len(getattr(data, f)) != n for f in ("answer_pos", "correct",
                                                                                  "incorrect")):
        raise ArtifactMismatch(f"{path}: its tensors disagree in shape ({shapes}); {fix}")
    if not 1 <= n_attr <= n:
        raise ArtifactMismatch(f"{path}: num_examples={n_attr} but the file holds {n} pairs; {fix}")
    return data, n_attr


def _attribution(ctx: RunContext) -> StageResult:
    """EAP / EAP-IG / exact scores on the attribution examples; scores.safetensors + heatmap."""
    d = ctx.cfg.discovery
    loaded = ctx.model()
    pairs, n_attr = task_data(ctx)
    data = pairs[:n_attr]
    meta = {"model": ctx.cfg.model.name, "task": d.task, "prepend_bos": str(d.data_params.prepend_bos).lower()}
    # at the batches it runs: pairs grouped by length, each cut to its longest (data_lengths)
    lengths = pairs_lengths(data.lengths(), int(data.clean_ids.shape[1]))
    batch_size, batch_note = device_attribution_batch(ctx.cfg, lengths, loaded.device)
    if batch_size != d.batch_size:
        ctx.console.print(f"attribution: {batch_note}")
        d = dataclasses.replace(d, batch_size=batch_size)
    estimate = attribution_at(ctx.cfg, lengths, batch_size).total_bytes
    shard_files, shard_summary = [], {}
    if d.num_shards > 1:  # this job's sums; the last shard to finish merges (circuitkit.discovery.attribution.shards)
        from circuitkit.discovery.attribution.shards import run_attribution_shard

        outcome = run_attribution_shard(ctx, data, ctx.run_dir / DATA_FILE)
        shard_files = [outcome.partial_path]
        shard_summary = {"shard_index": d.shard_index, "num_shards": d.num_shards,
                         "example_range": list(outcome.example_range), "shard_dir": str(outcome.shard_dir),
                         "merged": outcome.merged is not None, "shards": outcome.shards}
        if outcome.merged is None:
            (ctx.run_dir / SCORES_FILE).unlink(missing_ok=True)  # an earlier merge's scores are stale now
            return StageResult(shard_files, {**shard_summary, "n_examples": outcome.example_range[1]
                                             - outcome.example_range[0], "waiting_for": outcome.missing},
                               estimated_peak_bytes=estimate)
        scores = outcome.merged
        save_scores(outcome.shard_dir / SCORES_FILE, scores, meta)
    elif corruption_pairs(ctx):
        from circuitkit.discovery.attribution.corruptions import run_corruptions

        scores = run_corruptions(loaded.adapter, {c: p[:n_attr] for c, p in corruption_pairs(ctx).items()}, d)
        meta["corruptions"] = ",".join(scores.by_corruption)
    else:
        scores = run_attribution(loaded.adapter, data, d)
    ctx.state["scores"] = scores
    path = save_scores(ctx.run_dir / SCORES_FILE, scores, meta)
    steps = "" if d.algorithm not in IG_ALGORITHMS else f", ig_steps={scores.info['ig_steps']}, ig_rule={scores.info['ig_rule']}"
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
    if scores.by_corruption:
        ctx.console.print(f"corruptions {', '.join(scores.by_corruption)} combined by discovery.corruption_scores="
                          f"{d.corruption_scores}; corrupted metric per corruption: "
                          + ", ".join(f"{c} {s.metric_corrupted:.4g}" for c, s in scores.by_corruption.items()))
    summary = {"algorithm": d.algorithm, "level": d.level, "metric": d.metric, "n_examples": len(data),
               "metric_clean": scores.metric_clean, "metric_corrupted": scores.metric_corrupted,
               "embed_score": float(scores.embed), "top_head": f"L{best[0][0]}H{best[0][1]}",
               "top_head_score": best[0][2], "batch_size": batch_size, "batch": batch_note, **shard_summary}
    if d.algorithm in IG_ALGORITHMS:
        summary.update(ig_steps=scores.info["ig_steps"], ig_rule=scores.info["ig_rule"])
    if "passes" in scores.info:
        summary["passes_per_batch"] = scores.info["passes"]
    if scores.edges is not None:
        summary["n_edges"] = scores.graph.n_edges
    if scores.by_corruption:
        summary.update(corruptions=list(scores.by_corruption), corruption_scores=d.corruption_scores,
                       metric_corrupted_by_corruption={c: s.metric_corrupted for c, s in scores.by_corruption.items()})
    return StageResult([*shard_files, path, plot], summary, estimated_peak_bytes=estimate)


def attribution_scores(ctx: RunContext):
    """The attribution stage's scores: from this run, or from scores.safetensors in the run dir."""
    if "scores" not in ctx.state:
        path = ctx.run_dir / SCORES_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: pruning needs attribution scores; add 'attribution'"
                                    " to stages (e.g. stages=[data,attribution,pruning]).")
        ctx.state["scores"] = load_scores(path)
        ctx.state["scores_loaded"] = True
    return ctx.state["scores"]


def _write_curve(ctx: RunContext, curve: list[dict], title: str) -> list[Path]:
    path = ctx.run_dir / "faithfulness_curve.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    return [path, faithfulness_curve(curve, ctx.run_dir / "faithfulness_curve.png", title)]


def _pruning(ctx: RunContext) -> StageResult:
    """Remove the lowest-ranked heads (or edges), measure faithfulness on held-out pairs, write circuit.pt."""
    p, d = ctx.cfg.pruning, ctx.cfg.discovery
    if d.num_shards > 1 and "scores" not in ctx.state and not (ctx.run_dir / SCORES_FILE).is_file():
        ctx.console.print("pruning: this attribution shard did not merge (other shards still running);"
                          " the last shard to finish prunes the merged scores.")
        return StageResult([], {"status": "skipped", "reason": "waiting for the other attribution shards"})
    scores = attribution_scores(ctx)
    adapter = ctx.model().adapter
    check_scores_fit_model(scores, graph_of(adapter), ctx.run_dir / SCORES_FILE if "scores_loaded" in ctx.state
                           else "the attribution scores", ctx.cfg.model.name)
    if p.scope == "edges" and scores.edges is None:
        raise ValueError("pruning.scope=edges needs edge scores, but attribution ran at node level:"
                         " set discovery.level=edge (or pruning.scope=heads).")
    data, n_attr = task_data(ctx)
    held_out = data[n_attr:]
    if len(held_out) == 0:
        raise ValueError("no held-out examples for faithfulness: set discovery.data_params.eval_examples >= 1.")

    heldout = heldout_template_data(ctx)
    estimate = pruning_estimate(ctx.cfg, batch_size=min(d.batch_size, len(held_out)), seq_len=int(data.clean_ids.shape[1]),
                                n_eval=len(held_out), n_attr=n_attr, n_templates=len(heldout or ()),
                                templates_seq_len=int(heldout.clean_ids.shape[1]) if heldout else None,
                                weights_loaded=True).total_bytes
    several = {c: pairs[n_attr:] for c, pairs in corruption_pairs(ctx).items()}
    found = prune(adapter, scores, data[:n_attr], held_out, p, d.metric, d.batch_size, heldout=heldout,
                  corruptions=several, corruption_faithfulness=d.corruption_faithfulness,
                  corruption_attr={c: pairs[:n_attr] for c, pairs in corruption_pairs(ctx).items()})
    loaded = ctx.model()
    pairs = robustness_pairs(d.task, primary_params(ctx.cfg), loaded.tokenizer, loaded.path, n_attr, len(data),
                             ctx.cfg.seed, context_length(loaded.model.config), skip=tuple(several))
    verdict, verdict_wall_s = circuit_verdict(adapter, found, p, d.metric, d.task, held_out, data[:n_attr],
                                              d.batch_size, ctx.cfg.seed, pairs, heldout)
    other = found.extra.get("heldout_templates")
    corruption = corruption_of(d.task, primary_params(ctx.cfg))
    joint = found.extra.get("corruptions")
    kept, head_mask, achieved = found.selection.mask, found.head_mask, found.selection.achieved_sparsity
    m_full, m_empty, m_circuit, f = (found.metrics[k] for k in ("full", "empty", "circuit", "faithfulness"))
    curve, cpr, cmd = found.curve, found.cpr, found.cmd
    curve_files = _write_curve(ctx, curve, f"{d.task}, {p.scope}: CPR {cpr:.3f}, CMD {cmd:.3f}")
    circuit_png = head_heatmap(scores.head, ctx.run_dir / "circuit_heads.png",
                               f"kept heads (outlined), {p.scope} sparsity {achieved:.2f}", head_mask)
    out_path = run_circuit_path(ctx.cfg.output_path, ctx.run_dir)
    g = scores.graph
    save_circuit(out_path, Circuit(**{
        **found.ablation_values,
        "graph": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                  "parallel_residual": g.parallel_residual},
        "mlp_mask": found.mlp_mask, "prepend_bos": d.data_params.prepend_bos,
        "d_model": adapter.d_model,  # for exports whose format states it (EAP-IG's cfg)
        "model_name": ctx.cfg.model.name, "model_revision": ctx.cfg.model.revision, "scope": p.scope,
        "head_mask": head_mask, "head_scores": scores.head, "mlp_scores": scores.mlp,
        "embed_score": scores.embed, "edge_scores": scores.edges,
        "ablation": p.ablation, "rank_by": p.rank_by, "target_sparsity": p.target_sparsity,
        "achieved_sparsity": achieved, "n_removed": found.selection.n_removed,
        "n_heads_removed": int((~head_mask).sum()), "metrics": found.metrics, "curve": curve, "cpr": cpr, "cmd": cmd, "n_eval_examples": len(held_out),
        **circuit_fields(found), "task": d.task, "corruption": corruption,
        "config": to_dict(ctx.cfg), "versions": package_versions(), "verdict": verdict,
    }))
    unit = "heads" if p.scope == "heads" else "edges"
    told = (f"{', '.join(joint['names'])} corruptions, {joint['rule']} faithfulness" if joint
            else f"{corruption} corruption" if corruption else "")
    table = Table(title=f"circuit: {int(kept.sum())} of {found.n_total} {unit} kept"
                  + (f" ({d.task}, {told})" if told else ""))
    for col in ("pairs", "target sparsity", "achieved", "m(full)", "m(empty)", "m(circuit)", "faithfulness",
                "CPR", "CMD"):
        table.add_column(col, justify="right")
    table.add_row(f"same templates ({len(held_out)})", f"{p.target_sparsity:.3f}", f"{achieved:.3f}", f"{m_full:.4g}",
                  f"{m_empty:.4g}", f"{m_circuit:.4g}", f"{f:.3f}", f"{cpr:.3f}", f"{cmd:.3f}")
    for name, each in (joint or {}).get("by_corruption", {}).items():
        table.add_row(f"  under {name}", "", "", f"{each['full']:.4g}", f"{each['empty']:.4g}",
                      f"{each['circuit']:.4g}", f"{each['faithfulness']:.3f}", "-", "-")
    if other:
        table.add_row(f"held-out templates ({other['n_examples']})", "", "", f"{other['full']:.4g}",
                      f"{other['empty']:.4g}", f"{other['circuit']:.4g}", f"{other['faithfulness']:.3f}", "-", "-")
    ctx.console.print(table)
    if found.extra.get("mib"):
        ctx.console.print(f"MIB's pair: CPR {found.extra['mib']['cpr']:.3f} (edges ranked by signed score),"
                          f" CMD {found.extra['mib']['cmd']:.3f} (ranked by |score|)")
    stable = found.extra.get("stability")
    if stable:
        ctx.console.print(f"stability: Jaccard of the kept set {stable['jaccard_mean']:.3f} (5th percentile"
                          f" {stable['jaccard_p5']:.3f}) over {stable['n_resamples']} resamples of the examples")
    ctx.console.print(verdict_table(verdict))
    graph_files = []
    if p.graph:
        graph_files = write_circuit_graph(load_circuit(out_path), ctx.run_dir / "circuit_graph.png",
                                          p.graph_top_edges, p.graph_backend)
    return StageResult([out_path, *curve_files, circuit_png, *graph_files], {
        "faithfulness": f, "achieved_sparsity": achieved, "scope": p.scope,
        "heads_kept": int(head_mask.sum()), f"{unit}_kept": int(kept.sum()), "metric_full": m_full,
        "metric_empty": m_empty, "metric_circuit": m_circuit, "cpr": cpr, "cmd": cmd, "circuit_path": str(out_path),
        "selection": found.extra.get("selection"), "curve_definition": found.extra.get("curve_definition"),
        **({"mib_cpr": found.extra["mib"]["cpr"], "mib_cmd": found.extra["mib"]["cmd"]}  # MIB's pair
           if found.extra.get("mib") else {}),
        **({"corruption": corruption} if corruption else {}),
        **({"corruptions": joint["names"], "corruption_faithfulness": joint["rule"],
            "faithfulness_by_corruption": {c: b["faithfulness"] for c, b in joint["by_corruption"].items()}}
           if joint else {}),
        **({"faithfulness_heldout_templates": other["faithfulness"], "heldout_templates": other} if other else {}),
        **({"stability_jaccard_mean": stable["jaccard_mean"], "stability_jaccard_p5": stable["jaccard_p5"],
            "stability_resamples": stable["n_resamples"]} if stable else {}),
        "verdict": {row["pillar"]: row["value"] for row in verdict["rows"]}, "verdict_wall_s": verdict_wall_s["total"]},
        estimated_peak_bytes=estimate)


# --------------------------------------------------------------------------- inputs

def task_data_file(cfg: Any) -> Path | None:
    """The file (or directory) a file-based discovery task reads; None for generated tasks."""
    d = cfg.discovery
    if d.task not in SAMPLE_FILES:
        return None
    return Path(d.data_params.data_path).expanduser() if d.data_params.data_path else SAMPLE_FILES[d.task]


def _data_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    data_file = task_data_file(cfg)
    return {**model_inputs(cfg.model), **({"discovery.data_params.data_path": data_file} if data_file else {})}


def _corruption_inputs(cfg: Any, run_dir: Path) -> dict[str, Path]:
    names = discovery_corruptions(cfg.discovery.task, cfg.discovery.data_params)
    return {corruption_file(Path(DATA_FILE), c).name: corruption_file(run_dir / DATA_FILE, c) for c in names[1:]}


def _attribution_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    return {**model_inputs(cfg.model), DATA_FILE: run_dir / DATA_FILE, **_corruption_inputs(cfg, run_dir)}


def _pruning_inputs(cfg: Any, run_dir: Path) -> dict[str, Path | str]:
    try:
        n_templates = heldout_template_count(cfg.discovery.task, cfg.discovery.data_params)
    except TaskError:  # reported by the data stage's check
        n_templates = 0
    return {**model_inputs(cfg.model), DATA_FILE: run_dir / DATA_FILE, SCORES_FILE: run_dir / SCORES_FILE,
            **_corruption_inputs(cfg, run_dir),
            **({HELDOUT_TEMPLATES_FILE: run_dir / HELDOUT_TEMPLATES_FILE} if n_templates else {})}


# --------------------------------------------------------------------------- pre-run checks

def _check_input_file(path: Path, key: str, allow_dir: bool = False) -> None:
    if not path.exists():
        raise UserError(f"{key}={str(path)!r} does not exist (resolved to {path.resolve()}); give the path"
                        " of your data file.", 2)
    if path.is_dir() and not allow_dir:
        raise UserError(f"{key}={str(path)!r} is a directory, but a file is expected: give the data file's path.", 2)


def _check_data(cfg: Any) -> None:
    """The model reference, the task's data file, and synthetic lengths within the context."""
    check_model(cfg.model)
    d = cfg.discovery
    try:
        heldout_template_count(d.task, d.data_params)
    except TaskError as err:
        raise ConfigError(str(err)) from None
    several = check_corruptions(d.task, d.data_params, d.num_shards, cfg.pruning.scope)
    if several:
        raise ConfigError(several)
    unread = keys_that_do_not_apply(d.task, d.data_params)
    if unread:
        raise ConfigError(f"{unread[0]} does not apply to discovery.task={d.task}"
                          f"{f' (nor {len(unread) - 1} more key(s))' if len(unread) > 1 else ''}: remove it, or choose"
                          " the task it is for.")
    data_file = task_data_file(cfg)
    if data_file is not None and d.data_params.data_path:
        _check_input_file(data_file, "discovery.data_params.data_path", allow_dir=d.task == "mmlu")
    if d.task == "induction":
        limit = model_context(cfg.model)
        if limit is not None and d.data_params.seq_len > limit:
            raise ConfigError(f"Config key 'discovery.data_params.seq_len' = {d.data_params.seq_len} exceeds the"
                              f" context of {cfg.model.name} ({limit} tokens); set it to at most {limit}.")


def _check_attribution(cfg: Any) -> None:
    check_model(cfg.model)


def _check_pruning(cfg: Any) -> None:
    """Edge pruning needs edge scores; output_path must be writable (checked before attribution)."""
    if cfg.pruning.scope == "edges" and cfg.discovery.level == "node" and "attribution" in cfg.stages:
        raise ConfigError("pruning.scope=edges needs edge scores, but discovery.level=node: set"
                          " discovery.level=edge (or pruning.scope=heads).")
    if cfg.output_path:
        check_writable(Path(cfg.output_path), "output_path")


CIRCUIT_STAGES = (
    Stage("data", ("model", "discovery.task", "discovery.data_params", "seed"), _data, inputs=_data_inputs,
          check=_check_data),
    Stage("attribution", ("model", "discovery"), _attribution, inputs=_attribution_inputs,
          check=_check_attribution, memory=ATTRIBUTION_AT_DATA),
    Stage("pruning", ("pruning", "output_path"), _pruning, inputs=_pruning_inputs, check=_check_pruning,
          memory=PRUNING_AT_DATA),
)
