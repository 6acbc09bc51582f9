"""Checks of an artifact against the model and graph it is used with.

A stage that reads an artifact from disk (task data, attribution scores, shards, circuits,
imports) checks it here before using it: tensors of the shape its own metadata states, that
shape equal to the model's graph, token ids inside the model's vocabulary, and finite scores.
A mismatch is one line (UserError) naming the file, both shapes and what to do; without
these checks a scores file of another model is pruned "successfully" with wrong numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from circuitkit.core.errors import UserError
from circuitkit.discovery.attribution.graph import Graph


class ArtifactMismatch(UserError):
    """An artifact that does not fit the model or graph it is used with (exit 1)."""


def describe_graph(g: Graph) -> str:
    """'2 layers x 4 heads (4 KV heads)' (+ ', parallel residual')."""
    return (f"{g.n_layers} layers x {g.n_heads} heads ({g.n_kv_heads} KV heads"
            f"{', parallel residual' if g.parallel_residual else ''})")


def expected_score_shapes(g: Graph) -> dict[str, tuple[int, ...]]:
    """Shapes of the score tensors of graph `g`: head (L, H), mlp (L,), edges (n_up, n_down)."""
    return {"head": (g.n_layers, g.n_heads), "mlp": (g.n_layers,),
            "edges": (len(g.upstream), len(g.downstream))}


def check_finite(values: torch.Tensor, what: str, fix: str) -> None:
    """ArtifactMismatch naming `what` and the first non-finite entry when any is NaN or ±inf."""
    bad = ~torch.isfinite(values.float())
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        value = float(values[index]) if index else float(values)
        where = f" at index {list(index)}" if index else ""
        raise ArtifactMismatch(f"{what} holds {int(bad.sum())} non-finite value(s) (first: {value}{where});"
                               f" scores must be finite numbers: {fix}")


def check_scores_consistent(scores, source: str | Path) -> None:
    """The score tensors have the shapes their own graph states, and are finite."""
    g: Graph = scores.graph
    want = expected_score_shapes(g)
    got = {"head": tuple(scores.head.shape), "mlp": tuple(scores.mlp.shape)}
    if scores.edges is not None:
        got["edges"] = tuple(scores.edges.shape)
    for key, shape in got.items():
        if shape != want[key]:
            raise ArtifactMismatch(f"{source}: {key} scores have shape {list(shape)}, but its graph"
                                   f" ({describe_graph(g)}) needs {list(want[key])}; the file was changed or made"
                                   " by hand: rerun the attribution stage.")
    fix = "rerun the attribution stage (or fix the file)."
    for key, tensor in (("head", scores.head), ("mlp", scores.mlp), ("embed", scores.embed),
                        ("edge", scores.edges)):
        if tensor is not None:
            check_finite(tensor, f"{source}: {key} scores", fix)


def check_scores_fit_model(scores, model_graph: Graph, source: str | Path, model_name: str) -> None:
    """The scores' graph is the model's graph (and the tensors fit it): else one line naming both."""
    check_scores_consistent(scores, source)
    g: Graph = scores.graph
    if g != model_graph:
        edges = "" if scores.edges is None else f", edge scores {list(scores.edges.shape)}"
        want = expected_score_shapes(model_graph)["edges"]
        raise ArtifactMismatch(
            f"{source} holds scores of a {describe_graph(g)} graph{edges}, but the model {model_name} has"
            f" {describe_graph(model_graph)} (edge scores {list(want)}): use scores made with this model"
            " (rerun attribution), or set model.name to the model the scores were made with.")


def check_data_fits_model(data, vocab_size: int | None, context: int | None, source: str | Path,
                          model_name: str) -> None:
    """Task data whose token ids lie in the model's vocabulary and whose length fits its context."""
    n_tokens = int(data.clean_ids.shape[1])
    if context is not None and n_tokens > context:
        raise ArtifactMismatch(f"{source} holds pairs of {n_tokens} tokens, but {model_name} takes at most"
                               f" {context}: rerun the data stage with this model.")
    if vocab_size is None:
        return
    for name in ("clean_ids", "corrupted_ids", "correct", "incorrect"):
        ids = getattr(data, name)
        top = int(ids.max()) if ids.numel() else -1
        if top >= vocab_size or (name.endswith("_ids") and ids.numel() and int(ids.min()) < 0):
            raise ArtifactMismatch(f"{source} holds token id {top} in {name}, outside the vocabulary of"
                                   f" {model_name} ({vocab_size} tokens): it was made with another tokenizer;"
                                   " rerun the data stage with this model.")
