"""Circuit-restricted gradient indexing (grads.circuit): rows against autograd, manifest, rank, pipeline."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from circuitkit.core.io import sha256_file
from circuitkit.discovery.circuit import circuit_sha256, kept_components, save_circuit
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import restricted_sites, site_shapes
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector
from gradian.rank.ranking import rank
from tests.gradian.capture.test_gradients import _rows  # the right-padded batch builder those tests use

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the garden {i}."}
        for i, (s, v) in enumerate((s, v) for v in ("runs", "eats") for s in ("cat", "dog", "bird", "fish", "fox"))]


@functools.cache
def _load(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"), device=torch.device("cpu"))


def _circuit(path, adapter, kept: list[tuple[int, int]], scope: str = "heads", **extra) -> dict:
    mask = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.bool)
    for layer, head in kept:
        mask[layer, head] = True
    circuit = {"model_name": "test", "scope": scope, "head_mask": mask,
               "head_scores": torch.randn(adapter.n_layers, adapter.n_heads), "ablation": "zero",
               "rank_by": "abs", "target_sparsity": 0.5, "achieved_sparsity": 0.5, **extra}
    save_circuit(path, circuit)
    return circuit


def _weight_grad(lm, module, seq: torch.Tensor, sup_from: int) -> torch.Tensor:
    """One example's weight gradient of `module` by autograd, nn.Linear orientation (d_out, d_in)."""
    from transformers.pytorch_utils import Conv1D

    module.weight.requires_grad_(True)
    module.weight.grad = None
    try:
        logits = lm.model(input_ids=seq[None]).logits[0].float()
        F.cross_entropy(logits[sup_from - 1:-1], seq[sup_from:], reduction="sum").backward()
        grad = module.weight.grad
        return (grad.T if isinstance(module, Conv1D) else grad).clone()
    finally:
        module.weight.requires_grad_(False)
        module.weight.grad = None


@pytest.mark.parametrize("fixture,kept", [("tiny-gpt2", [(0, 3), (1, 1), (1, 2)]),
                                          ("tiny-llama", [(0, 1), (1, 0), (1, 3)]),  # GQA: 4 query / 2 KV heads
                                          ("tiny-neox", [(0, 0), (1, 2)]),  # parallel residual
                                          ("tiny-gemma3", [(0, 2), (1, 1)])])  # GQA, post-norms
def test_per_head_rows_equal_autograd_slices(tmp_path, fixture: str, kept) -> None:
    lm = _load(fixture)
    path = tmp_path / "circuit.pt"
    _circuit(path, lm.adapter, kept)
    sites, record = restricted_sites(lm.model, lm.adapter, path, "kept")
    dh, L = lm.adapter.head_dim, lm.adapter.n_layers
    heads = [s for s in sites if ":head" in s.name]
    # transformer.h.{l}.attn.c_proj:head{h} / model.layers.{l}.self_attn.o_proj:head{h}
    assert [(int(s.name.split(".")[2]), int(s.name.rsplit("head", 1)[1])) for s in heads] == kept
    assert record["heads"] == [list(k) for k in kept] and record["mlps"] == list(range(L))
    assert record["sha256"] == sha256_file(path)
    assert len(sites) == len(kept) + L  # head scope keeps every MLP
    shapes = site_shapes(sites)
    assert all(shapes[s.name] == (lm.adapter.d_model, dh) for s in heads)
    projector = Projector(shapes, projection_dim=None)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 250, (n,), generator=g) for n in (11, 16, 8)]
    sup_from = [5, 9, 3]
    got = per_example_gradients(lm.model, lm.adapter, sites, projector, _rows(seqs, sup_from))
    worst = 0.0
    for b, (seq, k) in enumerate(zip(seqs, sup_from, strict=True)):
        for site in sites:
            full = _weight_grad(lm, site.module, seq, k)  # (d_out, d_in)
            expected = full if site.columns is None else full[:, site.columns]
            row = got[site.name][b].view(expected.shape)
            worst = max(worst, ((row - expected).norm() / expected.norm()).item())
    print(f"{fixture}: max relative error of per-head rows vs autograd slices {worst:.2e}")
    assert worst <= 1e-5


