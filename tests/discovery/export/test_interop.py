"""EAP-IG JSON graph export / import (circuitkit.discovery.export.interop) and the BOS token policy."""

from __future__ import annotations

import json

import pytest
import torch

from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import kept_components, load_circuit, save_circuit
from circuitkit.discovery.export.interop import (
    InteropError,
    export_circuit,
    export_file,
    from_eap_ig,
    import_eap_ig,
)
from circuitkit_app.cli import main as cli


def _eap_ig_edge_count(n_layers: int, n_heads: int, parallel: bool) -> int:
    """EAP-IG's Graph.from_model: every earlier node feeds each head's q, k, v, the MLP and the logits."""
    total = 0
    for layer in range(n_layers):
        before_attn = 1 + layer * (n_heads + 1)
        total += before_attn * 3 * n_heads + (before_attn if parallel else before_attn + n_heads)
    return total + 1 + n_layers * (n_heads + 1)


def _random_circuit(g: Graph, scope: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    exists = g.edge_mask()
    scores = torch.randn(exists.shape, generator=gen) * exists
    head_mask = torch.rand(g.n_layers, g.n_heads, generator=gen) > 0.5
    circuit = {"model_name": "m", "scope": scope, "head_mask": head_mask,
               "head_scores": torch.randn(g.n_layers, g.n_heads, generator=gen),
               "mlp_scores": torch.randn(g.n_layers, generator=gen), "embed_score": torch.tensor(0.25),
               "edge_scores": scores, "d_model": 32,
               "graph": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                         "parallel_residual": g.parallel_residual}}
    if scope == "edges":
        kept = (scores.abs() > 1.0) & exists
        circuit["edge_mask"] = kept
        circuit["head_mask"] = torch.tensor([[bool(kept[g.head_index(la, h)].any()) for h in range(g.n_heads)]
                                             for la in range(g.n_layers)])
    return circuit


@pytest.mark.parametrize("n_kv,parallel", [(4, False), (2, False), (4, True)])
def test_export_matches_the_reference_format(n_kv: int, parallel: bool) -> None:
    g = Graph(3, 4, n_kv, parallel)
    circuit = _random_circuit(g, "edges")
    obj = export_circuit(circuit)
    assert obj["cfg"] == {"n_layers": 3, "n_heads": 4, "parallel_attn_mlp": parallel, "d_model": 32,
                          "n_key_value_heads": n_kv, "model_name": "m", "prepend_bos": None,
                          "source": "circuitkit circuit.pt"}
    assert len(obj["edges"]) == _eap_ig_edge_count(3, 4, parallel)
    assert set(obj["nodes"]) == {"input", "logits", "m0", "m1", "m2"} | {f"a{la}.h{h}" for la in range(3)
                                                                         for h in range(4)}
    edges = obj["edges"]
    for name in ("input->a0.h0<q>", "a0.h1->a1.h2<k>", "a1.h3->a2.h0<v>", "m0->a1.h1<q>", "m2->logits",
                 "input->m0", "a2.h3->logits"):
        assert name in edges, name
    assert ("a0.h3->m0" in edges) is (not parallel)  # parallel residual: the MLP reads the layer's input
    assert "a1.h0->a0.h1<q>" not in edges and "a0.h0->a0.h1<q>" not in edges
    # Values: the q edge is ours one-to-one; a KV group's score is shared evenly by its heads.
    up, down = g.upstream.index("a0.h1"), g.downstream.index("a1.h2<q>")
    assert edges["a0.h1->a1.h2<q>"]["score"] == pytest.approx(float(circuit["edge_scores"][up, down]))
    group = 4 // n_kv
    k_col = g.downstream.index(f"a1.g{2 // group}<k>")
    assert edges["a0.h1->a1.h2<k>"]["score"] == pytest.approx(float(circuit["edge_scores"][up, k_col]) / group)
    assert edges["a0.h1->a1.h2<k>"]["in_graph"] == bool(circuit["edge_mask"][up, k_col])
    assert obj["nodes"]["a0.h1"]["score"] == pytest.approx(float(circuit["head_scores"][0, 1]))


