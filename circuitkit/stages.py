"""The pipeline's stages: preflight -> data -> attribution -> pruning -> grads.

Each reads its inputs from `ctx.state` when the stage before it ran in this process, else
from that stage's artifact in the run directory (so a rerun can skip completed stages).
Each also declares the files it reads (`*_inputs`, fingerprinted by the pipeline) and a cheap
pre-run check (`_check_*`) that reads configs only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.table import Table

from circuitkit.config import AppConfig, ConfigError
from circuitkit.errors import UserError
from circuitkit.io import check_writable
from circuitkit.pipeline import RunContext, Stage, StageResult, register_stage
from gradian.indexer import check_grads_config

DATA_FILE = "data.safetensors"
SCORES_FILE = "scores.safetensors"
HEATMAP_FILE = "head_scores.png"


def split_sizes(n_rows: int, n_attr: int, n_eval: int) -> tuple[int, int]:
    """Attribution / held-out counts: as configured, or in the same ratio when a data file has
    fewer rows than asked for (at least one of each)."""
    if n_rows >= n_attr + n_eval:
        return n_attr, n_eval
    if n_rows < 2:
        raise ValueError(f"the task yielded {n_rows} example(s); attribution and faithfulness need at least 2.")
    attr = min(n_rows - 1, max(1, round(n_rows * n_attr / (n_attr + n_eval))))
    return attr, n_rows - attr


def _data(ctx: RunContext) -> StageResult:
    """Build the task's clean/corrupted pairs: attribution examples, then held-out examples."""
    from circuitkit.tasks import build_task

    d = ctx.cfg.discovery
    loaded = ctx.model()
    n_attr, n_eval = d.data_params.num_examples, d.data_params.eval_examples
    from circuitkit.models.loading import context_length

    data = build_task(d.task, loaded.tokenizer, loaded.path, d.data_params, n_attr + n_eval, ctx.cfg.seed,
                      max_tokens=context_length(loaded.model.config))
    attr, held_out = split_sizes(len(data), n_attr, n_eval)
    if (attr, held_out) != (n_attr, n_eval):
        ctx.console.print(f"[yellow]warning:[/yellow] {d.task} has {len(data)} rows, fewer than the"
                          f" {n_attr} + {n_eval} asked for: using {attr} for attribution and {held_out} held out.")
    path = data.save(ctx.run_dir / DATA_FILE, metadata={
        "task": d.task, "num_examples": str(attr), "eval_examples": str(held_out), "model": ctx.cfg.model.name})
    ctx.state["data"], ctx.state["n_attr"] = data, attr
    ctx.console.print(f"{d.task}: {attr} attribution + {held_out} held-out pairs,"
                      f" {data.clean_ids.shape[1]} tokens (padded)")
    return StageResult([path], {"task": d.task, "num_examples": attr, "eval_examples": held_out,
                                "seq_len": int(data.clean_ids.shape[1])})


def task_data(ctx: RunContext):
    """(pairs, number used for attribution): from this run, or from data.safetensors in the run dir.

    The pairs after the first `number` are the held-out ones.
    """
    from safetensors import safe_open

    from circuitkit.tasks import TaskData

    if "data" not in ctx.state:
        path = ctx.run_dir / DATA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run the data stage first (add 'data' to stages).")
        ctx.state["data"] = TaskData.load(path)
        with safe_open(str(path), framework="pt") as fh:
            ctx.state["n_attr"] = int(fh.metadata()["num_examples"])
    return ctx.state["data"], ctx.state["n_attr"]


def _preflight(ctx: RunContext) -> StageResult:
    """Estimate the peak of the selected stages from the model's shape; stop if one cannot fit."""
    from circuitkit.device import free_memory_bytes
    from circuitkit.preflight import check, memory_plot, summary, table

    estimates = check(ctx.cfg, ctx.console)
    free = free_memory_bytes()
    budget = int(ctx.cfg.preflight.headroom * free)
    plots = []
    for stage, estimate in estimates.items():
        ctx.console.print(table(estimate, free, ctx.cfg.preflight.headroom, f"estimated {stage} peak"))
        plots.append(memory_plot(estimate, ctx.run_dir / f"memory_estimate_{stage}.png", budget))
    if not estimates:
        ctx.console.print("no stage with a memory estimate selected (attribution, grads)")
    out = summary(estimates, free, budget)
    if ctx.cfg.model.device_map is not None:
        from circuitkit.models.placement import per_device_estimates

        out["per_device_bytes"] = {stage: {dev: e.total_bytes for dev, e in per_device_estimates(ctx.cfg.model, est).items()}
                                   for stage, est in estimates.items()}
    return StageResult(plots, out)


