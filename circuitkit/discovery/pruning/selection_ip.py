"""Selection by integer programming (`pruning.selection: ip`) and by sign (`pruning.selection: positive`).

**ip** (an idea of the BlackboxNLP 2025 MIB shared task: choose the circuit as the solution of
an integer program instead of a ranking). For a budget of n edges, solve

    maximize    Σ_e w_e x_e                      w_e = |s_e| (rank_by=abs) or s_e (rank_by=signed)
    subject to  Σ_e x_e = n                      (rank_by=signed: <= n, a negative edge is never forced in)
                x_e <= y_src(e)                  an edge leaves the embedding or an active node
                y_u <= Σ_{e into u} x_e          a node is active only with a kept edge into one of its
                                                 inputs (a head's Q, K or V input, an MLP's input)
                x_e <= Σ_{r reads dst(e)} y_r    (connectivity=path) an edge enters an input that an
                                                 active node reads, or the logits
                y_u <= Σ_{e out of u} x_e        (connectivity=path) an active node has a kept edge out
                x_e, y_u in {0, 1}

over the existing edges e = u -> v (x_e = 1: kept) and the heads and MLPs u (y_u = 1: active);
the embedding is always active. A K or V input of a GQA layer is read by every query head of
its KV group. With connectivity=path the kept edges are exactly the sets in which every kept
edge lies on a kept path from the embedding to the logits: under counterfactual ablation an
edge out of a node with no kept input carries nothing (the node computes its corrupted value)
and so does an edge into an input that no kept path leaves, so the IP spends the budget on
edges that can act. connectivity=input keeps only the first two constraints (every kept edge's
source is reachable from the embedding).

Solved by HiGHS through `scipy.optimize.milp`, per size: first the LP relaxation (x, y in
[0, 1]) over every edge; when its solution is integral it is the IP's optimum (on SmolLM2 from
a few hundred edges up). Otherwise the IP is solved over candidate edges: the relaxation's
support, the max(4n, 2000) largest weights, and every edge out of the embedding and into the
logits (with those, every size has a connected circuit); the relaxation's value over every
edge bounds how far that circuit can be from the optimum (`info["gap"]`, logged; an upper
bound on the distance: when every edge is a candidate the solve is exact). Each size
stops at `time_limit_s`; a stopped solve with a circuit uses it (and logs the gap), one
without is an error.

At head scope the IP is top-k: every head reads the embedding and writes to the logits through
the residual stream, so every head set is connected and the optimum is the n largest weights
(`pruning.prune` selects top_k there).

**positive** (the signed rule): keep the n heads or edges of highest signed score among those
with a positive score only; when fewer than n are positive the circuit is smaller than asked.
Negative components (IOI's negative name movers, Wang et al. 2023) push against the answer,
so a circuit without them can exceed the model's metric: the rule aims at CPR (which rewards
f above 1) rather than CMD, which the |score| ranking (`keep_top`, as in MIB) aims at by
keeping both signs. Measured in docs/benchmarks.md: it overshoots on IOI and fails
on induction's edges, so it is an option, not the default.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from circuitkit.core.errors import UserError
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.pruning.selection import keep_top

log = logging.getLogger(__name__)
IP_CONNECTIVITY = ("path", "input")
MIP_REL_GAP = 1e-4
MIN_CANDIDATES = 2000  # edges the IP keeps as candidates when its relaxation is fractional


def positive_select(scores: torch.Tensor, n_keep: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask (shape of `scores`) of the `n_keep` highest signed scores among the positive ones."""
    positive = scores > 0
    return keep_top(scores, n_keep, "signed", positive if valid is None else positive & valid)


@dataclass(frozen=True)
class EdgeGraph:
    """A DAG of nodes and their inputs, as the IP sees it.

    Node 0 is the embedding (always active); edge e runs from node `src[e]` into input column
    `dst[e]`; `readers[c]` lists the nodes that read column c (empty: the logits, a sink).
    Nodes are numbered so that an edge's source comes before its column's readers.
    """

    n_nodes: int
    src: np.ndarray  # (E,) int
    dst: np.ndarray  # (E,) int
    readers: tuple[tuple[int, ...], ...]  # per column


