"""Sign rows (grads.row_format=signs, gradian.index.formats.signs): one bit per projected coordinate, scored by
n - 2 x Hamming distance; the packed rows are the signs of the dense rows of the same projection,
scores equal the ±1 vectors' inner products, the bytes are what the format says, and every reader
that needs magnitudes refuses the index in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuitkit.core.errors import UserError
from circuitkit_app.config import compose
from gradian.build.checks import check_grads_config
from gradian.build.indexer import build_index, factor_row_ids
from gradian.build.memory import grads_estimate
from gradian.index.formats.signs import SignScorer, coordinates, pack, packed_width, unpack
from gradian.index.header import describe_index
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.rank.ranking import rank
from gradian.rank.scores import stream_topk
from tests.gradian.index.test_factored_rows import ROWS  # the same 20 rows

DIM = 100  # 10 x 10 per module: 100 coordinates, not a whole number of 64-bit words
N_ROWS = len(ROWS)


def _cfg(root: Path, *overrides: str):
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose(["model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
                      "grads.module_filter=[mlp]", "grads.rows_per_shard=7", f"grads.data_path={data}",
                      "grads.preconditioner=none", *overrides])
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Dense and sign indexes of the same kronecker_orthogonal projection, and a whitened sign index
    whose factor pass reads a sample of 7 rows."""
    root = tmp_path_factory.mktemp("signs")
    out = {"root": root}
    for name, overrides in (("dense", ()), ("signs", ("grads.row_format=signs",)),
                            ("whitened", ("grads.row_format=signs", "grads.projection=whitened",
                                          "grads.factor_rows=7"))):
        cfg = _cfg(root, *overrides)
        build_index(cfg.model, cfg.grads, root / name)
        out[name] = root / name
    return out