def _attribution(ctx: RunContext) -> StageResult:
    """EAP / EAP-IG / exact scores on the attribution examples; scores.safetensors + heatmap."""
    from circuitkit.attribution import run_attribution, save_scores, top_heads
    from circuitkit.plots import head_heatmap

    d = ctx.cfg.discovery
    loaded = ctx.model()
    pairs, n_attr = task_data(ctx)
    data = pairs[:n_attr]
    meta = {"model": ctx.cfg.model.name, "task": d.task, "prepend_bos": str(d.data_params.prepend_bos).lower()}
    from circuitkit.preflight import attribution_estimate

    estimate = attribution_estimate(ctx.cfg, batch_size=min(d.batch_size, len(data)),
                                    seq_len=int(data.clean_ids.shape[1])).total_bytes
    shard_files, shard_summary = [], {}
    if d.num_shards > 1:  # this job's sums; the last shard to finish merges (circuitkit.attribution.shards)
        from circuitkit.attribution.shards import run_attribution_shard

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
    else:
        scores = run_attribution(loaded.adapter, data, d)
    ctx.state["scores"] = scores
    path = save_scores(ctx.run_dir / SCORES_FILE, scores, meta)
    steps = "" if d.algorithm != "eap-ig" else f", ig_steps={scores.info['ig_steps']}, ig_rule={scores.info['ig_rule']}"
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
               "top_head_score": best[0][2], **shard_summary}
    if d.algorithm == "eap-ig":
        summary.update(ig_steps=scores.info["ig_steps"], ig_rule=scores.info["ig_rule"])
    if scores.edges is not None:
        summary["n_edges"] = scores.graph.n_edges
    return StageResult([*shard_files, path, plot], summary, estimated_peak_bytes=estimate)


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


def _write_curve(ctx: RunContext, curve: list[dict], title: str) -> list[Path]:
    import csv

    from circuitkit.plots import faithfulness_curve

    path = ctx.run_dir / "faithfulness_curve.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    return [path, faithfulness_curve(curve, ctx.run_dir / "faithfulness_curve.png", title)]