def edge_graph(graph: Graph, valid: torch.Tensor) -> EdgeGraph:
    """The model graph's existing edges (`valid`, (n_upstream, n_downstream), row-major order)."""
    group = graph.n_heads // graph.n_kv_heads  # query heads per KV head (repeat_kv order)
    readers: list[tuple[int, ...]] = []
    for layer in range(graph.n_layers):
        heads = [graph.head_index(layer, h) for h in range(graph.n_heads)]
        readers += [(node,) for node in heads]  # Q inputs
        kv = [tuple(heads[g * group:(g + 1) * group]) for g in range(graph.n_kv_heads)]
        readers += kv + kv  # K inputs, V inputs
        readers.append((graph.mlp_index(layer),))
    readers.append(())  # logits
    src, dst = valid.nonzero(as_tuple=True)
    return EdgeGraph(len(graph.upstream), src.numpy(), dst.numpy(), tuple(readers))


def on_path(eg: EdgeGraph, kept: np.ndarray) -> np.ndarray:
    """(E,) bool: the kept edges that lie on a kept path from the embedding to the logits.

    The others are inert under counterfactual ablation (see the module docstring): a top-k
    circuit's edges minus these are what it spends on nothing.
    """
    kept = np.asarray(kept, dtype=bool)
    n_cols = len(eg.readers)
    into: list[list[int]] = [[] for _ in range(eg.n_nodes)]
    for c, who in enumerate(eg.readers):
        for node in who:
            into[node].append(c)
    edge_col = [np.flatnonzero(kept & (eg.dst == c)) for c in range(n_cols)]
    reached = np.zeros(eg.n_nodes, dtype=bool)
    reached[0] = True
    for u in range(1, eg.n_nodes):  # sources come before readers: one pass in node order
        reached[u] = any(reached[eg.src[edge_col[c]]].any() for c in into[u])
    live = np.array([not who for who in eg.readers])  # a column some forward path continues from
    alive = np.zeros(eg.n_nodes, dtype=bool)
    for u in range(eg.n_nodes - 1, -1, -1):  # readers come after sources: one pass backwards
        out = np.flatnonzero(kept & (eg.src == u))
        alive[u] = bool(live[eg.dst[out]].any())
        for c in into[u]:
            live[c] = live[c] or alive[u]
    return kept & reached[eg.src] & live[eg.dst]


def ip_constraints(eg: EdgeGraph, connectivity: str = "path"):
    """The IP's connectivity rows as a sparse (rows, E + n_nodes - 1) matrix A with A @ [x; y] <= 0."""
    from scipy.sparse import coo_matrix

    if connectivity not in IP_CONNECTIVITY:
        raise ValueError(f"connectivity={connectivity!r}; allowed: {', '.join(IP_CONNECTIVITY)}")
    n_edges = len(eg.src)
    y = lambda node: n_edges + node - 1  # noqa: E731  (column of node's y; node 0 has none)
    rows, cols, vals = [], [], []
    r = 0

    def row(entries):
        nonlocal r
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        r += 1

    for e in range(n_edges):  # x_e <= y_src
        if eg.src[e] != 0:
            row([(e, 1.0), (y(int(eg.src[e])), -1.0)])
    edges_into: list[list[int]] = [[] for _ in range(eg.n_nodes)]
    for e in range(n_edges):
        for node in eg.readers[eg.dst[e]]:
            edges_into[node].append(e)
    for node in range(1, eg.n_nodes):  # y_u <= Σ edges into u's inputs
        row([(y(node), 1.0), *((e, -1.0) for e in edges_into[node])])
    if connectivity == "path":
        for e in range(n_edges):  # x_e <= Σ readers of its input (none: the logits, always read)
            who = eg.readers[eg.dst[e]]
            if who:
                row([(e, 1.0), *((y(node), -1.0) for node in who)])
        edges_out: list[list[int]] = [[] for _ in range(eg.n_nodes)]
        for e in range(n_edges):
            edges_out[int(eg.src[e])].append(e)
        for node in range(1, eg.n_nodes):  # y_u <= Σ edges out of u
            row([(y(node), 1.0), *((e, -1.0) for e in edges_out[node])])
    return coo_matrix((vals, (rows, cols)), shape=(r, n_edges + eg.n_nodes - 1)).tocsr()


