"""Selection by integer programming (`pruning.selection=ip`) and the signed rule (`positive`)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from circuitkit.core.errors import UserError
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.pruning.selection import keep_top
from circuitkit.discovery.pruning.selection_ip import (
    MIP_REL_GAP,
    EdgeGraph,
    IPSelector,
    edge_graph,
    on_path,
    positive_select,
    solve_edge_ip,
)


def reached(eg: EdgeGraph, kept: list[int]) -> set[int]:
    """Nodes with a kept path from the embedding (node 0), by fixpoint: independent of the IP's rows."""
    nodes, grew = {0}, True
    while grew:
        grew = False
        for e in kept:
            if eg.src[e] in nodes:
                new = set(eg.readers[eg.dst[e]]) - nodes
                if new:
                    nodes |= new
                    grew = True
    return nodes


def coreached(eg: EdgeGraph, kept: list[int]) -> set[int]:
    """Nodes with a kept path to the logits (a column nobody reads)."""
    nodes, grew = set(), True
    while grew:
        grew = False
        for e in kept:
            u = int(eg.src[e])
            if u not in nodes and (not eg.readers[eg.dst[e]] or set(eg.readers[eg.dst[e]]) & nodes):
                nodes.add(u)
                grew = True
    return nodes


def connected(eg: EdgeGraph, kept: list[int], connectivity: str) -> bool:
    """path: every kept edge lies on a kept path embedding -> logits; input: every kept edge's source is reached."""
    fwd = reached(eg, kept)
    if connectivity == "input":
        return all(eg.src[e] in fwd for e in kept)
    back = coreached(eg, kept)
    return all(eg.src[e] in fwd and (not eg.readers[eg.dst[e]] or set(eg.readers[eg.dst[e]]) & back) for e in kept)


def brute_force(eg: EdgeGraph, w: np.ndarray, n: int, connectivity: str, exact: bool = True) -> float:
    """The best total weight of a connected set of n edges (exact) or of at most n, by enumeration."""
    best = -np.inf
    for size in ([n] if exact else range(n + 1)):
        for kept in itertools.combinations(range(len(eg.src)), size):
            if connected(eg, list(kept), connectivity):
                best = max(best, float(w[list(kept)].sum()))
    return best


def random_graph(seed: int, n_nodes: int = 5) -> EdgeGraph:
    """A random DAG: node i reads column i - 1 (column n_nodes - 1 is the logits); node 0 is the embedding.
    Each node u writes to each later column with probability 0.6 (and always to the logits)."""
    rng = np.random.default_rng(seed)
    readers = tuple((c + 1,) for c in range(n_nodes - 1)) + ((),)
    src, dst = [], []
    for u in range(n_nodes):
        for c in range(max(u, 0), n_nodes):  # column c is read by node c + 1 > u
            if c == n_nodes - 1 or rng.random() < 0.6:
                src.append(u)
                dst.append(c)
    return EdgeGraph(n_nodes, np.array(src), np.array(dst), readers)


def model_graph(*shape) -> tuple[Graph, EdgeGraph, torch.Tensor]:
    g = Graph(*shape)
    valid = g.edge_mask()
    return g, edge_graph(g, valid), valid


@pytest.mark.parametrize("connectivity", ["path", "input"])
def test_ip_is_optimal_and_connected_by_brute_force_on_random_graphs(connectivity):
    for seed in range(6):
        eg = random_graph(seed)
        w = np.random.default_rng(100 + seed).exponential(size=len(eg.src)) ** 2  # heavy tail: top-k disconnects
        for n in range(1, min(6, len(eg.src)) + 1):
            best = brute_force(eg, w, n, connectivity)
            if best == -np.inf:  # no connected set of n edges in this small graph: a clear error
                with pytest.raises(UserError, match=f"no set of {n} edges is connected"):
                    solve_edge_ip(eg, w, n, connectivity=connectivity)
                continue
            kept, info = solve_edge_ip(eg, w, n, connectivity=connectivity)
            chosen = np.flatnonzero(kept).tolist()
            assert len(chosen) == n  # the budget, exactly (|score| weights)
            assert connected(eg, chosen, connectivity)
            assert info["objective"] == pytest.approx(best, rel=MIP_REL_GAP)  # HiGHS stops within 1e-4
            assert info["status"] == 0 and info["gap"] <= 1e-4  # every edge a candidate: exact