def _pruning(ctx: RunContext) -> StageResult:
    """Remove the lowest-ranked heads (or edges), measure faithfulness on held-out pairs, write circuit.pt."""
    from circuitkit.circuit import save_circuit
    from circuitkit.config import to_dict
    from circuitkit.pipeline import package_versions
    from circuitkit.plots import head_heatmap
    from circuitkit.pruning import (
        Evaluator,
        curve_areas,
        faithfulness,
        keep_top,
        mean_z,
        select_heads,
        sparsity_curve,
    )

    p, d = ctx.cfg.pruning, ctx.cfg.discovery
    if d.num_shards > 1 and "scores" not in ctx.state and not (ctx.run_dir / SCORES_FILE).is_file():
        ctx.console.print("pruning: this attribution shard did not merge (other shards still running);"
                          " the last shard to finish prunes the merged scores.")
        return StageResult([], {"status": "skipped", "reason": "waiting for the other attribution shards"})
    scores = attribution_scores(ctx)
    if p.scope == "edges" and scores.edges is None:
        raise ValueError("pruning.scope=edges needs edge scores, but attribution ran at node level:"
                         " set discovery.level=edge (or pruning.scope=heads).")
    adapter = ctx.model().adapter
    data, n_attr = task_data(ctx)
    held_out = data[n_attr:]
    if len(held_out) == 0:
        raise ValueError("no held-out examples for faithfulness: set discovery.data_params.eval_examples >= 1.")

    circuit: dict = {}
    if p.scope == "heads":
        means = mean_z(adapter, data[:n_attr], d.batch_size) if p.ablation == "mean" else None
        evaluator = Evaluator(adapter, held_out, d.metric, p.ablation, means, d.batch_size)

        def evaluate_kept(kept):
            return evaluator(~kept)
        selection = select_heads(scores.head, p.target_sparsity, p.rank_by)
        kept, valid, ranked = selection.mask, None, scores.head
        head_mask, achieved, n_removed = selection.mask, selection.achieved_sparsity, selection.n_removed
        circuit["mean_z"] = means
    else:
        from circuitkit.pruning_edges import EdgeEvaluator, mean_writes

        means = mean_writes(adapter, data[:n_attr], d.batch_size) if p.ablation == "mean" else None
        evaluate_kept = EdgeEvaluator(adapter, held_out, d.metric, p.ablation, means, d.batch_size)
        valid, ranked = scores.graph.edge_mask(), scores.edges
        n_total = int(valid.sum())
        n_removed = round(p.target_sparsity * n_total)
        kept = keep_top(scores.edges, n_total - n_removed, p.rank_by, valid)
        achieved = n_removed / n_total
        g = scores.graph
        head_mask = torch.tensor([[bool(kept[g.head_index(layer, h)].any()) for h in range(g.n_heads)]
                                  for layer in range(g.n_layers)])
        circuit.update(edge_mask=kept, mean_z=None, upstream_nodes=g.upstream, downstream_nodes=g.downstream)
    m_full = evaluate_kept(torch.ones_like(kept) if valid is None else valid)
    m_empty = evaluate_kept(torch.zeros_like(kept))
    m_circuit = evaluate_kept(kept)
    f = faithfulness(m_circuit, m_full, m_empty)
    curve = sparsity_curve(evaluate_kept, ranked, p.rank_by, m_full, m_empty, valid)
    cpr, cmd = curve_areas(curve)
    curve_files = _write_curve(ctx, curve, f"{d.task}, {p.scope}: CPR {cpr:.3f}, CMD {cmd:.3f}")
    circuit_png = head_heatmap(scores.head, ctx.run_dir / "circuit_heads.png",
                               f"kept heads (outlined), {p.scope} sparsity {achieved:.2f}", head_mask)
    metrics = {"full": m_full, "empty": m_empty, "circuit": m_circuit, "faithfulness": f}
    out_path = Path(ctx.cfg.output_path) if ctx.cfg.output_path else ctx.run_dir / "circuit.pt"
    g = scores.graph
    circuit["graph"] = {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                        "parallel_residual": g.parallel_residual}
    if p.scope == "heads":
        circuit["mlp_mask"] = torch.ones(g.n_layers, dtype=torch.bool)  # head pruning never removes an MLP
    else:
        circuit["mlp_mask"] = kept[[g.mlp_index(layer) for layer in range(g.n_layers)]].any(dim=1)
    circuit["prepend_bos"] = d.data_params.prepend_bos
    circuit["d_model"] = adapter.d_model  # for exports whose format states it (EAP-IG's cfg)
    save_circuit(out_path, {
        **circuit, "model_name": ctx.cfg.model.name, "model_revision": ctx.cfg.model.revision, "scope": p.scope,
        "head_mask": head_mask, "head_scores": scores.head, "mlp_scores": scores.mlp,
        "embed_score": scores.embed, "edge_scores": scores.edges,
        "ablation": p.ablation, "rank_by": p.rank_by, "target_sparsity": p.target_sparsity,
        "achieved_sparsity": achieved, "n_removed": n_removed, "n_heads_removed": int((~head_mask).sum()),
        "metrics": metrics, "curve": curve, "cpr": cpr, "cmd": cmd, "n_eval_examples": len(held_out),
        "config": to_dict(ctx.cfg), "versions": package_versions(),
    })
    unit = "heads" if p.scope == "heads" else "edges"
    table = Table(title=f"circuit: {int(kept.sum())} of {kept.numel() if valid is None else int(valid.sum())} {unit} kept")
    for col in ("target sparsity", "achieved", "m(full)", "m(empty)", "m(circuit)", "faithfulness", "CPR", "CMD"):
        table.add_column(col, justify="right")
    table.add_row(f"{p.target_sparsity:.3f}", f"{achieved:.3f}", f"{m_full:.4g}", f"{m_empty:.4g}",
                  f"{m_circuit:.4g}", f"{f:.3f}", f"{cpr:.3f}", f"{cmd:.3f}")
    ctx.console.print(table)
    graph_files = []
    if p.graph:
        from circuitkit.circuit import load_circuit
        from circuitkit.circuit_graph import write_circuit_graph

        graph_files = write_circuit_graph(load_circuit(out_path), ctx.run_dir / "circuit_graph.png",
                                          p.graph_top_edges, p.graph_backend)
    return StageResult([out_path, *curve_files, circuit_png, *graph_files], {
        "faithfulness": f, "achieved_sparsity": achieved, "scope": p.scope,
        "heads_kept": int(head_mask.sum()), f"{unit}_kept": int(kept.sum()), "metric_full": m_full,
        "metric_empty": m_empty, "metric_circuit": m_circuit, "cpr": cpr, "cmd": cmd, "circuit_path": str(out_path)})