@pytest.mark.parametrize("n_kv,scope", [(4, "edges"), (2, "edges"), (4, "heads")])
def test_round_trip_through_json_and_files(tmp_path, n_kv: int, scope: str) -> None:
    g = Graph(2, 4, n_kv, False)
    circuit = _random_circuit(g, scope, seed=1)
    save_circuit(tmp_path / "c.pt", {**circuit, "ablation": "mean", "rank_by": "abs", "target_sparsity": 0.5,
                                     "achieved_sparsity": 0.5})
    export_file(tmp_path / "c.pt", tmp_path / "c.json")
    obj = json.loads((tmp_path / "c.json").read_text())
    back = from_eap_ig(obj)
    assert back["graph"] == g
    assert torch.allclose(back["edge_scores"], circuit["edge_scores"], atol=1e-6)
    heads, mlps = kept_components(circuit)
    assert torch.equal(back["head_mask"], heads) and torch.equal(back["mlp_mask"], mlps)
    assert torch.allclose(back["head_scores"], circuit["head_scores"]) and float(back["embed_score"]) == 0.25
    if scope == "edges":
        assert torch.equal(back["edge_mask"], circuit["edge_mask"])
    else:  # head scope: every edge between nodes in the graph
        up = torch.tensor([n == "input" or n.startswith("m") or bool(heads[int(n[1]), int(n[4])])
                           for n in g.upstream])
        assert torch.equal(back["edge_mask"][:, -1], up)  # every kept node feeds the logits
    # And back to a circuit.pt: same masks and scores, usable as a circuit.
    import_eap_ig(tmp_path / "c.json", tmp_path / "back.pt", model_name="m")
    loaded = load_circuit(tmp_path / "back.pt")
    assert torch.equal(loaded["head_mask"], heads) and torch.equal(kept_components(loaded)[1], mlps)
    assert torch.allclose(loaded["edge_scores"], circuit["edge_scores"], atol=1e-6)
    assert loaded["imported_from"]["format"] == "eap-ig-json"


