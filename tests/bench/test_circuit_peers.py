"""scripts/peers/circuit_peers.py: auto-circuit's names mapped onto ours, score agreement, a quick run."""

from __future__ import annotations

import pytest

from circuitkit.discovery.attribution.graph import Graph
from scripts.peers import circuit_peers
from scripts.peers.worker_autocircuit import node_of_residual_edge, our_downstream, our_upstream


def test_autocircuit_names_map_onto_every_edge_of_our_graph():
    L, H = 3, 4
    heads = [f"A{layer}.{h}" for layer in range(L) for h in range(H)]
    srcs = ["Resid Start", *heads, *[f"MLP {i}" for i in range(L)]]
    dests = ([f"A{layer}.{h}.{x}" for layer in range(L) for h in range(H) for x in "QKV"]
             + [f"MLP {i}" for i in range(L)] + ["Resid End"])
    g = Graph(L, H, H, parallel_residual=False)
    assert sorted(map(our_upstream, srcs)) == sorted(g.upstream)
    assert sorted(map(our_downstream, dests)) == sorted(g.downstream)
    assert our_downstream("A2.3.K") == "a2.g3<k>" and our_downstream("A0.1.Q") == "a0.h1<q>"
    with pytest.raises(ValueError, match="Resid Mid 0"):
        our_upstream("Resid Mid 0")


def test_only_node_output_edges_of_the_residual_graph_carry_node_scores():
    assert node_of_residual_edge("A1.2", "Resid Mid 1") == ("head", 1, 2)
    assert node_of_residual_edge("MLP 0", "Resid Post 0") == ("mlp", 0, 0)
    assert node_of_residual_edge("MLP 2", "Resid End") == ("mlp", 2, 0)
    assert node_of_residual_edge("Resid Post 0", "Resid Mid 1") is None  # the skip path
    assert node_of_residual_edge("A1.2", "Resid Mid 2") is None


def test_score_agreement_on_nodes_and_common_edges():
    ours = {"head": [[1.0, 2.0], [3.0, 4.0]], "mlp": [5.0, 6.0],
            "edges": [("input", "m0<in>", 1.0), ("a0.h0", "m0<in>", 2.0), ("a0.h1", "logits", 3.0)]}
    theirs = {"head": [[2.0, 4.0], [6.0, 8.0]], "mlp": [10.0, 9.0],  # ranks: last two swapped
              "edges": [("input", "m0<in>", 1.0), ("a0.h0", "m0<in>", 2.5), ("m0", "logits", 9.0)]}
    a = circuit_peers.score_agreement(ours, theirs)
    assert a["spearman_nodes"] == pytest.approx(1 - 6 * 2 / (6 * 35))  # one adjacent swap among 6
    assert a["max_rel_diff_nodes"] == pytest.approx(5.0 / 6.0)  # MLP 0: 10 vs 5, over our max 6
    assert a["n_edges_compared"] == 2 and a["n_edges_only_ours"] == 1 and a["n_edges_only_theirs"] == 1
    assert a["spearman_edges"] == pytest.approx(1.0)


def test_a_missing_peer_venv_is_an_error_row_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(circuit_peers, "AUTOCIRCUIT_PYTHON", tmp_path / "missing" / "python")
    out = circuit_peers.measure("auto-circuit", tmp_path, tmp_path / "t", "eap", "node", circuit_peers.QUICK,
                                tmp_path)
    assert "does not exist" in out["error"] and "setup_peers.sh" in out["error"]
    ours = {"seconds": 1.0, "peak_bytes": 1}
    rows = circuit_peers.compare({"circuitkit": ours, "auto-circuit": out}, "eap", "node")
    assert rows[1]["error"] == out["error"] and "spearman_nodes" not in rows[1]


@pytest.mark.slow
def test_quick_run_agrees_with_autocircuit_where_the_methods_coincide(tmp_path):
    if not circuit_peers.AUTOCIRCUIT_PYTHON.is_file():
        pytest.skip(f"{circuit_peers.AUTOCIRCUIT_PYTHON} missing: scripts/peers/setup_peers.sh builds it")
    from rich.console import Console

    result = circuit_peers.run_circuit_peers(tmp_path, Console(quiet=True), quick=True)
    rows = result["rows"]
    assert [r["error"] for r in rows] == [None] * 8
    for level in ("node", "edge"):
        theirs = circuit_peers._pair(rows, "eap", level)[1]
        # EAP is the same quantity in both tools: equal to float32 round-off, not just correlated
        assert theirs["spearman_nodes"] >= 0.999 and theirs["max_rel_diff_nodes"] < 1e-4, theirs
    edge = circuit_peers._pair(rows, "eap", "edge")[1]
    assert edge["n_edges_only_ours"] == 0 and edge["n_edges_only_theirs"] == 0
    assert edge["spearman_edges"] >= 0.999 and edge["max_rel_diff_edges"] < 1e-4, edge
    # EAP-IG interpolates along different paths (see NOTES): correlated, not equal
    assert circuit_peers._pair(rows, "eap-ig", "edge")[1]["spearman_edges"] >= 0.8