def circuit_for_grads(ctx: RunContext) -> Path | None:
    """The circuit.pt `grads.circuit` names: 'run' is the file this run's pruning stage writes
    (read from disk, so a pruning stage skipped on rerun is not recomputed), else the path."""
    circuit = ctx.cfg.grads.circuit
    if circuit is None:
        return None
    if circuit != "run":
        return Path(circuit)
    path = Path(ctx.cfg.output_path) if ctx.cfg.output_path else ctx.run_dir / "circuit.pt"
    if not path.is_file():
        raise FileNotFoundError(f"grads.circuit=run reads the circuit.pt of this run ({path}), which does not exist:"
                                " run the pruning stage first (stages=[...,pruning,grads]) or give grads.circuit"
                                " the path of a circuit.pt.")
    return path


def _grads(ctx: RunContext) -> StageResult:
    """Gradient index of grads.data_path (Gradian), or skipped when grads.enabled is false."""
    g = ctx.cfg.grads
    if not g.enabled:
        ctx.console.print("grads.enabled=false: gradient indexing skipped")
        return StageResult([], {"status": "skipped"})
    from gradian.indexer import build_index

    index_dir = Path(g.index_dir) if g.index_dir else ctx.run_dir / "index"
    if not g.index_dir and ctx.changed_inputs and index_dir.is_dir():
        # The run's own index was made from inputs that changed since (data file, model, circuit):
        # it is stale, not resumable. A user-chosen index_dir is never deleted (Gradian refuses it).
        import shutil

        ctx.console.print(f"grads: {', '.join(ctx.changed_inputs[:3])} changed; rebuilding {index_dir}",
                          markup=False)
        shutil.rmtree(index_dir)
    circuit_path = circuit_for_grads(ctx)
    summary = build_index(ctx.cfg.model, g, index_dir, ctx.console, loaded=ctx.model(), circuit_path=circuit_path)
    files = [index_dir / "manifest.json", *(index_dir / name for name in summary.get("shard_files", []))]
    ctx.console.print(f"index {index_dir}: {summary['rows_stored']} of {summary['n_rows']} rows,"
                      f" {summary['bytes'] / 2**20:.2f} MiB")
    restricted = summary.get("circuit")
    if restricted:
        ctx.console.print(f"restricted to circuit {circuit_path} (sha256 {restricted['sha256'][:12]}…):"
                          f" {len(restricted['heads'])} heads, {len(restricted['mlps'])} MLPs")
    return StageResult(files, {"index_dir": str(index_dir), "rows_stored": summary["rows_stored"],
                               "row_width": summary["row_width"], "index_bytes": summary["bytes"],
                               "complete": summary["complete"], "padding_share": summary.get("padding_share"),
                               "circuit_sha256": restricted["sha256"] if restricted else None},
                       estimated_peak_bytes=summary["estimated_peak_bytes"])


# --------------------------------------------------------------------------- inputs

def model_inputs(cfg: AppConfig) -> dict[str, Path | str]:
    """The model as an input: a local or builtin directory (every file: weights, config,
    tokenizer), or a hub id at its resolved revision."""
    from circuitkit.fingerprint import hub_revision
    from circuitkit.models.loading import BUILTIN_PREFIX, is_local_path, resolve_model_path

    name = cfg.model.name
    if name.startswith(BUILTIN_PREFIX) or is_local_path(name):
        return {"model": Path(resolve_model_path(name))}
    return {"model": hub_revision(name, cfg.model.revision)}


def task_data_file(cfg: AppConfig) -> Path | None:
    """The file (or directory) a file-based discovery task reads; None for generated tasks."""
    from circuitkit.tasks import SAMPLE_FILES

    d = cfg.discovery
    if d.task not in SAMPLE_FILES:
        return None
    return Path(d.data_params.data_path).expanduser() if d.data_params.data_path else SAMPLE_FILES[d.task]


def grads_data_file(cfg: AppConfig) -> Path:
    from gradian.indexer import SAMPLE_DATA

    return Path(cfg.grads.data_path).expanduser() if cfg.grads.data_path else SAMPLE_DATA


def _data_inputs(cfg: AppConfig, run_dir: Path) -> dict[str, Path | str]:
    data_file = task_data_file(cfg)
    return {**model_inputs(cfg), **({"discovery.data_params.data_path": data_file} if data_file else {})}


def _attribution_inputs(cfg: AppConfig, run_dir: Path) -> dict[str, Path | str]:
    return {**model_inputs(cfg), DATA_FILE: run_dir / DATA_FILE}


