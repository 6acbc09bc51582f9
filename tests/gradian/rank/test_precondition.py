"""Scores beyond cosine: the per-module preconditioner (influence, whitened), the margin loss
(grads.loss) and the orthogonalised Kronecker projection, each against a direct computation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuitkit_app.config import compose
from gradian.build.indexer import build_index
from gradian.curvature.moments import Preconditioner, shard_second_moment
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector, projection_fingerprint
from gradian.rank.scores import stream_topk

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows
DIM = 16


def _build(root: Path, name: str, *overrides: str) -> Path:
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    index_dir = root / name
    _, cfg = compose(["model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
                      f"grads.data_path={data}", *overrides])
    build_index(cfg.model, cfg.grads, index_dir)
    return index_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("precond")


@pytest.fixture(scope="module")
def index(root: Path) -> Path:
    return _build(root, "module", "grads.preconditioner=module", "grads.rows_per_shard=7")


def _stored(index_dir: Path) -> torch.Tensor:
    return torch.cat([g for _, g, _ in IndexReader(index_dir).shards()]).double()


def _dense_scores(x: torch.Tensor, q: torch.Tensor, n_blocks: int, damping: float = 0.1) -> dict[str, torch.Tensor]:
    """The scores by their definition, with one dense (W, W) block-diagonal matrix."""
    n, width = x.shape
    k = width // n_blocks
    blocks = []
    for m in range(n_blocks):
        xm = x[:, m * k:(m + 1) * k]
        fisher = xm.T @ xm / n
        lam = damping * torch.trace(fisher) / k
        blocks.append(torch.linalg.inv(fisher + lam * torch.eye(k, dtype=torch.float64)))
    a = torch.block_diag(*blocks)
    influence = q @ a @ x.T
    q_norm = torch.einsum("qi,ij,qj->q", q, a, q).sqrt()
    x_norm = torch.einsum("ni,ij,nj->n", x, a, x).sqrt()
    return {"influence": influence, "whitened": influence / q_norm[:, None] / x_norm[None, :]}


@pytest.mark.parametrize("score", ["influence", "whitened"])
@pytest.mark.parametrize("damping", [None, 0.01])
def test_preconditioned_scores_equal_a_dense_computation(index: Path, score: str, damping: float | None) -> None:
    x = _stored(index)
    n_blocks = len(IndexReader(index).manifest["projection"]["modules"])
    assert n_blocks == 8 and x.shape == (len(ROWS), 8 * DIM)
    gen = torch.Generator().manual_seed(0)
    q = torch.cat([x[:3], torch.randn(2, x.shape[1], generator=gen, dtype=torch.float64) * x.std()])
    want = _dense_scores(x, q, n_blocks, 0.1 if damping is None else damping)[score]
    top = stream_topk(index, q.float(), top_k=len(ROWS), score=score, aggregate="mean", damping=damping)
    got = torch.zeros_like(want)
    got.scatter_(1, top["query_rows"], top["query_scores"].double())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
    # The aggregate ranks rows by the mean over queries of the same scores.
    agg = torch.zeros(len(ROWS), dtype=torch.float64).scatter_(0, top["aggregate_rows"], top["aggregate_scores"].double())
    torch.testing.assert_close(agg, want.mean(0), rtol=1e-4, atol=1e-6 * want.abs().max().item())


def test_whitened_differs_from_cosine(index: Path) -> None:
    x = _stored(index).float()
    cos = stream_topk(index, x[:4], top_k=len(ROWS), score="cosine")
    white = stream_topk(index, x[:4], top_k=len(ROWS), score="whitened")
    assert torch.equal(cos["query_rows"][:, 0], torch.arange(4))  # each row finds itself first, either way
    assert torch.equal(white["query_rows"][:, 0], torch.arange(4))
    assert white["query_scores"][:, 0] == pytest.approx([1.0] * 4, abs=1e-5)
    assert not torch.equal(cos["query_rows"], white["query_rows"])  # but the rest is ranked differently


def test_second_moment_sums_do_not_depend_on_sharding_or_workers(root: Path, index: Path) -> None:
    one = _build(root, "one-shard", "grads.preconditioner=module", "grads.rows_per_shard=64")
    workers = root / "workers"
    for w in (0, 1):
        _, cfg = compose(["model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
                          f"grads.data_path={root / 'train.jsonl'}", "grads.preconditioner=module",
                          "grads.rows_per_shard=7", "grads.num_shards=2", f"grads.shard_index={w}"])
        build_index(cfg.model, cfg.grads, workers)
    totals = {name: torch.stack(IndexReader(d).second_moment_sums()).double().sum(0)
              for name, d in (("7", index), ("64", one), ("workers", workers))}
    # What the sums must be: the stored rows' outer products, per block.
    x = _stored(one)
    want = torch.stack([x[:, m * DIM:(m + 1) * DIM].T @ x[:, m * DIM:(m + 1) * DIM] for m in range(8)])
    for total in totals.values():
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(totals["7"], totals["workers"])  # same shards, same bytes
    assert IndexReader(index).verify() == [] and IndexReader(workers).verify() == []


def test_verify_recomputes_the_second_moment(index: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from circuitkit.core.io import sha256_file

    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    shard = copy / "shard-00000.safetensors"
    tensors = load_file(shard)
    tensors["second_moment"] = tensors["second_moment"] * 1.01
    save_file(tensors, shard)
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["shards"]["shard-00000.safetensors"]
    entry["sha256"], entry["bytes"] = sha256_file(shard), shard.stat().st_size  # a consistent forgery
    (copy / "manifest.json").write_text(json.dumps(manifest))
    problems = IndexReader(copy).verify()
    assert problems == ["shard-00000.safetensors second_moment is not the sum of its stored rows' outer products"]


def test_preconditioned_score_needs_the_index_to_hold_second_moments(root: Path, tmp_path: Path) -> None:
    from circuitkit_app.gradian_cli import main

    plain = _build(root, "plain")
    assert "second_moment" not in json.dumps(IndexReader(plain).manifest)
    with pytest.raises(IndexMismatchError, match="grads.preconditioner=module"):
        stream_topk(plain, torch.ones(1, 8 * DIM), score="whitened")
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")
    assert main(["rank", "--index", str(plain), "--queries", str(queries), "--score", "influence"]) == 2


def test_preconditioner_refuses_raw_rows() -> None:
    from gradian.curvature.moments import check_block_width

    with pytest.raises(ValueError, match="grads.projection_dim=None"):
        check_block_width(None, "module")
    check_block_width(None, "none")


def test_damping_rule() -> None:
    rows = torch.randn(50, 2 * 4, generator=torch.Generator().manual_seed(1)).double()
    p = Preconditioner.from_sums([shard_second_moment(rows[:20].float(), 2), shard_second_moment(rows[20:].float(), 2)],
                                 50, damping=0.1)
    for m in range(2):
        fisher = rows[:, m * 4:(m + 1) * 4].T @ rows[:, m * 4:(m + 1) * 4] / 50
        assert p.lambdas[m].item() == pytest.approx(0.1 * torch.linalg.eigvalsh(fisher).mean().item(), rel=1e-5)
        torch.testing.assert_close(p.whitener[m].T @ p.whitener[m], p.inverse[m])
        lam = p.lambdas[m].item()
        torch.testing.assert_close(p.inverse[m], torch.linalg.inv(fisher + lam * torch.eye(4, dtype=torch.float64)))


# ----------------------------------------------------------------------------- grads.loss


def test_margin_is_the_negated_log_odds() -> None:
    from gradian.capture.gradients import token_losses

    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0)) * 4
    logits[0, 3] = 40.0  # a confident token: 1 - p underflows in float32
    targets = torch.tensor([3, 1, 2, 10, 0, 5])
    p = torch.softmax(logits.double(), dim=1).gather(1, targets[:, None])[:, 0]
    got = token_losses(logits, targets, "margin").double()
    torch.testing.assert_close(got[1:], -torch.log(p[1:] / (1 - p[1:])), rtol=1e-5, atol=1e-5)
    others = logits.double().clone()
    others[0, 3] = float("-inf")
    assert got[0].item() == pytest.approx((torch.logsumexp(others[0], 0) - 40.0).item(), rel=1e-5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(token_losses(logits, targets, "ce").double(), -torch.log(p), rtol=1e-5, atol=1e-6)


def test_margin_gradient_is_cross_entropys_over_one_minus_p() -> None:
    from gradian.capture.gradients import token_losses

    logits = (torch.randn(5, 9, generator=torch.Generator().manual_seed(2)) * 3).double().requires_grad_(True)
    targets = torch.tensor([0, 4, 8, 2, 2])
    (g_margin,) = torch.autograd.grad(token_losses(logits, targets, "margin").sum(), logits)
    (g_ce,) = torch.autograd.grad(token_losses(logits, targets, "ce").sum(), logits)
    p = torch.softmax(logits.detach(), 1).gather(1, targets[:, None])
    torch.testing.assert_close(g_margin, g_ce / (1 - p))


def test_margin_function_equals_its_autograd_composition_and_keeps_one_vocabulary_tensor() -> None:
    from gradian.capture.gradients import _Margin, token_losses

    logits = (torch.randn(7, 13, generator=torch.Generator().manual_seed(4)) * 5).double().requires_grad_(True)
    targets = torch.tensor([0, 12, 3, 3, 7, 1, 9])
    assert torch.autograd.gradcheck(lambda z: _Margin.apply(z, targets), (logits,))
    weights = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    others = logits.scatter(1, targets[:, None], float("-inf"))
    plain = torch.logsumexp(others, 1) - logits.gather(1, targets[:, None])[:, 0]
    got = token_losses(logits, targets, "margin")
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    (g_plain,) = torch.autograd.grad((plain * weights).sum(), logits)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_plain, rtol=1e-12, atol=1e-12)
    # What the graph keeps: one (N, V) tensor (the softmax over the other classes) and the targets.
    z = torch.randn(64, 4096, requires_grad=True)
    out = _Margin.apply(z * 1.0, torch.zeros(64, dtype=torch.long))
    kept = [t for t in out.grad_fn.saved_tensors if t.numel() == 64 * 4096]
    assert len(kept) == 1


def test_margin_index_records_its_loss_and_queries_use_it(root: Path, tmp_path: Path) -> None:
    from gradian.rank.ranking import rank

    margin = _build(root, "margin", "grads.loss=margin")
    ce = _build(root, "ce", "grads.loss=ce")
    assert IndexReader(margin).manifest["loss"] == "margin"
    a, b = _stored(margin), _stored(ce)
    # Each token's logit gradient is cross-entropy's divided by 1 - p (test below): on this
    # untrained model p is ~1/vocab, so the rows are close but a little larger, never equal.
    assert not torch.equal(a, b) and (a.norm(dim=1) > b.norm(dim=1)).all()
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[9]) + "\n")
    results = rank(margin, queries, top_k=1, score="cosine")
    assert results[0]["row_id"] == 9 and results[0]["score"] == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- projection


def test_orthogonal_kronecker_factors() -> None:
    shapes = {"m": (12, 10)}
    p = Projector(shapes, "kronecker_orthogonal", 12, seed=3)
    p_out, p_in = p.kronecker_matrices("m")
    k_o, k_i = p.factors["m"]
    assert p_out.shape == (k_o, 12) and p_in.shape == (k_i, 10)
    torch.testing.assert_close(p_out @ p_out.T, torch.eye(k_o) * 12 / k_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_in @ p_in.T, torch.eye(k_i) * 10 / k_i, rtol=1e-5, atol=1e-5)
    again = Projector(shapes, "kronecker_orthogonal", 12, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(p.kronecker_matrices("m"), again.kronecker_matrices("m"), strict=True))
    assert projection_fingerprint(p) != projection_fingerprint(Projector(shapes, "kronecker", 12, seed=3))
    # The contraction over positions equals projecting the formed gradient.
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(2, 5, 10, generator=gen), torch.randn(2, 5, 12, generator=gen)
    grad = torch.einsum("bto,bti->boi", delta, x)
    torch.testing.assert_close(p.project("m", x, delta), p.project_gradient("m", grad), rtol=1e-5, atol=1e-5)
    # Unbiased: the mean of Pᵀ P over seeds is the identity.
    mean = sum(Projector(shapes, "kronecker_orthogonal", 12, seed=s).kronecker_matrices("m")[0].T
               @ Projector(shapes, "kronecker_orthogonal", 12, seed=s).kronecker_matrices("m")[0]
               for s in range(300)) / 300
    assert (mean - torch.eye(12)).abs().max() < 0.25


def test_orthogonal_index_passes_verify_and_ranks(root: Path, tmp_path: Path) -> None:
    from gradian.rank.ranking import rank

    orth = _build(root, "orth", "grads.projection=kronecker_orthogonal")
    assert IndexReader(orth).manifest["projection"]["kind"] == "kronecker_orthogonal"
    assert IndexReader(orth).verify() == []
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[4]) + "\n")
    assert rank(orth, queries, top_k=1)[0]["row_id"] == 4


def test_shard_buffer_counts_the_second_moments() -> None:
    from gradian.build.checks import check_shard_buffer
    from gradian.settings.grads import GradsConfig

    plain = GradsConfig(rows_per_shard=100, projection_dim=16, preconditioner="none")
    module = GradsConfig(rows_per_shard=100, projection_dim=16, preconditioner="module")
    kfac = GradsConfig(rows_per_shard=100, projection_dim=16, preconditioner="kfac")
    assert check_shard_buffer(plain, 50, 8 * 16, 8) == 50 * 128 * 4
    # + the float64 factor sums, bounded by 4 k per block (two sides of at most k entries each).
    assert check_shard_buffer(kfac, 50, 8 * 16, 8) == 50 * 128 * 4 + 8 * 4 * 16 * 8
    # + 8 blocks of 16 x 16 float32, + one block's float64 scratch of 50 x 16.
    assert check_shard_buffer(module, 50, 8 * 16, 8) == 50 * 128 * 4 + 8 * 16 * 16 * 4 + 50 * 16 * 8