def test_ip_on_a_gqa_model_graph_matches_brute_force_over_every_subset():
    """1 layer, 2 query heads sharing one KV head: an edge into the shared K input is useful when
    either head is active. 11 edges: all 2^11 subsets."""
    _, eg, _ = model_graph(1, 2, 1, False)
    assert len(eg.src) == 11 and eg.readers[2] == (1, 2)  # the K input is read by both heads
    w = np.random.default_rng(0).exponential(size=11) ** 3
    for connectivity in ("path", "input"):
        for n in range(0, 12):
            kept, info = solve_edge_ip(eg, w, n, connectivity=connectivity)
            assert kept.sum() == n and connected(eg, np.flatnonzero(kept).tolist(), connectivity)
            assert info["objective"] == pytest.approx(brute_force(eg, w, n, connectivity), rel=MIP_REL_GAP)


def test_ip_with_signed_weights_keeps_at_most_the_budget_and_never_a_useless_negative_edge():
    _, eg, _ = model_graph(2, 1, 1, False)  # 23 edges
    w = np.random.default_rng(3).normal(size=len(eg.src))
    for n in (1, 2, 4):
        kept, info = solve_edge_ip(eg, w, n, exact=False)
        chosen = np.flatnonzero(kept).tolist()
        assert len(chosen) <= n and connected(eg, chosen, "path")
        assert info["objective"] == pytest.approx(brute_force(eg, w, n, "path", exact=False), rel=MIP_REL_GAP, abs=1e-9)


def test_ip_pays_for_a_weak_edge_that_connects_a_strong_one():
    """Edges: embedding -> node 1 (0.1), embedding -> logits (1), node 1 -> logits (10). The top 2 by
    weight (10 and 1) leave node 1 without an input; the IP keeps 10 + 0.1."""
    readers = ((1,), ())  # column 0 is node 1's input, column 1 the logits
    eg = EdgeGraph(2, np.array([0, 0, 1]), np.array([0, 1, 1]), readers)
    w = np.array([0.1, 1.0, 10.0])
    top = np.argsort(-w)[:2].tolist()
    assert not connected(eg, top, "path")
    kept, info = solve_edge_ip(eg, w, 2)
    assert kept.tolist() == [True, False, True] and info["objective"] == pytest.approx(10.1)


def test_candidate_route_keeps_the_budget_and_connectivity_and_bounds_its_gap():
    """Forcing the IP over candidate edges (as on a real model when the relaxation is fractional)."""
    g, eg, valid = model_graph(3, 4, 2, False)
    rng = np.random.default_rng(7)
    w = rng.exponential(size=len(eg.src)) ** 4
    for n in (3, 8, 20):
        kept, info = solve_edge_ip(eg, w, n, min_candidates=0)
        chosen = np.flatnonzero(kept).tolist()
        assert len(chosen) == n and connected(eg, chosen, "path")
        assert info["objective"] <= info["bound"] * (1 + 1e-9) and info["gap"] >= -1e-9
        assert info["method"] in ("lp", "candidates")


def test_ip_selector_masks_cover_valid_edges_only_and_match_the_solver():
    g, eg, valid = model_graph(2, 2, 1, False)
    scores = torch.randn(valid.shape, generator=torch.Generator().manual_seed(0))
    sel = IPSelector(scores, valid, g, time_limit_s=30)
    for n in (0, 5, 12, int(valid.sum())):
        mask = sel(n)
        assert mask.shape == valid.shape and int(mask.sum()) == n and not (mask & ~valid).any()
        assert connected(eg, [i for i, (u, v) in enumerate(zip(eg.src, eg.dst, strict=True)) if mask[u, v]], "path")
    assert torch.equal(sel(5), sel(5)) and set(sel.solves) == {5, 12}  # remembered; 0 and all need no solve
    assert float(scores.abs()[sel(12)].sum()) == pytest.approx(sel.solves[12]["objective"], rel=1e-6)
    signed = IPSelector(scores, valid, g, rank_by="signed")(12)  # at most 12, positive edges only pay
    assert int(signed.sum()) <= 12 and float(scores[signed].sum()) >= float(scores[sel(12)].sum())


def test_on_path_marks_the_edges_on_a_kept_path_from_embedding_to_logits():
    rng = np.random.default_rng(5)
    graphs = [random_graph(seed, 6) for seed in range(4)] + [model_graph(2, 2, 1, False)[1]]
    for eg in graphs:
        for _ in range(30):
            kept = rng.random(len(eg.src)) < rng.uniform(0.1, 0.7)
            chosen = np.flatnonzero(kept).tolist()
            fwd, back = reached(eg, chosen), coreached(eg, chosen)
            expect = [bool(kept[e]) and eg.src[e] in fwd
                      and (not eg.readers[eg.dst[e]] or bool(set(eg.readers[eg.dst[e]]) & back))
                      for e in range(len(eg.src))]
            assert on_path(eg, kept).tolist() == expect
            assert bool(on_path(eg, kept).sum() == kept.sum()) == connected(eg, chosen, "path")


