"""Artifacts made by hand for the refusal tests: scores, task data, circuits and shard run dirs of the tiny
GPT-2's graph (or of another model's), user config files, an imported graph's JSON, a pickled model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from circuitkit.core.config import to_dict
from circuitkit.core.io import atomic_save_safetensors, atomic_write_json, sha256_file
from circuitkit.discovery.attribution import AttributionScores, Graph, save_scores
from circuitkit.discovery.attribution.shards import (
    PARTIAL_FILE,
    SHARD_SHA_KEY,
    save_partial,
)
from circuitkit_app.config import compose
from tests.helpers.refusals import SMALL, _r, _tiny, _write

TINY = Graph(2, 4, 4, False)  # the tiny GPT-2 fixture's graph


GPT2_SMALL = Graph(12, 12, 12, False)


def _scores(g: Graph, seed: int = 0, **change) -> AttributionScores:
    torch.manual_seed(seed)
    edges = torch.randn(len(g.upstream), len(g.downstream)) * g.edge_mask()
    fields = {"head": torch.randn(g.n_layers, g.n_heads), "mlp": torch.randn(g.n_layers), "embed": torch.tensor(0.3),
              "graph": g, "edges": edges, "metric_clean": 1.0, "metric_corrupted": 0.0, "n_examples": 4,
              "info": {"algorithm": "eap"}}
    fields.update(change)
    return AttributionScores(**fields)


def _scores_file(tmp: Path, scores: AttributionScores, name: str = "run/scores.safetensors") -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_scores(path, scores, {"model": "x", "task": "imported"})


def _raw_scores(tmp: Path, tensors: dict, meta: dict, name: str = "run/scores.safetensors") -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_save_safetensors(path, tensors, meta)


def _data_file(tmp: Path, bad_id: int | None = None, name: str = "run/data.safetensors") -> Path:
    from circuitkit.discovery.tasks.base import random_pairs

    data = random_pairs(6, 8, 100)
    if bad_id is not None:
        data.clean_ids[2, 3] = bad_id
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return data.save(path, {"task": "induction", "num_examples": "4", "eval_examples": "2", "model": "x"})


def _circuit(tmp: Path, g: Graph, name: str = "big.pt") -> Path:
    from circuitkit.discovery.circuit import save_circuit

    return save_circuit(tmp / name, {
        "model_name": "gpt2", "head_mask": torch.ones(g.n_layers, g.n_heads, dtype=torch.bool),
        "head_scores": torch.zeros(g.n_layers, g.n_heads), "ablation": "zero", "rank_by": "abs",
        "target_sparsity": 0.0, "achieved_sparsity": 0.0})


def _confs(tmp: Path) -> None:
    head = "defaults:\n  - config\n  - _self_\n"
    _write(tmp / "conf" / "bad.yaml", head + "seed: [1\n")
    _write(tmp / "conf" / "range.yaml", head + "discovery:\n  batch_size: 0\n")
    _write(tmp / "conf" / "conflict.yaml", head + "pruning:\n  scope: edges\nstages: [data,attribution,pruning]\n")


def _graph_json(tmp: Path, score=1.0, node_score=0.5, n_layers=2) -> Path:
    obj = {"cfg": {"n_layers": n_layers, "n_heads": 4, "d_model": 64},
           "nodes": {"input": {"in_graph": True, "score": 1.0}, "a0.h1": {"in_graph": True, "score": node_score}},
           "edges": {"input->logits": {"score": score, "in_graph": True}}}
    return _write(tmp / "g.json", json.dumps(obj))


def _pickled_model(tmp: Path) -> None:
    """The tiny model with its weights as a pytorch_model.bin pickle that holds a callable."""
    import os

    from safetensors.torch import load_file

    target = tmp / "pickled"
    shutil.copytree(_tiny(), target)
    state = load_file(str(target / "model.safetensors"))
    os.remove(target / "model.safetensors")
    state["payload"] = Payload()
    torch.save(state, target / "pytorch_model.bin")


class Payload:
    """What an attacker puts in a pickle: loading it would call print (here harmless)."""

    def __reduce__(self):
        return (print, ("payload ran",))


def _offline(monkeypatch) -> None:
    from circuitkit.core import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.forget()


def _cfg_dict() -> dict:
    return to_dict(compose([*SMALL, "discovery.num_shards=2"])[1])


def _shard_run(tmp: Path, i: int, n: int = 2, meta_drop: str | None = None, record: bool = True) -> Path:
    """A finished shard's run dir made by hand: its sums and the manifest that records their sha256."""
    from circuitkit.discovery.attribution.shards import shard_identity

    run = tmp / f"shard{i}"
    sums = _scores(TINY, seed=i, n_examples=3, edges=None)
    path = save_partial(run / PARTIAL_FILE, sums, i, n, (3 * i, 3 * i + 3), shard_identity(_cfg_dict()), "m", "d", run)
    if meta_drop:  # the same file without one metadata key
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = {k: v for k, v in (fh.metadata() or {}).items() if k != meta_drop}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        atomic_save_safetensors(path, tensors, meta)
    stage = {"status": "ok", **({SHARD_SHA_KEY: sha256_file(path)} if record else {})}
    atomic_write_json(run / "manifest.json", {"config": _cfg_dict(), "stages": {"attribution": stage}})
    _write(run / "data.safetensors", b"data")
    return run


def _change_a_value(path: Path) -> None:
    """Rewrite a shard with one head sum changed, keeping its metadata (what a hand edit does)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors["head_sums"][0, 0] += 1.0
    atomic_save_safetensors(path, tensors, meta)


def _shards(tmp: Path, change: Callable[[Path], None] | None = None, **kw) -> None:
    for i in (0, 1):
        run = _shard_run(tmp, i, **(kw if i == 1 else {}))
        if change and i == 1:
            change(run / PARTIAL_FILE)


MERGE = _r("merge", "{tmp}/shard0", "{tmp}/shard1", "--out", "{tmp}/merged", "--no-prune")
