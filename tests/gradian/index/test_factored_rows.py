"""Factored rows (grads.row_format=factored, gradian.index.formats.factored): at full rank they score as the dense rows
(cosine, dot, kfac, ekfac), truncated they are each block's best rank-c approximation, they take
c (k_o + k_i) values per module on disk, circuit sites and raw rows factor too, and what cannot read
them says so in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from circuitkit.core.config import ConfigError
from circuitkit.core.errors import UserError
from circuitkit.core.recorded import IndexIntegrityError
from circuitkit_app.config import compose
from gradian.build.checks import check_grads_config
from gradian.build.indexer import ResumeMismatchError, build_index
from gradian.build.memory import grads_estimate
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import restricted_sites, site_shapes
from gradian.index import manifest as index_module
from gradian.index.formats.factored import FactoredRows, layout_of
from gradian.index.header import describe_index
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector
from gradian.rank.ranking import rank
from gradian.rank.scores import stream_topk
from tests.gradian.build.test_circuit_index import _circuit, _load
from tests.gradian.capture.test_gradients import _rows

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows
DIM = 256  # 16 x 16 per module; every row has at most 16 positions, so rank 16 is exact
N_ROWS = len(ROWS)


def _cfg(root: Path, *overrides: str):
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose(["model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
                      "grads.module_filter=[mlp]", "grads.rows_per_shard=7", f"grads.data_path={data}", *overrides])
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """One dense index and factored ones at ranks 2, 6 and 16 (exact), all with K-FAC factors; rank 6's
    with the sampled Fisher (its sampled-label rows are factored too)."""
    root = tmp_path_factory.mktemp("factored")
    out = {"root": root}
    for name, overrides in (("dense", ()), *((c, ("grads.row_format=factored", f"grads.row_rank={c}",
                                                  *(("grads.fisher=sampled",) if c == 6 else ())))
                                              for c in (2, 6, 16))):
        cfg = _cfg(root, *overrides)
        build_index(cfg.model, cfg.grads, root / str(name))
        out[name] = root / str(name)
    return out


def _all_rows(index_dir: Path) -> torch.Tensor:
    return torch.cat([g for _, g, _ in IndexReader(index_dir).shards(factored=True)]).double()


def _scores(index_dir: Path, queries: torch.Tensor, score: str) -> torch.Tensor:
    """(Q, N_ROWS) scores of every row, by row id, through `stream_topk`."""
    top = stream_topk(index_dir, queries, top_k=N_ROWS, score=score)
    return torch.zeros(queries.shape[0], N_ROWS).scatter_(1, top["query_rows"], top["query_scores"])


def _blocks(rows: torch.Tensor, sides) -> list[torch.Tensor]:
    out, start = [], 0
    for k_o, k_i in sides:
        out.append(rows[:, start:start + k_o * k_i].reshape(-1, k_o, k_i))
        start += k_o * k_i
    return out


@pytest.mark.parametrize("score", ["cosine", "dot", "kfac", "ekfac"])
def test_full_rank_factored_rows_score_as_the_dense_rows(built, score: str) -> None:
    queries = _all_rows(built["dense"])[[0, 7, 13]].float()  # exact projected gradients of three rows
    dense, factored = _scores(built["dense"], queries, score), _scores(built[16], queries, score)
    scale = dense.abs().max()
    assert (factored - dense).abs().max() <= 1e-5 * scale, (score, (factored - dense).abs().max() / scale)
    if score == "cosine":
        assert dense[[0, 1, 2], [0, 7, 13]].tolist() == pytest.approx([1.0] * 3, abs=1e-5)


def test_rows_are_exact_at_full_rank_and_best_rank_c_below(built) -> None:
    dense = _all_rows(built["dense"])
    layout = layout_of(IndexReader(built[16]).manifest)
    assert layout.sides == ((16, 16),) * 4 and layout.dense_width == dense.shape[1]
    exact = layout.densify(_all_rows(built[16]).float()).double()
    assert ((exact - dense).norm(dim=1) / dense.norm(dim=1)).max() <= 1e-5
    assert torch.allclose(torch.cat([n for _, _, n in IndexReader(built[16]).shards(factored=True)]).double(),
                          dense.norm(dim=1), rtol=1e-5)  # stored norms: those of U Vᵀ
    separated = 0
    for c in (2, 6):
        approx = layout_of(IndexReader(built[c]).manifest).densify(_all_rows(built[c]).float()).double()
        for g, g_c in zip(_blocks(dense, layout.sides), _blocks(approx, layout.sides), strict=True):
            u, sigma, v_t = torch.linalg.svd(g)
            best = u[:, :, :c] @ torch.diag_embed(sigma[:, :c]) @ v_t[:, :c]
            # Eckart-Young: the error of the best rank-c approximation is the tail of the spectrum ...
            tail = sigma[:, c:].norm(dim=1)
            assert torch.allclose((g - g_c).flatten(1).norm(dim=1), tail, rtol=1e-4, atol=1e-6 * sigma[:, 0].max())
            # ... and where σ_c stands clear of σ_c+1 that approximation is unique: the same matrix
            clear = (sigma[:, c - 1] - sigma[:, c]) > 1e-2 * sigma[:, 0]
            separated += int(clear.sum())
            err = (g_c - best).flatten(1).norm(dim=1) / sigma[:, 0]
            assert err[clear].max() <= 1e-4
    assert separated >= N_ROWS  # the comparison above covered real rows


def test_truncated_scores_converge_to_the_dense_ones_as_the_rank_grows(built) -> None:
    queries = _all_rows(built["dense"])[[2, 11]].float()
    dense = _scores(built["dense"], queries, "cosine")
    errors = [(_scores(built[c], queries, "cosine") - dense).abs().mean().item() for c in (2, 6, 16)]
    print("mean |cosine error| at rank 2, 6, 16:", errors)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-6 and errors[0] > 1e-3


def _tensor_bytes(shard: Path, name: str) -> int:
    raw = shard.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    begin, end = header[name]["data_offsets"]
    return end - begin


def test_bytes_per_row_are_c_times_both_sides_per_module(built) -> None:
    per_module = {"dense": 16 * 16, 2: 2 * (16 + 16), 6: 6 * (16 + 16), 16: 16 * (16 + 16)}
    for name, values in per_module.items():
        index_dir = built[name]
        manifest = IndexReader(index_dir).manifest
        assert manifest["row_width"] == 4 * values  # four modules (each MLP's two linears)
        grads_bytes = sum(_tensor_bytes(index_dir / shard, "grads") for shard in manifest["shards"])
        assert grads_bytes == N_ROWS * 4 * values * 4  # float32
    cfg = _cfg(built["root"], "grads.row_format=factored", "grads.row_rank=2")
    factored, dense = (grads_estimate(c, n_rows=1000).index_bytes for c in (cfg, _cfg(built["root"])))
    assert dense - factored == 1000 * 4 * (16 * 16 - 2 * 32) * 4  # float32 storage


def test_a_factored_index_verifies_and_says_what_it_holds(built) -> None:
    reader = IndexReader(built[6])
    assert reader.manifest["format_version"] >= 8
    assert (reader.manifest["row_format"], reader.manifest["row_rank"]) == ("factored", 6)
    assert reader.manifest["fisher"] == "sampled"  # its sampled-label rows are factored like the rows
    assert reader.verify() == []  # norms of U Vᵀ, row width, K-FAC factors, EK-FAC eigenvalues from the factors
    lines = dict(describe_index(reader.summary()))
    assert lines["row format"].startswith("factored, rank 6")
    assert dict(describe_index(IndexReader(built["dense"]).summary()))["row format"].startswith("dense")


def test_gradian_rank_finds_a_duplicate_in_a_factored_index(built) -> None:
    queries = built["root"] / "queries.jsonl"
    queries.write_text(json.dumps(ROWS[9]) + "\n")
    results = rank(built[16], queries, top_k=3, score="cosine")
    assert results[0]["row_id"] == 9 and results[0]["score"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("projection_dim", [64, None])  # 8 x 8 Kronecker factors, and raw rows
def test_circuit_sites_and_raw_rows_factor_exactly_and_independently_of_the_batch(tmp_path, projection_dim) -> None:
    lm = _load("tiny-gpt2")
    _circuit(tmp_path / "c.pt", lm.adapter, [(0, 3), (1, 1)])
    sites, _ = restricted_sites(lm.model, lm.adapter, tmp_path / "c.pt", "kept")
    projector = Projector(site_shapes(sites), "kronecker_orthogonal", projection_dim)
    rank_c = 8 if projection_dim else 16  # 8: a block's full rank (the QR + SVD path); 16: each row's positions
    factored = FactoredRows(rank_c)
    layout = factored.layout(projector)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 250, (n,), generator=g) for n in (11, 16, 8)]
    batch = _rows(seqs, [5, 9, 3])
    dense = per_example_gradients(lm.model, lm.adapter, sites, projector, batch).row()
    rows = per_example_gradients(lm.model, lm.adapter, sites, projector, batch, factored=factored).row()
    assert rows.shape == (3, layout.width) and layout.dense_width == dense.shape[1]
    assert ((layout.densify(rows) - dense).norm(dim=1) / dense.norm(dim=1)).max() <= 1e-5
    alone = per_example_gradients(lm.model, lm.adapter, sites, projector, _rows(seqs[1:2], [9]), factored=factored)
    assert torch.allclose(alone.row()[0], rows[1], rtol=1e-4, atol=1e-6 * rows[1].abs().max())


@pytest.mark.parametrize("overrides,names", [
    (("grads.projection=dense",), ("grads.row_format=factored", "grads.projection=dense")),
    (("grads.preconditioner=module",), ("grads.row_format=factored", "grads.preconditioner=module")),
])
def test_settings_factors_cannot_serve_are_refused_naming_the_keys(tmp_path, overrides, names) -> None:
    cfg = _cfg(tmp_path, "grads.row_format=factored", *overrides)
    with pytest.raises(UserError) as err:
        check_grads_config(cfg.model, cfg.grads)
    assert all(n in str(err.value) for n in names) and err.value.exit_code == 2


def test_a_rank_out_of_range_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="grads.row_rank"):
        _cfg(tmp_path, "grads.row_rank=0")
    cfg = _cfg(tmp_path, "grads.row_format=factored", "grads.row_rank=17")  # 16 x 16 blocks: rank <= 16
    with pytest.raises(UserError, match=r"grads.row_rank=17 exceeds min\(k_o, k_i\) = 16"):
        build_index(cfg.model, cfg.grads, tmp_path / "index")
    assert not (tmp_path / "index" / "manifest.json").exists()


def test_readers_that_cannot_read_factors_refuse_in_one_line(built, tmp_path, monkeypatch) -> None:
    queries = _all_rows(built["dense"])[:1].float()
    with pytest.raises(IndexMismatchError, match="stores factored rows .*rebuild it with grads.row_format=dense"):
        next(IndexReader(built[6]).shards())  # a dense-only reader (e.g. gradian attribute's engines)
    with pytest.raises(IndexMismatchError, match="factored rows.*no module second moments"):
        stream_topk(built[6], queries, score="influence")
    copy = tmp_path / "future"
    shutil.copytree(built[6], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "row_format": "compressed"}))
    with pytest.raises(IndexIntegrityError, match="row_format 'compressed' is not one this Gradian reads"
                                                  r" \(dense, factored, signs\); upgrade circuitkit"):
        IndexReader(copy)
    monkeypatch.setattr(index_module, "FORMAT_VERSION", 7)  # the reader of format 7, before factored rows
    with pytest.raises(IndexIntegrityError, match="format_version 9 is newer than this Gradian reads"):
        IndexReader(built[6])


def test_resuming_with_another_row_format_or_rank_is_refused(built) -> None:
    for overrides, diff in ((("grads.row_format=factored", "grads.row_rank=4"), "row_rank: index has 6, asked 4"),
                            ((), "row_format: index has 'factored', asked 'dense'")):
        cfg = _cfg(built["root"], "grads.fisher=sampled", *overrides)
        with pytest.raises(ResumeMismatchError, match=diff):
            build_index(cfg.model, cfg.grads, built[6])


def test_an_index_of_format_7_still_reads_as_dense(built, tmp_path) -> None:
    old = tmp_path / "v7"
    shutil.copytree(built["dense"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["row_format"], manifest["row_rank"]
    (old / "manifest.json").write_text(json.dumps({**manifest, "format_version": 7}))
    reader = IndexReader(old)
    assert (reader.manifest["row_format"], reader.manifest["row_rank"]) == ("dense", None)
    queries = _all_rows(built["dense"])[:2].float()
    assert torch.equal(_scores(old, queries, "ekfac"), _scores(built["dense"], queries, "ekfac"))