def test_head_columns_are_the_heads_z_slices(tmp_path) -> None:
    """Guard against a wrong column block: head h's row is zero if only another head's z is non-zero."""
    lm = _load("tiny-gpt2")
    path = tmp_path / "c.pt"
    _circuit(path, lm.adapter, [(1, 0), (1, 2)])
    sites, _ = restricted_sites(lm.model, lm.adapter, path, "none")
    assert [s.name for s in sites] == ["transformer.h.1.attn.c_proj:head0", "transformer.h.1.attn.c_proj:head2"]
    dh = lm.adapter.head_dim
    assert sites[1].columns == slice(2 * dh, 3 * dh)


def test_edge_circuit_keeps_heads_and_mlps_with_kept_outgoing_edges(tmp_path) -> None:
    from circuitkit.discovery.attribution.graph import Graph

    lm = _load("tiny-gpt2")
    g = Graph(2, 4, 4, False)
    edge_mask = torch.zeros(len(g.upstream), len(g.downstream), dtype=torch.bool)
    edge_mask[g.head_index(0, 2), g.logits_column] = True
    edge_mask[g.mlp_index(1), g.logits_column] = True
    head_mask = torch.zeros(2, 4, dtype=torch.bool)
    head_mask[0, 2] = True
    circuit = {"scope": "edges", "head_mask": head_mask, "edge_mask": edge_mask}
    heads, mlps = kept_components(circuit)
    assert heads.nonzero().tolist() == [[0, 2]] and mlps.tolist() == [False, True]
    path = tmp_path / "e.pt"
    _circuit(path, lm.adapter, [(0, 2)], scope="edges", edge_mask=edge_mask)
    sites, record = restricted_sites(lm.model, lm.adapter, path, "kept")
    assert [s.name for s in sites] == ["transformer.h.0.attn.c_proj:head2", "transformer.h.1.mlp.c_proj"]
    assert record["mlps"] == [1]


@pytest.fixture(scope="module")
def restricted_index(tmp_path_factory):
    """Indexes of tiny-gpt2 restricted to circuit A, and unrestricted; plus circuit B."""
    root = tmp_path_factory.mktemp("circuit-index")
    lm = _load("tiny-gpt2")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _circuit(root / "a.pt", lm.adapter, [(0, 1), (1, 3)])
    _circuit(root / "b.pt", lm.adapter, [(0, 0), (1, 3)])
    common = ["stages=[grads]", "model.precision=float32", "grads.projection_dim=16", f"grads.data_path={data}"]
    for name, extra in (("restricted", [f"grads.circuit={root / 'a.pt'}", "grads.circuit_mlps=none"]),
                        ("full", [])):
        _, cfg = compose([*common, f"grads.index_dir={root / name}", *extra])
        run_pipeline(cfg, root / f"run-{name}")
    return root


def test_manifest_records_the_circuit_and_rank_refuses_another(restricted_index) -> None:
    root = restricted_index
    manifest = IndexReader(root / "restricted").manifest
    assert manifest["circuit"]["sha256"] == circuit_sha256(root / "a.pt")
    assert manifest["circuit"]["heads"] == [[0, 1], [1, 3]] and manifest["circuit"]["mlps"] == []
    assert list(manifest["projection"]["modules"]) == ["transformer.h.0.attn.c_proj:head1",
                                                       "transformer.h.1.attn.c_proj:head3"]
    assert manifest["row_width"] == 2 * 16
    assert IndexReader(root / "full").manifest["circuit"] is None
    queries = root / "q.jsonl"
    queries.write_text(json.dumps(ROWS[3]) + "\n")
    # The right circuit (and no circuit: the manifest's own sites) ranks the duplicate first.
    for circuit in (root / "a.pt", None):
        top = rank(root / "restricted", queries, top_k=3, circuit=circuit, score="cosine")
        assert top[0]["row_id"] == 3 and top[0]["score"] == pytest.approx(1.0, abs=1e-3)
    # the default score (ekfac: the default index holds K-FAC factors of the head blocks) agrees
    assert rank(root / "restricted", queries, top_k=3)[0]["row_id"] == 3
    with pytest.raises(IndexMismatchError, match="another circuit"):
        rank(root / "restricted", queries, circuit=root / "b.pt")
    with pytest.raises(IndexMismatchError, match="unrestricted"):
        rank(root / "full", queries, circuit=root / "a.pt")