def test_positive_rule_keeps_only_positive_scores_best_first():
    scores = torch.tensor([[3.0, -5.0, 0.0, 1.0], [0.5, 2.0, -0.1, 9.0]])
    assert positive_select(scores, 2).tolist() == [[True, False, False, False], [False, False, False, True]]
    five = positive_select(scores, 5)  # only 5 positive: all of them, never the -5 that |score| would keep
    assert int(five.sum()) == 5 and not five[scores <= 0].any()
    assert int(positive_select(scores, 8).sum()) == 5  # fewer than asked when fewer are positive
    assert not five.equal(keep_top(scores, 5, "abs"))
    valid = torch.ones_like(scores, dtype=torch.bool)
    valid[1, 3] = False
    assert positive_select(scores, 1, valid).tolist() == [[True, False, False, False], [False] * 4]


@functools.cache
def tiny_setup():
    from circuitkit.discovery.attribution import attribute
    from circuitkit.discovery.config import DataParams
    from circuitkit.discovery.tasks import build_task
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model

    lm = load_model(ModelConfig(name="builtin:tiny-llama", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16), 10, 0)
    return lm, data, attribute(lm.adapter, data[:5], "eap-ig", "edge", ig_steps=2, batch_size=5, progress=False)


def test_prune_selects_by_the_ip_and_by_sign_on_a_tiny_model(caplog):
    from circuitkit.discovery.config import PruningConfig
    from circuitkit.discovery.pruning.heads import prune

    lm, data, scores = tiny_setup()
    g, valid = scores.graph, scores.graph.edge_mask()
    eg = edge_graph(g, valid)
    p = PruningConfig(scope="edges", target_sparsity=0.9, selection="ip", graph=False, bootstrap_resamples=0)
    found = prune(lm.adapter, scores, data[:5], data[5:], p, "logit_diff", 5)
    mask = found.selection.mask
    n = int(mask.sum())
    assert found.extra["selection"] == "ip" and n == int(valid.sum()) - round(0.9 * int(valid.sum()))
    assert connected(eg, [i for i, (u, v) in enumerate(zip(eg.src, eg.dst, strict=True)) if mask[u, v]], "path")
    assert float(scores.edges.abs()[mask].sum()) <= float(scores.edges.abs()[keep_top(scores.edges, n, "abs", valid)].sum())
    heads = prune(lm.adapter, scores, data[:5], data[5:], PruningConfig(selection="ip", graph=False,
                                                                         bootstrap_resamples=0), "logit_diff", 5)
    assert heads.extra["selection"] == "top_k" and "every head set is connected" in caplog.text
    pos = prune(lm.adapter, scores, data[:5], data[5:], PruningConfig(selection="positive", target_sparsity=0.5,
                                                                       graph=False, bootstrap_resamples=0),
                "logit_diff", 5)
    kept = pos.selection.mask
    assert not kept[scores.head <= 0].any() and pos.extra["selection"] == "positive"
    assert int(kept.sum()) == min(int((scores.head > 0).sum()), scores.head.numel() - round(0.5 * scores.head.numel()))
    assert pos.selection.n_removed == scores.head.numel() - int(kept.sum())


def test_ip_keys_compose_and_are_checked():
    from circuitkit.core.config import ConfigError
    from circuitkit_app.config import compose

    _, cfg = compose(["pruning.scope=edges", "pruning.selection=ip", "pruning.ip_connectivity=input",
                      "pruning.ip_time_limit_s=5"])
    p = cfg.pruning
    assert (p.selection, p.ip_connectivity, p.ip_time_limit_s) == ("ip", "input", 5.0)
    for bad, key in (("pruning.ip_connectivity=all", "pruning.ip_connectivity"),
                     ("pruning.ip_time_limit_s=0", "pruning.ip_time_limit_s"),
                     ("pruning.selection=ilp", "pruning.selection")):
        with pytest.raises(ConfigError, match=key):
            compose([bad])


def test_a_solver_failure_is_an_error_that_names_the_key(monkeypatch):
    import scipy.optimize

    class Failed:
        x, status, message, fun = None, 1, "Time limit reached", None
    monkeypatch.setattr(scipy.optimize, "milp", lambda *a, **k: Failed())
    _, eg, _ = model_graph(1, 2, 1, False)
    with pytest.raises(UserError, match="pruning.ip_time_limit_s=2"):
        solve_edge_ip(eg, np.ones(11), 3, time_limit_s=2)
