"""Attribution: EAP / EAP-IG / EAP-GP / clean-corrupted gradients, ACDC, and exact patching as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from circuitkit.core.io import atomic_save_safetensors
from circuitkit.discovery.attribution.eap import AttributionScores, attribute, graph_of
from circuitkit.discovery.attribution.exact import exact_patching
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.config import DiscoveryConfig
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter

__all__ = ["AttributionScores", "Graph", "attribute", "exact_patching", "run_attribution", "save_scores",
           "load_scores", "graph_of"]


def run_attribution(adapter: ModelAdapter, data: TaskData, cfg: DiscoveryConfig,
                    progress: bool = True, sums: bool = False) -> AttributionScores:
    """Scores for `cfg.algorithm` at `cfg.level` over `data` in batches of `cfg.batch_size`
    (means over the examples; sums with `sums=True`, what a shard writes). With
    `cfg.per_example`, `per_example` rows are in data order (row i = example i), so that the
    rows of shards of the examples concatenate to one job's (`circuitkit.discovery.attribution.shards`)."""
    per_example = getattr(cfg, "per_example", False)
    if cfg.algorithm == "exact":
        return exact_patching(adapter, data, cfg.level, cfg.metric, cfg.batch_size, progress, sums=sums)
    if cfg.algorithm == "acdc":
        from circuitkit.discovery.attribution.acdc import acdc

        return acdc(adapter, data, cfg.level, cfg.metric, cfg.acdc_threshold, cfg.batch_size, progress, sums=sums)
    if cfg.algorithm == "eap-gp":
        from circuitkit.discovery.attribution.eap_gp import attribute_gradpath

        scores = attribute_gradpath(adapter, data, cfg.level, cfg.metric, cfg.ig_steps, cfg.batch_size, progress,
                                    ig_rule=cfg.ig_rule, sums=sums, per_example=per_example)
    elif cfg.algorithm == "eap-ig-activations":
        from circuitkit.discovery.attribution.eap_activations import attribute_activations

        scores = attribute_activations(adapter, data, cfg.level, cfg.metric, cfg.ig_steps, cfg.batch_size, progress,
                                       ig_rule=cfg.ig_rule, sums=sums, per_example=per_example)
    else:
        scores = attribute(adapter, data, cfg.algorithm, cfg.level, cfg.metric, cfg.ig_steps, cfg.batch_size,
                           progress, ig_rule=cfg.ig_rule, sums=sums, per_example=per_example)
    return _per_example_in_data_order(scores, data, cfg.batch_size)


def _per_example_in_data_order(scores: AttributionScores, data: TaskData, batch_size: int) -> AttributionScores:
    """`attribute` keeps per-example rows in batch order (`TaskData.length_batches`, pairs grouped
    by length); put row i back to example i."""
    if not scores.per_example:
        return scores
    from circuitkit.core.batching import plan_batches

    batch_order = torch.tensor([i for batch in plan_batches(data.lengths(), batch_size) for i in batch])
    data_order = torch.empty_like(batch_order)
    data_order[batch_order] = torch.arange(len(batch_order))
    scores.per_example = {key: rows[data_order] for key, rows in scores.per_example.items()}
    return scores


