"""The circuit as a picture (circuitkit.discovery.circuit_graph): what is drawn, the files, the stage and CLI."""

from __future__ import annotations

import pytest
import torch

from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import save_circuit
from circuitkit.discovery.circuit_graph import build_picture, draw_matplotlib, to_dot, write_circuit_graph


def _circuit(g: Graph, scope: str = "heads", seed: int = 0, edges: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    exists = g.edge_mask()
    head_mask = torch.zeros(g.n_layers, g.n_heads, dtype=torch.bool)
    head_mask[0, 2] = head_mask[1, 1] = head_mask[-1, 0] = True
    c = {"model_name": "m", "scope": scope, "head_mask": head_mask,
         "head_scores": torch.randn(g.n_layers, g.n_heads, generator=gen), "mlp_scores": torch.randn(g.n_layers),
         "embed_score": torch.tensor(1.0), "edge_scores": (torch.randn(exists.shape, generator=gen) * exists)
         if edges else None, "metrics": {"faithfulness": 0.9},
         "graph": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                   "parallel_residual": g.parallel_residual}}
    if scope == "edges":
        c["edge_mask"] = (c["edge_scores"].abs() > 1.5) & exists
    return c


def _oracle_head_scope(c: dict, g: Graph, n: int) -> set[tuple[str, str, str]]:
    """Top-n edges among kept nodes, computed edge by edge from the names (no GQA)."""
    kept = {"input", "logits", *(f"m{la}" for la in range(g.n_layers)),
            *(f"a{la}.h{h}" for la, h in c["head_mask"].nonzero().tolist())}
    found = []
    for u, parent in enumerate(g.upstream):
        for v, child_name in enumerate(g.downstream):
            if not g.edge_mask()[u, v] or parent not in kept:
                continue
            child = child_name.split("<")[0].replace(".g", ".h")
            letter = child_name[-2] if child_name.startswith("a") else ""
            if child in kept:
                found.append((abs(float(c["edge_scores"][u, v])), (parent, child, letter)))
    return {e for _, e in sorted(found, reverse=True)[:n]}


def test_head_scope_draws_the_strongest_edges_among_kept_nodes() -> None:
    g = Graph(3, 4, 4, False)
    c = _circuit(g)
    pic = build_picture(c, top_edges=12)
    assert len(pic.edges) == 12
    assert {e[:3] for e in pic.edges} == _oracle_head_scope(c, g, 12)
    assert {"a0.h2", "a1.h1", "a2.h0", "input", "logits"} <= set(pic.nodes)
    assert "a0.h0" not in pic.nodes  # removed heads are not drawn
    assert pic.nodes["a1.h1"][:2] == (1.0, 2.0)  # column = head index, row = layer + 1
    assert "faithfulness 0.900" in pic.title


def test_edge_scope_draws_only_kept_edges_and_kv_groups_fan_out() -> None:
    g = Graph(2, 4, 2, False)  # GQA: a KV group's input feeds two query heads
    c = _circuit(g, "edges", seed=3)
    c["head_mask"] = torch.ones(2, 4, dtype=torch.bool)
    pic = build_picture(c, top_edges=1000)
    kept = c["edge_mask"]
    expected = 0
    for _u, v in kept.nonzero().tolist():
        down = g.downstream[v]
        expected += 2 if ("<k>" in down or "<v>" in down) else 1
    assert len(pic.edges) == expected
    k_edges = [e for e in pic.edges if e[2] == "k"]
    for parent, child, _, score in k_edges:  # both heads of the group carry the group's score
        layer, head = child[1:].split(".h")
        twin = f"a{layer}.h{int(head) ^ 1}"
        assert (parent, twin, "k", score) in pic.edges


def test_node_level_circuit_has_nodes_and_says_why_no_edges() -> None:
    pic = build_picture(_circuit(Graph(2, 4, 4, False), edges=False))
    assert pic.edges == [] and "no edges" in pic.note
    assert set(pic.nodes) == {"input", "logits", "a0.h2", "a1.h1", "a1.h0"}


def test_files_png_and_svg_and_dot(tmp_path) -> None:
    g = Graph(12, 12, 12, False)  # GPT-2-small shape: 144 heads
    c = _circuit(g)
    c["head_mask"] = torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) > 0.7
    files = write_circuit_graph(c, tmp_path / "circuit_graph.png", top_edges=30, backend="matplotlib")
    assert [f.name for f in files] == ["circuit_graph.png", "circuit_graph.svg"]
    png = (tmp_path / "circuit_graph.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    svg = (tmp_path / "circuit_graph.svg").read_text()
    assert "<svg" in svg and "logits" in svg and "k input" in svg  # legend
    dot = to_dot(build_picture(c, 30))
    assert dot.count(" -> ") == 30 and "rank=same" in dot and "style=dashed" in dot
    with pytest.raises(ValueError, match="graph backend"):
        write_circuit_graph(c, tmp_path / "x.png", backend="tikz")
    assert draw_matplotlib(build_picture(c, 5), [tmp_path / "only.svg"])[0].read_text().startswith("<?xml")


def test_induction_circuit_picture_shows_the_known_circuit(tmp_path, induction_model_dir) -> None:
    """On the trained induction model the three strongest edges drawn are the known chain:
    the copied token into the previous-token head's value, its K-composition with the induction
    head, the induction head's write to the logits (EAP-IG m=5; with m=1 the chain is still the
    top 3 edges here but the order shifts). And the stage writes the picture."""
    from circuitkit.discovery.circuit import load_circuit
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    info = __import__("json").loads((induction_model_dir / "fixture_info.json").read_text())
    prev, ind = info["prev_token_head"], info["induction_head"]
    _, cfg = compose(["model=induction", "stages=[data,attribution,pruning]", "discovery.level=edge",
                      "discovery.ig_steps=5", "discovery.data_params.num_examples=8",
                      "discovery.data_params.eval_examples=4", "discovery.data_params.seq_len=64",
                      "pruning.target_sparsity=0.75", "pruning.graph_top_edges=8"])
    manifest = run_pipeline(cfg, tmp_path / "run")
    assert {"circuit_graph.png", "circuit_graph.svg"} <= set(manifest["stages"]["pruning"]["artifacts"])
    pic = build_picture(load_circuit(tmp_path / "run" / "circuit.pt"), top_edges=3)
    assert {e[:3] for e in pic.edges} == {("input", f"a0.h{prev[1]}", "v"), (f"a0.h{prev[1]}", f"a1.h{ind[1]}", "k"),
                                          (f"a1.h{ind[1]}", "logits", "")}
    assert all(e[3] > 0 for e in pic.edges)


def test_show_graph_cli(tmp_path, capsys) -> None:
    from circuitkit_app.cli import main

    c = _circuit(Graph(2, 4, 4, False))
    save_circuit(tmp_path / "c.pt", {**c, "ablation": "zero", "rank_by": "abs", "target_sparsity": 0.6,
                                     "achieved_sparsity": 0.6})
    assert main(["show", str(tmp_path / "c.pt"), "--graph", str(tmp_path / "g.svg"), "--top-edges", "5"]) == 0
    assert (tmp_path / "g.svg").read_text().count("a1.h1") >= 1
    assert main(["show", str(tmp_path / "c.pt"), "--graph", str(tmp_path / "g.gif")]) == 2
    assert ".png or .svg" in capsys.readouterr().err