def _milp(eg: EdgeGraph, weights: np.ndarray, n_keep: int, exact: bool, a, integral: bool,
          time_limit_s: float):
    """One HiGHS solve (relaxed when not `integral`) of the IP over all of `eg`'s edges."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, vstack

    n_edges, n_vars = len(eg.src), a.shape[1]
    budget = csr_matrix((np.ones(n_edges), (np.zeros(n_edges, dtype=int), np.arange(n_edges))), shape=(1, n_vars))
    c = np.zeros(n_vars)
    c[:n_edges] = -weights
    lower = np.concatenate([np.full(a.shape[0], -np.inf), [n_keep if exact else 0]])
    upper = np.concatenate([np.zeros(a.shape[0]), [n_keep]])
    # HiGHS' MIP presolve spends minutes (past its time limit) on the 70k-edge graphs of a real
    # model before its first LP; the root LP without it takes seconds.
    return milp(c, integrality=np.full(n_vars, 1 if integral else 0), bounds=Bounds(0, 1),
                constraints=LinearConstraint(vstack([a, budget]).tocsr(), lower, upper),
                options={"time_limit": time_limit_s, "mip_rel_gap": MIP_REL_GAP, "presolve": not integral,
                         "disp": False})


def _sub_graph(eg: EdgeGraph, edges: np.ndarray) -> EdgeGraph:
    return EdgeGraph(eg.n_nodes, eg.src[edges], eg.dst[edges], eg.readers)


def solve_edge_ip(eg: EdgeGraph, weights: np.ndarray, n_keep: int, exact: bool = True, connectivity: str = "path",
                  time_limit_s: float = 60.0, constraints=None,
                  min_candidates: int = MIN_CANDIDATES) -> tuple[np.ndarray, dict]:
    """(kept (E,) bool, info) maximizing Σ weights over kept edges with Σ kept = n_keep (exact) or <= n_keep.

    First the LP relaxation over every edge: when its solution is integral it is the IP's
    optimum. Otherwise the IP is solved over the candidate edges (the relaxation's support, the
    max(4 n_keep, min_candidates) largest weights, every edge out of the embedding and into the
    logits: with those any size is feasible), and the relaxation's value bounds the gap to the
    optimum over every edge (HiGHS' own bound when every edge is a candidate). `constraints`: `ip_constraints(eg, connectivity)`, built once by
    callers that solve several sizes. info: status (0 = optimal; 1 = stopped at the time
    limit), method (lp / candidates), n_candidates, objective and bound (in `weights`' units),
    gap (relative, against the bound), wall_s.
    """
    n_edges = len(eg.src)
    if not 0 <= n_keep <= n_edges:
        raise ValueError(f"n_keep={n_keep} must be in [0, {n_edges}]")
    a = ip_constraints(eg, connectivity) if constraints is None else constraints
    scale = float(np.abs(weights).max()) or 1.0  # HiGHS' tolerances are absolute: weights of order 1
    w = np.asarray(weights, dtype=np.float64) / scale
    t = time.perf_counter()
    fix = (f"within pruning.ip_time_limit_s={time_limit_s:g} s. Raise pruning.ip_time_limit_s, or choose"
           " pruning.selection=top_k.")
    lp = _milp(eg, w, n_keep, exact, a, False, time_limit_s)
    if lp.status == 2:
        raise UserError(f"pruning.selection=ip: no set of {n_keep} edges is connected"
                        f" (pruning.ip_connectivity={connectivity}) in this graph.")
    if lp.x is None:
        raise UserError(f"pruning.selection=ip: HiGHS solved no relaxation for {n_keep} edges (status {lp.status}:"
                        f" {lp.message}) {fix}")
    bound = float(-lp.fun)
    x = lp.x[:n_edges]
    if np.all(np.minimum(x, 1 - x) < 1e-6) and lp.status == 0:
        kept, status, method, n_cand, value = x > 0.5, 0, "lp", n_edges, bound
    else:
        sink = np.array([not eg.readers[c] for c in eg.dst])
        cand = (x > 1e-9) | (eg.src == 0) | sink
        cand[np.argsort(-w, kind="stable")[:max(4 * n_keep, min_candidates)]] = True
        idx = np.flatnonzero(cand)
        sub = _sub_graph(eg, idx)
        left = max(1.0, time_limit_s - (time.perf_counter() - t))
        res = _milp(sub, w[idx], n_keep, exact, ip_constraints(sub, connectivity), True, left)
        if res.x is None:
            raise UserError(f"pruning.selection=ip: HiGHS found no circuit of {n_keep} edges among {len(idx)}"
                            f" candidates (status {res.status}: {res.message}) {fix}")
        kept = np.zeros(n_edges, dtype=bool)
        kept[idx[res.x[:len(idx)] > 0.5]] = True
        status, method, n_cand, value = int(res.status), "candidates", len(idx), float(-res.fun)
        if len(idx) == n_edges and getattr(res, "mip_dual_bound", None) is not None:
            bound = min(bound, float(-res.mip_dual_bound))  # every edge a candidate: HiGHS' own bound
    value = float(w[kept].sum())  # the kept set's own total, not the solver's rounded one
    gap = max(0.0, bound - value) / max(abs(bound), 1e-12)
    info = {"status": status, "method": method, "n_candidates": n_cand, "objective": value * scale,
            "bound": bound * scale, "gap": gap, "wall_s": time.perf_counter() - t}
    if status != 0:
        log.warning("pruning.selection=ip: the solve for %d edges stopped at pruning.ip_time_limit_s=%g s,"
                    " %.2g%% below the relaxation's bound; using its best circuit.", n_keep, time_limit_s, 100 * gap)
    return kept, info


class IPSelector:
    """The IP's circuit at any size n, `selector(n)` -> (n_upstream, n_downstream) bool mask.

    The connectivity rows are built once; each size is one solve, remembered. `solves` keeps
    each size's info (status, objective, gap, wall_s).
    """

    def __init__(self, edge_scores: torch.Tensor, valid: torch.Tensor, graph: Graph, rank_by: str = "abs",
                 connectivity: str = "path", time_limit_s: float = 60.0) -> None:
        self.valid, self.rank_by, self.connectivity, self.time_limit_s = valid, rank_by, connectivity, time_limit_s
        self.eg = edge_graph(graph, valid)
        s = edge_scores.float()[valid].numpy().astype(np.float64)  # row-major, as edge_graph's edges
        self.weights = np.abs(s) if rank_by == "abs" else s
        self.constraints = ip_constraints(self.eg, connectivity)
        self.solves: dict[int, dict] = {}
        self._masks: dict[int, torch.Tensor] = {}

    def __call__(self, n_keep: int) -> torch.Tensor:
        if n_keep not in self._masks:
            mask = torch.zeros(self.valid.shape, dtype=torch.bool)
            n_edges = len(self.eg.src)
            if n_keep >= n_edges and self.rank_by == "abs":
                mask = self.valid.clone()  # every edge: connected, and the only set of that size
            elif n_keep > 0:
                kept, info = solve_edge_ip(self.eg, self.weights, n_keep, self.rank_by == "abs", self.connectivity,
                                           self.time_limit_s, self.constraints)
                mask[self.eg.src[kept], self.eg.dst[kept]] = True
                self.solves[n_keep] = info
            self._masks[n_keep] = mask
        return self._masks[n_keep].clone()