def test_gradian_rank_cli_refuses_in_one_line(restricted_index, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    root = restricted_index
    queries = root / "q.jsonl"
    queries.write_text(json.dumps(ROWS[3]) + "\n")
    code = main(["rank", "--index", str(root / "restricted"), "--queries", str(queries),
                 "--circuit", str(root / "b.pt")])
    err = capsys.readouterr().err
    assert code == 2 and "another circuit" in err and "Traceback" not in err


def test_preflight_estimate_follows_the_restricted_set(restricted_index) -> None:
    from gradian.build.memory import grads_estimate, grads_projector, preconditioner_index_bytes

    root = restricted_index
    base = ["model.precision=float32", "grads.projection_dim=16", "grads.batch_size=2", "grads.max_seq_length=32"]
    _, full = compose(base)
    _, two_heads = compose([*base, f"grads.circuit={root / 'a.pt'}", "grads.circuit_mlps=none"])
    _, every_head = compose([*base, "grads.circuit=run"])  # before pruning: the upper bound
    e_full, e_two, e_all = (grads_estimate(c, n_rows=100) for c in (full, two_heads, every_head))
    # rows, + the default kfac's factors of the same blocks (one shard)
    kfac_two, kfac_all = (preconditioner_index_bytes(grads_projector(c), "kfac", 1) for c in (two_heads, every_head))
    assert 0 < kfac_two < kfac_all
    assert e_two.index_bytes == 100 * (2 * 16 * 2 + 12) + kfac_two  # 2 heads x dim 16, float16, + norm + row id
    assert e_all.index_bytes == 100 * ((2 * 4 + 2) * 16 * 2 + 12) + kfac_all  # 8 heads + 2 MLPs
    assert e_two.terms["capture buffers"] < e_full.terms["capture buffers"]


def test_grads_circuit_run_reads_the_pruning_stage_circuit(tmp_path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_dir = tmp_path / "run"
    base = ["stages=[data,attribution,pruning,grads]", "model.precision=float32", "discovery.task=induction",
            "discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=2",
            "discovery.data_params.seq_len=16", "discovery.ig_steps=1", "grads.projection_dim=16",
            f"grads.data_path={data}", "grads.circuit=run"]
    _, cfg = compose(base)
    run_pipeline(cfg, run_dir)
    circuit_pt = run_dir / "circuit.pt"
    sha, mtime = circuit_sha256(circuit_pt), circuit_pt.stat().st_mtime_ns
    manifest = IndexReader(run_dir / "index").manifest
    assert manifest["circuit"]["sha256"] == sha
    kept = torch.load(circuit_pt, weights_only=True)["head_mask"].nonzero().tolist()
    assert manifest["circuit"]["heads"] == kept and len(kept) == 4  # 50 % of 2 x 4 heads
    # Rerun with another grads setting: pruning is skipped (not recomputed), grads reads the file.
    _, cfg2 = compose([*base, "grads.projection_seed=1", f"grads.index_dir={tmp_path / 'index2'}"])
    out = run_pipeline(cfg2, run_dir)
    assert out["stages"]["pruning"].get("skipped_on_rerun") is True
    assert out["stages"]["grads"]["summary"]["circuit_sha256"] == sha
    assert circuit_pt.stat().st_mtime_ns == mtime
    assert IndexReader(tmp_path / "index2").manifest["circuit"]["sha256"] == sha
    # Only the grads stage, in the same run dir: it reads circuit.pt from disk.
    _, cfg3 = compose([*base[1:], "stages=[grads]", f"grads.index_dir={tmp_path / 'index3'}"])
    run_pipeline(cfg3, run_dir)
    assert IndexReader(tmp_path / "index3").manifest["circuit"]["sha256"] == sha


def test_grads_circuit_run_without_a_circuit_is_one_clear_error(tmp_path) -> None:
    from circuitkit.core.pipeline import PipelineError

    _, cfg = compose(["stages=[grads]", "grads.circuit=run", "model.precision=float32"])
    with pytest.raises(PipelineError, match="run the pruning stage first"):
        run_pipeline(cfg, tmp_path / "run")


def test_gradian_index_and_inspect_with_a_circuit(restricted_index, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    root = restricted_index
    data = root / "train.jsonl"
    args = ["index", "model.precision=float32", "grads.projection_dim=16", f"grads.data_path={data}"]
    assert main([*args, f"grads.index_dir={root / 'cli'}", f"grads.circuit={root / 'b.pt'}",
                 "grads.circuit_mlps=none"]) == 0
    out = capsys.readouterr().out
    assert "heads [[0, 0], [1, 3]]" in out
    assert IndexReader(root / "cli").manifest["circuit"]["sha256"] == circuit_sha256(root / "b.pt")
    assert main([*args, f"grads.index_dir={root / 'cli-run'}", "grads.circuit=run"]) == 1
    assert "grads.circuit=run means" in capsys.readouterr().err  # (rich wraps the line)