def test_import_a_hand_written_reference_graph(tmp_path) -> None:
    """A file as the reference writes it for a 2-layer, 4-head model with three edges in the graph."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.capture.sites import restricted_sites

    edges = {"input->a0.h2<v>": {"score": 0.5, "in_graph": True}, "a0.h2->a1.h1<k>": {"score": 2.0, "in_graph": True},
             "a1.h1->logits": {"score": 3.0, "in_graph": True}, "a0.h0->logits": {"score": -0.1, "in_graph": False}}
    nodes = {n: {"in_graph": n in ("input", "a0.h2", "a1.h1", "logits")}
             for n in ["input", "logits", "m0", "m1", *(f"a{la}.h{h}" for la in range(2) for h in range(4))]}
    src = tmp_path / "ref.json"
    src.write_text(json.dumps({"cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 64},
                               "nodes": nodes, "edges": edges}))
    assert cli(["import", str(src), str(tmp_path / "c.pt"), "--model", "builtin:tiny-gpt2"]) == 0
    c = load_circuit(tmp_path / "c.pt")
    assert c["scope"] == "edges" and c["head_mask"].nonzero().tolist() == [[0, 2], [1, 1]]
    assert int(c["edge_mask"].sum()) == 3 and not c["mlp_mask"].any()
    # No node scores in the file: a node's score is the sum of its outgoing edges.
    assert c["head_scores"][0, 2] == 2.0 and c["head_scores"][1, 1] == 3.0 and c["head_scores"][0, 0] == -0.1
    assert float(c["embed_score"]) == 0.5
    lm = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32"), device=torch.device("cpu"))
    sites, _ = restricted_sites(lm.model, lm.adapter, tmp_path / "c.pt", "kept")
    assert [s.name for s in sites] == ["transformer.h.0.attn.c_proj:head2", "transformer.h.1.attn.c_proj:head1"]
    # As scores: a scores.safetensors the pruning stage reads.
    assert cli(["import", str(src), str(tmp_path / "scores.safetensors")]) == 0
    from circuitkit.discovery.attribution import load_scores

    scores = load_scores(tmp_path / "scores.safetensors")
    assert scores.head[1, 1] == 3.0 and scores.edges.shape == (1 + 2 * 5, 2 * (4 + 8 + 1) + 1)


@pytest.mark.parametrize("edge,match", [("a1.h0->a0.h1<q>", "backwards"), ("a0.h9->logits", "does not exist"),
                                        ("input->a0.h0", "does not exist")])
def test_bad_graphs_are_one_clear_error(tmp_path, capsys, edge: str, match: str) -> None:
    obj = {"cfg": {"n_layers": 2, "n_heads": 4}, "nodes": {}, "edges": {edge: {"score": 1.0, "in_graph": True}}}
    with pytest.raises(InteropError, match=match):
        from_eap_ig(obj)
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(obj))
    assert cli(["import", str(src), str(tmp_path / "c.pt")]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "c.pt").exists()


def test_pipeline_circuit_exports_with_its_token_policy(tmp_path) -> None:
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["stages=[data,attribution,pruning]", "model.precision=float32", "discovery.level=edge",
                      "discovery.ig_steps=1", "discovery.data_params.num_examples=4",
                      "discovery.data_params.eval_examples=2", "discovery.data_params.seq_len=16",
                      "pruning.scope=edges", "pruning.target_sparsity=0.9", "pruning.graph=false"])
    run_pipeline(cfg, tmp_path / "run")
    circuit = load_circuit(tmp_path / "run" / "circuit.pt")
    assert circuit["prepend_bos"] is True and circuit["d_model"] == 64
    assert cli(["export", str(tmp_path / "run" / "circuit.pt"), str(tmp_path / "c.json")]) == 0
    obj = json.loads((tmp_path / "c.json").read_text())
    assert obj["cfg"]["prepend_bos"] is True
    kept = sum(e["in_graph"] for e in obj["edges"].values())
    assert kept == int(circuit["edge_mask"].sum())  # no GQA in tiny-gpt2: one-to-one
    assert cli(["export", str(tmp_path / "run" / "scores.safetensors"), str(tmp_path / "s.json")]) == 0
    scores_obj = json.loads((tmp_path / "s.json").read_text())
    # a JSON boolean, as the circuit export writes it (was the string "true", and "false" read as true)
    assert scores_obj["cfg"]["prepend_bos"] is True and all(e["in_graph"] for e in scores_obj["edges"].values())
    assert cli(["import", str(tmp_path / "s.json"), str(tmp_path / "back.pt")]) == 0
    assert load_circuit(tmp_path / "back.pt")["prepend_bos"] is True


def _exported(tmp_path, seed: int = 3) -> tuple[dict, dict]:
    g = Graph(2, 4, 4, False)
    circuit = _random_circuit(g, "edges", seed=seed)
    save_circuit(tmp_path / "c.pt", {**circuit, "ablation": "zero", "rank_by": "abs", "target_sparsity": 0.5,
                                     "achieved_sparsity": 0.5})
    return circuit, export_circuit(load_circuit(tmp_path / "c.pt"))


def test_sign_and_scale_on_import_are_applied_and_recorded(tmp_path) -> None:
    """A reference file with loss=False holds -1 x our scores, and a batch-mean metric 1/B of them:
    --sign -1 --scale B brings them back, and the output says so."""
    from circuitkit.discovery.attribution import load_scores

    circuit, obj = _exported(tmp_path)
    B = 4
    for e in obj["edges"].values():
        e["score"] = -e["score"] / B
    for n in obj["nodes"].values():
        if "score" in n:
            n["score"] = -n["score"] / B
    (tmp_path / "ref.json").write_text(json.dumps(obj))
    assert cli(["import", str(tmp_path / "ref.json"), str(tmp_path / "s.safetensors"), "--sign", "-1",
                "--scale", str(B)]) == 0
    scores = load_scores(tmp_path / "s.safetensors")
    torch.testing.assert_close(scores.edges, circuit["edge_scores"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.head, circuit["head_scores"], rtol=1e-5, atol=1e-6)
    assert scores.info["imported_from"]["sign"] == -1 and scores.info["imported_from"]["scale"] == 4.0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["import_sign"] == "-1" and meta["import_scale"] == "4.0"
    assert cli(["import", str(tmp_path / "ref.json"), str(tmp_path / "c2.pt"), "--sign", "-1", "--scale", "4"]) == 0
    back = load_circuit(tmp_path / "c2.pt")
    assert back["imported_from"]["sign"] == -1 and back["imported_from"]["scale"] == 4.0
    torch.testing.assert_close(back["edge_scores"], circuit["edge_scores"], rtol=1e-5, atol=1e-6)
    # without the sign, signed ranking would keep the other end of the list: the scores are negated
    assert cli(["import", str(tmp_path / "ref.json"), str(tmp_path / "raw.safetensors")]) == 0
    raw = load_scores(tmp_path / "raw.safetensors")
    torch.testing.assert_close(raw.edges, -circuit["edge_scores"] / B, rtol=1e-5, atol=1e-6)


def test_export_without_node_scores_and_the_imported_ablation(tmp_path) -> None:
    circuit, _ = _exported(tmp_path)
    assert cli(["export", str(tmp_path / "c.pt"), str(tmp_path / "plain.json"), "--no-node-scores"]) == 0
    obj = json.loads((tmp_path / "plain.json").read_text())
    assert all("score" not in n for n in obj["nodes"].values())  # what the reference's to_json can save again
    assert all("score" in e for e in obj["edges"].values())
    assert cli(["import", str(tmp_path / "plain.json"), str(tmp_path / "back.pt")]) == 0
    back = load_circuit(tmp_path / "back.pt")
    g = Graph(2, 4, 4, False)
    want = circuit["edge_scores"].sum(dim=1)[g.head_index(1, 2)]  # no node scores: the sum of its edges
    assert abs(float(back["head_scores"][1, 2]) - float(want)) < 1e-5
    assert back["ablation"] == "corrupted"  # the reference defines circuits under patching, not zeros


def test_prepend_bos_string_in_an_older_file_reads_as_what_it_says(tmp_path) -> None:
    _, obj = _exported(tmp_path)
    for text, want in (("false", False), ("true", True)):
        obj["cfg"]["prepend_bos"] = text
        (tmp_path / "old.json").write_text(json.dumps(obj))
        assert cli(["import", str(tmp_path / "old.json"), str(tmp_path / f"{text}.pt")]) == 0
        assert load_circuit(tmp_path / f"{text}.pt")["prepend_bos"] is want


def test_prepend_bos_policy_on_a_tokenizer_without_bos(tiny_model_dir) -> None:
    """GPT-2-style tokenizers add no BOS: the key adds it (true) or leaves prompts as they are (false)."""
    from transformers import AutoTokenizer

    from circuitkit.discovery.config import DataParams
    from circuitkit.discovery.tasks import build_task

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with_bos = build_task("ioi", tok, None, DataParams(prepend_bos=True), 6, 0)
    without = build_task("ioi", tok, None, DataParams(prepend_bos=False), 6, 0)
    assert (with_bos.clean_ids[:, 0] == tok.bos_token_id).all() and (with_bos.corrupted_ids[:, 0] == tok.bos_token_id).all()
    assert (without.clean_ids[:, 0] != tok.bos_token_id).all()
    assert torch.equal(with_bos.clean_ids[:, 1:], without.clean_ids)
    assert torch.equal(with_bos.answer_pos, without.answer_pos + 1)
    assert torch.equal(with_bos.correct, without.correct)
    # Induction prompts start with BOS already: false removes it.
    ind = build_task("induction", tok, None, DataParams(seq_len=16, prepend_bos=False), 3, 0)
    assert ind.clean_ids.shape[1] == 15 and (ind.answer_pos == 14).all()


def test_imported_scores_are_pruned_and_measured_here(tmp_path) -> None:
    """A graph found elsewhere: import its scores into a run dir, then prune and measure it."""
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    g = Graph(2, 4, 4, False)
    circuit = _random_circuit(g, "edges", seed=5)
    save_circuit(tmp_path / "elsewhere.pt", {**circuit, "ablation": "zero", "rank_by": "abs",
                                             "target_sparsity": 0.5, "achieved_sparsity": 0.5})
    export_file(tmp_path / "elsewhere.pt", tmp_path / "graph.json")
    run_dir = tmp_path / "run"
    assert cli(["import", str(tmp_path / "graph.json"), str(run_dir / "scores.safetensors")]) == 0
    _, cfg = compose(["stages=[data,pruning]", "model.precision=float32", "discovery.data_params.num_examples=4",
                      "discovery.data_params.eval_examples=2", "discovery.data_params.seq_len=16",
                      "pruning.target_sparsity=0.5", "pruning.graph=false"])
    manifest = run_pipeline(cfg, run_dir)
    pruned = load_circuit(run_dir / "circuit.pt")
    top = circuit["head_scores"].abs().flatten().argsort(descending=True)[:4]
    assert sorted(pruned["head_mask"].flatten().nonzero().flatten().tolist()) == sorted(top.tolist())
    assert isinstance(manifest["stages"]["pruning"]["summary"]["faithfulness"], float)