def _pruning_inputs(cfg: AppConfig, run_dir: Path) -> dict[str, Path | str]:
    return {**model_inputs(cfg), DATA_FILE: run_dir / DATA_FILE, SCORES_FILE: run_dir / SCORES_FILE}


def _grads_inputs(cfg: AppConfig, run_dir: Path) -> dict[str, Path | str]:
    if not cfg.grads.enabled:
        return {}
    data = grads_data_file(cfg)
    if not data.exists() and cfg.grads.data_format in ("hf", "auto"):
        # A hub dataset name: no local file to hash; the name and split are what identify it here.
        inputs: dict[str, Path | str] = {**model_inputs(cfg),
                                         "grads.data_path": f"hf:{cfg.grads.data_path}:{cfg.grads.data_split}"}
    else:
        inputs = {**model_inputs(cfg), "grads.data_path": data}
    if cfg.grads.circuit is not None:  # the circuit decides which parameters are indexed
        run_circuit = Path(cfg.output_path) if cfg.output_path else run_dir / "circuit.pt"
        inputs["grads.circuit"] = run_circuit if cfg.grads.circuit == "run" else Path(cfg.grads.circuit)
    return inputs


# --------------------------------------------------------------------------- pre-run checks

def _check_model(cfg: AppConfig) -> None:
    from circuitkit.models.loading import resolve_model_path

    resolve_model_path(cfg.model.name)


def model_context(cfg: AppConfig) -> int | None:
    """The model's context length from its config (no weights); None when not known offline."""
    from circuitkit.models.loading import context_length, load_hf_config

    hf = load_hf_config(cfg.model)
    return context_length(hf) if hf is not None else None


def _check_input_file(path: Path, key: str, allow_dir: bool = False) -> None:
    if not path.exists():
        raise UserError(f"{key}={str(path)!r} does not exist (resolved to {path.resolve()}); give the path"
                        " of your data file.", 2)
    if path.is_dir() and not allow_dir:
        raise UserError(f"{key}={str(path)!r} is a directory, but a file is expected: give the data file's path.", 2)


def _check_data(cfg: AppConfig) -> None:
    """The model reference, the task's data file, and synthetic lengths within the context."""
    _check_model(cfg)
    d = cfg.discovery
    data_file = task_data_file(cfg)
    if data_file is not None and d.data_params.data_path:
        _check_input_file(data_file, "discovery.data_params.data_path", allow_dir=d.task == "mmlu")
    if d.task == "induction":
        limit = model_context(cfg)
        if limit is not None and d.data_params.seq_len > limit:
            raise ConfigError(f"Config key 'discovery.data_params.seq_len' = {d.data_params.seq_len} exceeds the"
                              f" context of {cfg.model.name} ({limit} tokens); set it to at most {limit}.")


def _check_attribution(cfg: AppConfig) -> None:
    _check_model(cfg)


def _check_pruning(cfg: AppConfig) -> None:
    """Edge pruning needs edge scores; output_path must be writable (checked before attribution)."""
    if cfg.pruning.scope == "edges" and cfg.discovery.level == "node" and "attribution" in cfg.stages:
        raise ConfigError("pruning.scope=edges needs edge scores, but discovery.level=node: set"
                          " discovery.level=edge (or pruning.scope=heads).")
    if cfg.output_path:
        check_writable(Path(cfg.output_path), "output_path")


def _check_grads(cfg: AppConfig) -> None:
    """The model reference, then Gradian's own pre-run checks from config files alone: the data
    can be read, the index dir written, shard_index < num_shards, rows bounded by the context."""
    if not cfg.grads.enabled:
        return
    _check_model(cfg)
    if cfg.grads.index_dir:  # a write probe: permission bits say nothing to root on a read-only mount
        check_writable(Path(cfg.grads.index_dir), "grads.index_dir", directory=True)
    check_grads_config(cfg.model, cfg.grads, cfg.grads.index_dir)


register_stage(Stage("preflight", ("model", "discovery", "grads", "preflight"), _preflight, cached=False,
                     check=_check_model))
register_stage(Stage("data", ("model", "discovery.task", "discovery.data_params", "seed"), _data,
                     inputs=_data_inputs, check=_check_data))
register_stage(Stage("attribution", ("model", "discovery"), _attribution, inputs=_attribution_inputs,
                     check=_check_attribution))
register_stage(Stage("pruning", ("pruning", "output_path"), _pruning, inputs=_pruning_inputs,
                     check=_check_pruning))
register_stage(Stage("grads", ("model", "grads"), _grads, inputs=_grads_inputs, check=_check_grads))