def test_pack_and_score_are_the_inner_products_of_the_signs() -> None:
    g = torch.Generator().manual_seed(0)
    rows, queries = torch.randn(50, 130, generator=g), torch.randn(3, 130, generator=g)
    rows[0, :5] = 0.0  # a zero has sign +1
    packed = pack(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (50, packed_width(130)) == (50, 24)
    signs = torch.where(rows >= 0, 1.0, -1.0)
    assert torch.equal(unpack(packed, 130), signs)
    want = torch.where(queries >= 0, 1.0, -1.0) @ signs.T
    assert torch.equal(SignScorer(queries)(packed), want)
    with pytest.raises(ValueError, match="not finite"):
        pack(torch.tensor([[1.0, float("nan")]]))


def test_sign_rows_are_the_signs_of_the_dense_rows(built) -> None:
    dense = torch.cat([g for _, g, _ in IndexReader(built["dense"]).shards()])
    reader = IndexReader(built["signs"])
    packed = torch.cat([g for _, g, _ in reader.shards(signs=True)])
    n = coordinates(reader.manifest)
    assert n == dense.shape[1] and reader.manifest["row_width"] == packed_width(n) == packed.shape[1]
    # Signs of float32 rows computed in other batches: equal except where a coordinate is ~0.
    agree = (unpack(packed, n) == torch.where(dense >= 0, 1.0, -1.0)) | (dense.abs() < 1e-7)
    assert agree.all()
    assert reader.verify() == []
    assert reader.manifest["row_format"] == "signs" and reader.manifest["row_rank"] is None
    shard = reader.index_dir / sorted(reader.manifest["shards"])[0]
    # whole 64-bit words per row: the first shard's 7 rows take 7 x ceil(n / 64) x 8 bytes of grads
    assert n % 64 != 0 and packed.shape[1] == 8 * (n // 64 + 1)
    assert shard.stat().st_size < 7 * packed.shape[1] + 7 * 12 + 600


@pytest.mark.parametrize("score", ["cosine", "dot"])
def test_ranking_sign_rows_scores_the_signed_queries(built, score: str) -> None:
    dense = torch.cat([g for _, g, _ in IndexReader(built["dense"]).shards()])
    queries = dense[[3, 11]] + 0.01 * torch.randn(2, dense.shape[1], generator=torch.Generator().manual_seed(1))
    top = stream_topk(built["signs"], queries, top_k=N_ROWS, score=score)
    signs = unpack(torch.cat([g for _, g, _ in IndexReader(built["signs"]).shards(signs=True)]), dense.shape[1])
    want = torch.where(queries >= 0, 1.0, -1.0) @ signs.T / (dense.shape[1] if score == "cosine" else 1)
    got = torch.zeros(2, N_ROWS).scatter_(1, top["query_rows"], top["query_scores"])
    assert torch.allclose(got, want)
    assert top["query_rows"][:, 0].tolist() == [3, 11]  # each query's own row first


def test_the_cli_path_ranks_a_whitened_sign_index(built) -> None:
    """rank() end to end (model loaded from the manifest, queries signed) on the whitened sign index
    whose projection was fitted on a sample of the rows."""
    root = built["root"]
    queries = root / "q.jsonl"
    queries.write_text(json.dumps(ROWS[5]) + "\n")
    results = rank(built["whitened"], queries, top_k=3)
    assert results[0]["row_id"] == 5 and results[0]["score"] == 1.0  # its own row: every sign equal
    assert IndexReader(built["whitened"]).verify() == []


def test_factor_rows_samples_evenly() -> None:
    assert factor_row_ids(20, None) == list(range(20)) == factor_row_ids(20, 20) == factor_row_ids(20, 50)
    assert factor_row_ids(20, 7) == [0, 3, 6, 9, 12, 15, 18]
    assert factor_row_ids(1000, 100) == list(range(0, 1000, 10))


@pytest.mark.parametrize("score", ["kfac", "ekfac", "influence", "whitened"])
def test_scores_that_need_magnitudes_are_refused(built, score: str) -> None:
    queries = built["root"] / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(UserError, match="sign rows") as err:
        rank(built["signs"], queries, score=score)
    assert err.value.exit_code == 2 and "--score cosine or dot" in str(err.value)
    with pytest.raises(IndexMismatchError, match="sign rows"):
        stream_topk(built["signs"], torch.zeros(1, coordinates(IndexReader(built["signs"]).manifest)), score=score)


def test_float_readers_refuse_sign_rows(built) -> None:
    with pytest.raises(IndexMismatchError, match="grads.row_format=signs"):
        next(IndexReader(built["signs"]).shards())


def test_a_preconditioner_with_signs_is_refused_before_any_work(tmp_path) -> None:
    cfg = _cfg(tmp_path, "grads.row_format=signs", "grads.preconditioner=kfac")
    with pytest.raises(UserError, match="grads.preconditioner=none") as err:
        check_grads_config(cfg.model, cfg.grads)
    assert err.value.exit_code == 2


def test_the_index_says_what_it_holds_and_the_estimate_counts_bytes(built, tmp_path) -> None:
    text = " ".join(v for _, v in describe_index(IndexReader(built["signs"]).summary()))
    assert "packed sign bits" in text and "Hamming" in text
    dense_cfg, sign_cfg = _cfg(tmp_path), _cfg(tmp_path, "grads.row_format=signs")
    dense = grads_estimate(dense_cfg, n_rows=10_000).index_bytes
    signs = grads_estimate(sign_cfg, n_rows=10_000).index_bytes
    n = coordinates(IndexReader(built["signs"]).manifest)
    # float32 rows of n values vs their packed bits (+ 12 bytes of norm and row id each)
    assert dense == 10_000 * (4 * n + 12) and signs == 10_000 * (packed_width(n) + 12)


def test_rows_without_a_sign_are_refused_naming_them() -> None:
    from gradian.build.shard_rows import ShardJob, ShardRows, write_job
    from gradian.index.formats.base import StorageOverflowError
    from gradian.index.formats.signs import SignsFormat

    buffer = ShardRows(2, SignsFormat(coordinates=2), torch.device("cpu"))
    buffer.add([1, 0], torch.tensor([[1.0, 2.0], [float("nan"), 1.0]]))  # the NaN row is row 6 + 0
    job = ShardJob(0, 6, buffer, torch.arange(2), {})
    with pytest.raises(StorageOverflowError, match=r"rows \[6\] have gradients that are not finite"):
        write_job(None, job)


def test_a_rerun_with_another_factor_sample_leaves_the_index_as_it_was(built, tmp_path) -> None:
    """The stored whitened matrices record grads.factor_rows; a rerun into the same directory with
    another value is refused (exit code 2) and the index still verifies (its file not replaced)."""
    cfg = _cfg(built["root"], "grads.row_format=signs", "grads.projection=whitened", "grads.factor_rows=5")
    with pytest.raises(UserError, match=r"factor_rows: 7 there, 5 now\); nothing was changed") as err:
        build_index(cfg.model, cfg.grads, built["whitened"])
    assert err.value.exit_code == 2
    assert IndexReader(built["whitened"]).verify() == []


@pytest.mark.parametrize("dim", [DIM, 16384])
def test_the_eigen_projection_rotates_blocks_into_the_kfac_eigenbasis(built, tmp_path, dim: int) -> None:
    """grads.projection=eigen: dense rows are kronecker_orthogonal's rotated (every cosine kept, same
    seed), and the index's own K-FAC factors are diagonal in that basis, largest first; also where
    the projection is square (16384 = the tiny GPT-2's whole 256 x 64 MLP weights: k = d)."""
    cfg = _cfg(built["root"], "grads.projection=eigen", "grads.preconditioner=kfac", f"grads.projection_dim={dim}")
    build_index(cfg.model, cfg.grads, tmp_path / "eigen")
    reader = IndexReader(tmp_path / "eigen")
    assert reader.manifest["projection"]["kind"] == "eigen" and reader.verify() == []
    eigen = torch.cat([g for _, g, _ in reader.shards()]).double()
    if dim == DIM:
        orth = torch.cat([g for _, g, _ in IndexReader(built["dense"]).shards()]).double()
    else:
        cfg = _cfg(built["root"], f"grads.projection_dim={dim}")
        build_index(cfg.model, cfg.grads, tmp_path / "orth")
        orth = torch.cat([g for _, g, _ in IndexReader(tmp_path / "orth").shards()]).double()
    gram = torch.nn.functional.normalize(eigen, dim=1) @ torch.nn.functional.normalize(eigen, dim=1).T
    want = torch.nn.functional.normalize(orth, dim=1) @ torch.nn.functional.normalize(orth, dim=1).T
    assert (gram - want).abs().max() < 1e-4
    from safetensors.torch import load_file

    from gradian.index.curvature import _read_shard_factors

    stored = load_file(str(reader.index_dir / "projection.safetensors"))  # the (k, k) rotations, not k x d
    k_o, k_i = reader.manifest["projection"]["modules"][next(iter(reader.manifest["projection"]["modules"]))]["factors"]
    assert stored["p_out.0"].shape == (k_o, k_o) and stored["p_in.0"].shape == (k_i, k_i)

    a_tot, s_tot, _ = _read_shard_factors(reader)  # every shard's K-FAC factors, summed
    for f in (a_tot[0], s_tot[0], a_tot[-1], s_tot[-1]):
        off = f - torch.diag(f.diagonal())
        assert off.abs().max() < 1e-4 * f.diagonal().max()  # diagonal: the eigenbasis
        assert (f.diagonal()[:-1] >= f.diagonal()[1:] - 1e-4 * f.diagonal().max()).all()  # largest first
    n = coordinates(reader.manifest)
    queries = eigen[[4]].float()
    top = stream_topk(tmp_path / "eigen", queries, top_k=3, score="ekfac")
    assert top["query_rows"][0, 0] == 4 and n == eigen.shape[1]


def test_the_eigen_factor_pass_is_estimated_as_projected(tmp_path) -> None:
    """At uniform widths the eigen projection's factor pass keeps projected activations and (k, k)
    sums: the estimate's term is that, far below the whitened projection's raw (d, d) one."""
    eigen = grads_estimate(_cfg(tmp_path, "grads.projection=eigen"), n_rows=100)
    whitened = grads_estimate(_cfg(tmp_path, "grads.projection=whitened"), n_rows=100)
    assert "eigen factor pass" in eigen.terms and "whitening factor pass" not in eigen.terms
    assert eigen.terms["eigen factor pass"] < whitened.terms["whitening factor pass"]


def test_popcount_without_numpy_2(monkeypatch) -> None:
    """NumPy 1.26 (which pyproject.toml admits) has no bitwise_count: the byte table gives the same counts."""
    import numpy as np

    from gradian.index.formats import signs

    words = np.random.default_rng(0).integers(0, 2**63, size=(5, 7), dtype=np.uint64)
    want = np.array([[bin(int(w)).count("1") for w in row] for row in words])
    assert (signs.popcount(words) == want).all()
    monkeypatch.delattr(np, "bitwise_count", raising=False)
    assert (signs.popcount(words) == want).all()
    rows, queries = torch.randn(9, 200), torch.randn(2, 200)
    assert torch.equal(SignScorer(queries)(pack(rows)),
                       torch.where(queries >= 0, 1.0, -1.0) @ torch.where(rows >= 0, 1.0, -1.0).T)