def save_scores(path: Path, scores: AttributionScores, extra_metadata: dict[str, str] | None = None) -> Path:
    """scores.safetensors: head (L, H), mlp (L,), embed (1,), edges (n_up, n_down) if computed;
    with several corruptions also each one's as `corruption.<name>.head_scores` etc.

    Metadata (strings): node names of the edge matrix's rows and columns as JSON, the metric
    means on clean and corrupted inputs, and how the scores were computed (`info`, and
    `ig_rule`: the quadrature rule of eap-ig, "None" for other algorithms).
    """
    g = scores.graph
    tensors = {"head_scores": scores.head.float(), "mlp_scores": scores.mlp.float(),
               "embed_score": scores.embed.float().reshape(1)}
    meta = {"graph": json.dumps({"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                                 "parallel_residual": g.parallel_residual}),
            "metric_clean": repr(scores.metric_clean), "metric_corrupted": repr(scores.metric_corrupted),
            "n_examples": str(scores.n_examples), "info": json.dumps(scores.info),
            "ig_rule": str(scores.info.get("ig_rule"))}
    for key, value in (scores.per_example or {}).items():  # circuitkit.discovery.pruning.stability: (N, ...) per example
        tensors[f"per_example_{key}"] = value.float().contiguous()
    for name, each in (scores.by_corruption or {}).items():  # several corruptions: each one's scores beside
        for key, value in (("head_scores", each.head), ("mlp_scores", each.mlp),
                           ("embed_score", each.embed.reshape(1)), ("edge_scores", each.edges)):
            if value is not None:
                tensors[f"corruption.{name}.{key}"] = value.float().contiguous()
    if scores.edges is not None:
        tensors["edge_scores"] = scores.edges.float()
        meta["upstream_nodes"] = json.dumps(g.upstream)
        meta["downstream_nodes"] = json.dumps(g.downstream)
    meta.update(extra_metadata or {})
    return atomic_save_safetensors(path, tensors, meta)


def load_scores(path: Path) -> AttributionScores:
    """Read scores.safetensors back into AttributionScores.

    A file that is not one (truncated, garbage, keys or metadata missing), whose tensors do not
    have the shapes of its own graph, or that holds NaN/inf raises one line naming the file
    (circuitkit.artifact_checks.ArtifactMismatch)."""
    from safetensors import safe_open

    from circuitkit.discovery.attribution.checks import ArtifactMismatch, check_scores_consistent

    path = Path(path)
    fix = ("it is truncated, corrupted or not a CircuitKit scores file: rerun the attribution stage"
           " (or `circuitkit import` it again).")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            t = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - header, EOF and format errors all mean "not readable"
        if isinstance(err, OSError) and not isinstance(err, FileNotFoundError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise ArtifactMismatch(f"{path} cannot be read as scores ({reason}); {fix}") from None
    missing = [k for k in ("head_scores", "mlp_scores", "embed_score") if k not in t]
    missing += [f"metadata {k}" for k in ("graph", "metric_clean", "metric_corrupted", "n_examples", "info")
                if k not in meta]
    if missing:
        raise ArtifactMismatch(f"{path} is not a CircuitKit scores file: missing {', '.join(missing)}; {fix}")
    try:
        graph = Graph(**json.loads(meta["graph"]))
        if min(graph.n_layers, graph.n_heads, graph.n_kv_heads) < 1 or graph.n_heads % graph.n_kv_heads:
            raise ValueError(f"impossible graph {meta['graph']}")
        scores = AttributionScores(t["head_scores"], t["mlp_scores"], t["embed_score"].reshape(-1)[0], graph,
                                   t.get("edge_scores"), float(meta["metric_clean"]),
                                   float(meta["metric_corrupted"]), int(meta["n_examples"]),
                                   json.loads(meta["info"]),
                                   per_example={k[len("per_example_"):]: v for k, v in t.items()
                                                if k.startswith("per_example_")})
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise ArtifactMismatch(f"{path} has unreadable metadata ({str(err)[:120]}); {fix}") from None
    check_scores_consistent(scores, path)
    scores.by_corruption = _by_corruption(scores, t)
    return scores


def _by_corruption(scores: AttributionScores, t: dict[str, torch.Tensor]) -> dict | None:
    """The per-corruption scores a several-corruption run saved (`corruption.<name>.*`), or None."""
    names = scores.info.get("corruptions")
    if not names or not all(f"corruption.{c}.head_scores" in t for c in names):
        return None
    figures = scores.info.get("corruption_metrics", {})
    return {c: AttributionScores(t[f"corruption.{c}.head_scores"], t[f"corruption.{c}.mlp_scores"],
                                 t[f"corruption.{c}.embed_score"].reshape(-1)[0], scores.graph,
                                 t.get(f"corruption.{c}.edge_scores"),
                                 figures.get(c, {}).get("metric_clean", float("nan")),
                                 figures.get(c, {}).get("metric_corrupted", float("nan")), scores.n_examples,
                                 {k: v for k, v in scores.info.items() if not k.startswith("corruption")})
            for c in names}


def top_heads(head_scores: torch.Tensor, k: int = 5, by_abs: bool = True) -> list[tuple[int, int, float]]:
    """The k highest-scoring heads as (layer, head, score)."""
    flat = head_scores.flatten()
    order = (flat.abs() if by_abs else flat).argsort(descending=True)[:k]
    H = head_scores.shape[1]
    return [(int(i) // H, int(i) % H, float(flat[i])) for i in order]
