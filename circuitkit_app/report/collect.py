"""What a run's report shows, read from its typed artifacts: one JSON-able dict per section.

    collect_run(run_dir) -> {"run": ..., "attribution": ..., "circuit": ..., "gradian": ..., "attribute": ...}

Every artifact is read through its own reader (`load_manifest`, `load_scores`, `load_circuit`,
`IndexReader`) and checked against the sha256 the manifest recorded for it; one that changed
since its stage wrote it is left out, with a note the page shows. A section appears only where
the run has what it needs. Nothing here computes anything a stage computes, except views of
stored numbers (a head's spread over examples, per-layer totals of the edge scores, how often a
head is kept over the bootstrap resamples that the stability figure already draws).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.circuit_file import load_circuit, run_circuit_path
from circuitkit.core.config import flatten, to_dict
from circuitkit.core.io import sha256_file
from circuitkit.core.pipeline import load_manifest
from circuitkit.discovery.circuit_graph import (
    edge_children,
    graph_shape,
    kept_node_names,
    layer_of,
    ranked_edges,
)
from circuitkit_app.config import AppConfig

MAX_PER_EXAMPLE = 256  # examples whose per-head scores are embedded (clicking a head shows them)
TOP_LIST = 25  # rows of the node and edge top lists


def _finite(value: Any) -> float | None:
    """A float for JSON (NaN and inf become None), rounded to 6 significant digits."""
    if value is None:
        return None
    value = float(value)
    return float(f"{value:.6g}") if math.isfinite(value) else None


def _rounded(t: torch.Tensor) -> list:
    """A tensor as nested lists of 5-significant-digit floats (NaN/inf as None)."""
    return [_rounded(x) for x in t] if t.dim() > 0 else (None if not math.isfinite(float(t)) else
                                                          float(f"{float(t):.5g}"))


def config_rows(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every key of the run's config with its value and the schema's default (`changed` where they differ)."""
    ran, default = flatten(config), flatten(to_dict(AppConfig()))
    return [{"key": key, "value": value, "default": default.get(key), "changed": key not in default or
             default[key] != value} for key, value in ran.items()]


class _Artifacts:
    """The files a run's manifest records, each checked against its recorded sha256 when read.

    A report reads only the run's own artifacts: a file inside the run directory, or one a stage
    of this run recorded writing (with its sha256) where the config sent it elsewhere
    (`output_path`, `grads.index_dir`). A path from the manifest that is neither (an edited
    `config.output_path`) is refused, exit 1: the manifest is not what the run wrote.
    """

    def __init__(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.recorded: dict[str, str] = {}
        for entry in manifest.get("stages", {}).values():
            for rel, info in (entry.get("artifacts") or {}).items():
                path = Path(rel) if Path(rel).is_absolute() else run_dir / rel
                self.recorded[str(path.resolve())] = info.get("sha256")
        self.notes: list[str] = []

    def confine(self, path: Path, key: str) -> None:
        """UserError (exit 1) unless `path` is inside the run directory or recorded, with a sha256,
        as an artifact of this run; `key` names the manifest entry that gave the path."""
        from circuitkit.core.errors import UserError

        resolved, run = Path(path).resolve(), self.run_dir.resolve()
        if resolved == run or run in resolved.parents or self.recorded.get(str(resolved)):
            return
        raise UserError(f"{self.run_dir / 'manifest.json'}: {key} names {path}, outside the run directory, and no"
                        " stage of this run recorded writing it; a report reads only the run's own artifacts:"
                        " restore manifest.json as the run wrote it, or rerun the run.")

    def usable(self, path: Path, key: str = "") -> bool:
        """True if `path` exists and, when the manifest records it, still has its recorded sha256;
        a path outside the run directory is confined first (`confine`, `key` naming its source)."""
        self.confine(path, key or str(path))
        if not path.is_file():
            return False
        expected = self.recorded.get(str(path.resolve()))
        if expected is not None and sha256_file(path) != expected:
            self.notes.append(f"{path.name} changed since its stage wrote it (sha256 differs from manifest.json);"
                              " left out of this report. Rerun the stage to refresh it.")
            return False
        return True


def _run_section(run_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    stages = []
    for name, entry in manifest.get("stages", {}).items():
        stages.append({"name": name, "status": entry.get("status"), "cached": bool(entry.get("skipped_on_rerun")),
                       "wall_s": entry.get("wall_s"), "estimated_peak_bytes": entry.get("estimated_peak_bytes"),
                       "measured_peak_bytes": entry.get("measured_peak_bytes"),
                       "peak_method": entry.get("peak_method"), "error": entry.get("error"),
                       "artifacts": list(entry.get("artifacts") or {})})
    preflight = (manifest.get("stages", {}).get("preflight") or {}).get("summary") or {}
    terms = {key[:-len("_terms")]: {t: b for t, b in value.items() if isinstance(b, (int, float))}
             for key, value in preflight.items() if key.endswith("_terms") and isinstance(value, dict)}
    return {"memory_terms": terms, "free_bytes": preflight.get("free_bytes"),
            "run_dir": str(run_dir), "model": (manifest.get("config") or {}).get("model", {}).get("name"),
            "model_source": manifest.get("model_source"), "device": manifest.get("device"),
            "command": manifest.get("command"), "overrides": manifest.get("overrides") or [],
            "versions": manifest.get("versions") or {}, "config": config_rows(manifest.get("config") or {}),
            "stages": stages, "status": manifest.get("status"), "error": manifest.get("error")}


def _spread(values: torch.Tensor) -> list[float | None]:
    """[mean, sd, 5th, 95th percentile] over the first dim: (N, ...) -> per entry, as lists."""
    v = values.float()
    q = torch.quantile(v, torch.tensor([0.05, 0.95]), dim=0) if v.shape[0] > 1 else torch.stack([v[0], v[0]])
    sd = v.std(0) if v.shape[0] > 1 else torch.zeros_like(v[0])
    return [v.mean(0), sd, q[0], q[1]]


def _attribution_section(scores) -> dict[str, Any]:
    g = scores.graph
    head = scores.head.float()
    nodes = [(f"a{layer}.h{h}", float(head[layer, h])) for layer in range(g.n_layers) for h in range(g.n_heads)]
    nodes += [(f"m{layer}", float(scores.mlp[layer])) for layer in range(g.n_layers)]
    nodes.sort(key=lambda item: -abs(item[1]))
    out: dict[str, Any] = {
        "info": scores.info, "n_examples": scores.n_examples, "metric_clean": _finite(scores.metric_clean),
        "metric_corrupted": _finite(scores.metric_corrupted), "embed_score": _finite(scores.embed),
        "n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
        "head_scores": _rounded(head), "mlp_scores": _rounded(scores.mlp.float()),
        "top_nodes": [{"name": n, "score": _finite(s)} for n, s in nodes[:TOP_LIST]], "top_edges": [],
        "n_edges": None, "per_example_head": None}
    if scores.edges is not None:
        edges = torch.where(g.edge_mask(), scores.edges.float(), torch.zeros_like(scores.edges.float()))
        order = edges.abs().flatten().argsort(descending=True)[:TOP_LIST].tolist()
        out["top_edges"] = [{"from": g.upstream[i // edges.shape[1]], "to": g.downstream[i % edges.shape[1]],
                             "score": _finite(edges.flatten()[i])} for i in order]
        out["n_edges"] = int(g.edge_mask().sum())
    per_head = (scores.per_example or {}).get("head")
    if per_head is not None:
        out["per_example_head"] = _rounded(per_head[:MAX_PER_EXAMPLE].float())
        out["per_example_shown"] = min(int(per_head.shape[0]), MAX_PER_EXAMPLE)
        out["per_example_total"] = int(per_head.shape[0])
    return out


def _layer_totals(circuit, g) -> dict[str, Any]:
    """Sum of |score| of every edge between two layers: rows upstream (input, L0..), columns downstream
    (L0.., logits). What the embedded top edges leave out is still visible here."""
    scores = circuit["edge_scores"].float().abs() * g.edge_mask()
    up = torch.tensor([0 if n == "input" else layer_of(n) + 1 for n in g.upstream])
    down = torch.tensor([g.n_layers if n == "logits" else layer_of(n) for n in g.downstream])
    totals = torch.zeros(g.n_layers + 1, g.n_layers + 1)
    by_up = torch.zeros(g.n_layers + 1, scores.shape[1]).index_add_(0, up, scores)
    totals = totals.index_add_(1, down, by_up)
    return {"z": _rounded(totals), "rows": ["input", *[f"L{i}" for i in range(g.n_layers)]],
            "cols": [*[f"L{i}" for i in range(g.n_layers)], "logits"]}


def _circuit_graph(circuit, per_example: dict[str, torch.Tensor], top_edges: int, default_edges: int) -> dict:
    g = graph_shape(circuit)
    kept = kept_node_names(circuit)
    ranked, n_candidates = ranked_edges(circuit, top_edges)
    edge_scope = circuit.get("scope") == "edges" and circuit.get("edge_mask") is not None
    per_edge = per_example.get("edges")
    spreads = None
    if per_edge is not None and ranked and per_edge.shape[1:] == circuit["edge_scores"].shape:
        idx_u = torch.tensor([u for u, _, _ in ranked])
        idx_v = torch.tensor([v for _, v, _ in ranked])
        spreads = [_rounded(t) for t in _spread(per_edge[:, idx_u, idx_v])]
    edges = []
    for rank, (u, v, score) in enumerate(ranked):
        for child, letter in edge_children(g.downstream[v], g):
            if edge_scope or child in kept:
                edges.append([g.upstream[u], child, letter, _finite(score), rank])
    edge_kept_frequency = None
    stable = circuit.get("stability")
    if edge_scope and stable and spreads is not None:  # how often each drawn edge is kept over the resamples
        from circuitkit.discovery.pruning.stability import kept_frequency

        freq = kept_frequency(per_edge, int(circuit["edge_mask"].sum()), circuit.get("rank_by") or "abs",
                              int(stable.get("n_resamples") or 100), valid=g.edge_mask())
        edge_kept_frequency = [_finite(freq[u, v]) for u, v, _ in ranked]
    head_scores, mlp_scores = circuit.get("head_scores"), circuit.get("mlp_scores")
    node_scores: dict[str, float | None] = {"input": _finite(circuit.get("embed_score"))}
    for layer in range(g.n_layers):
        for h in range(g.n_heads):
            node_scores[f"a{layer}.h{h}"] = _finite(head_scores[layer, h]) if head_scores is not None else None
        node_scores[f"m{layer}"] = _finite(mlp_scores[layer]) if mlp_scores is not None else None
    node_spread = {}
    per_head = per_example.get("head")
    if per_head is not None and tuple(per_head.shape[1:]) == (g.n_layers, g.n_heads):
        mean, sd, lo, hi = _spread(per_head)
        for layer in range(g.n_layers):
            for h in range(g.n_heads):
                node_spread[f"a{layer}.h{h}"] = [_finite(t[layer, h]) for t in (mean, sd, lo, hi)]
    return {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads, "scope": circuit.get("scope"),
            "kept": sorted(kept), "node_scores": node_scores, "node_spread": node_spread, "edges": edges,
            "edge_spread": spreads, "edge_kept_frequency": edge_kept_frequency, "n_ranked": len(ranked), "n_candidates": n_candidates,
            "n_edges_total": int(g.edge_mask().sum()) if circuit.get("edge_scores") is not None else 0,
            "default_edges": min(default_edges, len(ranked)), "top_edges": top_edges,
            "layer_totals": _layer_totals(circuit, g) if circuit.get("edge_scores") is not None else None}


def _corruptions_view(joint: dict | None) -> dict | None:
    """Several corruptions in one discovery: {names, rule, faithfulness, by_corruption: {c: f}}, or None."""
    if not joint:
        return None
    return {"names": list(joint.get("names") or []), "rule": joint.get("rule"),
            "faithfulness": _finite(joint.get("faithfulness")),
            "by_corruption": {c: _finite(b.get("faithfulness")) for c, b in (joint.get("by_corruption") or {}).items()}}


def _verdict_view(verdict: dict[str, Any] | None) -> dict[str, Any] | None:
    """The verdict's rows as circuit.pt stores them (values finite or None), its scope and head count."""
    if not verdict:
        return None
    return {"scope": verdict.get("scope"), "n_heads": verdict.get("n_heads"),
            "rows": [{"pillar": r["pillar"], "value": _finite(r["value"]), "detail": r["detail"],
                      "definition": r["definition"]} for r in verdict["rows"]]}


def _circuit_section(circuit, per_example: dict[str, torch.Tensor], top_edges: int, default_edges: int) -> dict:
    heads = circuit["head_mask"].bool()
    out: dict[str, Any] = {
        "model_name": circuit.get("model_name"), "scope": circuit.get("scope"), "selection": circuit.get("selection"),
        "ablation": circuit.get("ablation"), "rank_by": circuit.get("rank_by"),
        "target_sparsity": _finite(circuit.get("target_sparsity")),
        "achieved_sparsity": _finite(circuit.get("achieved_sparsity")),
        "heads_kept": int(heads.sum()), "heads_total": heads.numel(),
        "kept_heads": [f"a{layer}.h{h}" for layer, h in heads.nonzero().tolist()],
        "metrics": {k: _finite(v) for k, v in (circuit.get("metrics") or {}).items()},
        "cpr": _finite(circuit.get("cpr")), "cmd": _finite(circuit.get("cmd")),
        "curve": [{k: (_finite(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                   for k, v in row.items()} for row in (circuit.get("curve") or [])],
        "curve_definition": circuit.get("curve_definition"), "n_eval_examples": circuit.get("n_eval_examples"),
        "stability": circuit.get("stability"), "kept_frequency": None,
        "corruption": circuit.get("corruption"), "heldout_templates": circuit.get("heldout_templates"),
        "corruptions": _corruptions_view(circuit.get("corruptions")),
        "graph": _circuit_graph(circuit, per_example, top_edges, default_edges),
        "verdict": _verdict_view(circuit.get("verdict"))}
    stable, per_head = circuit.get("stability"), per_example.get("head")
    if stable and per_head is not None and circuit.get("scope") != "edges" and tuple(per_head.shape[1:]) == tuple(
            heads.shape):
        from circuitkit.discovery.pruning.stability import kept_frequency

        freq = kept_frequency(per_head, int(heads.sum()), circuit.get("rank_by") or "abs",
                              int(stable.get("n_resamples") or 100))
        out["kept_frequency"] = _rounded(freq)
    return out


def index_view(index_dir: Path) -> dict[str, Any]:
    from gradian.index.header import describe_index
    from gradian.index.reader import IndexReader

    summary = IndexReader(index_dir).summary()
    return {"index_dir": str(index_dir), "rows": [[k, v] for k, v in describe_index(summary)]}


def collect_run(run_dir: Path, top_edges: int | None = None) -> dict[str, Any]:
    """Everything the report shows of the run in `run_dir` (see the module docstring).

    `top_edges`: strongest circuit edges embedded (default: the run's `report.top_edges`).
    Raises UserError (exit 2) when `run_dir` holds no manifest.json.
    """
    from circuitkit.core.errors import UserError
    from circuitkit.discovery.attribution import load_scores

    run_dir = Path(run_dir)
    manifest = load_manifest(run_dir)
    if not manifest:
        raise UserError(f"{run_dir} holds no manifest.json: give the run directory of a pipeline run (or a"
                        " multirun's sweep directory).", exit_code=2)
    config = manifest.get("config") or {}
    files = _Artifacts(run_dir, manifest)
    view: dict[str, Any] = {"kind": "run", "run": _run_section(run_dir, manifest)}
    limit = top_edges or int((config.get("report") or {}).get("top_edges", 2000))
    default_edges = int((config.get("pruning") or {}).get("graph_top_edges", 40))

    per_example: dict[str, torch.Tensor] = {}
    scores_path = run_dir / "scores.safetensors"
    if files.usable(scores_path):
        scores = load_scores(scores_path)
        per_example = scores.per_example or {}
        view["attribution"] = _attribution_section(scores)
    circuit_path = run_circuit_path(config.get("output_path"), run_dir)
    if files.usable(circuit_path, "config.output_path"):
        view["circuit"] = _circuit_section(load_circuit(circuit_path), per_example, limit, default_edges)
    grads = (manifest.get("stages", {}).get("grads") or {}).get("summary") or {}
    index_dir = run_dir / "index"
    # The run's own index wins: a copied run directory records the original's absolute index_dir.
    if (grads.get("index_dir") and not (index_dir / "manifest.json").is_file()
            and Path(grads["index_dir"]).resolve() != index_dir.resolve()):
        index_dir = Path(grads["index_dir"])
        files.confine(index_dir / "manifest.json", "stages.grads.summary.index_dir")
    if (index_dir / "manifest.json").is_file():  # the index checks its own files against its manifest
        view["gradian"] = {"index": index_view(index_dir)}
    attribute = _attribute_view(run_dir, manifest, files)
    if attribute is not None:
        view["attribute"] = attribute
    view["notes"] = files.notes
    return view


def _attribute_view(run_dir: Path, manifest: dict[str, Any], files: _Artifacts) -> dict[str, Any] | None:
    """The attribute stage's result, when the stage ran to the end and its file is as it wrote it
    (a failed rerun's leftover or an edited file is not shown); None without the stage."""
    from circuitkit.core.errors import UserError
    from circuitkit_app.report.accused import collect_attribute
    from gradian.attribute.stage import RESULT_FILE

    entry = manifest.get("stages", {}).get("attribute") or {}
    recorded = [rel for rel in entry.get("artifacts") or {} if Path(rel).name == RESULT_FILE]
    if entry.get("status") != "ok" or not recorded:
        return None
    path = Path(recorded[0]) if Path(recorded[0]).is_absolute() else run_dir / recorded[0]
    if not files.usable(path):
        return None
    try:
        return collect_attribute(path)
    except UserError as err:
        files.notes.append(f"{path.name} could not be read ({err}); left out of this report.")
        return None
