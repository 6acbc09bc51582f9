"""The sign-bit rows of scripts/bench/bench_signbits.py: packing, popcount scores, eigenbasis coordinates."""

from __future__ import annotations

import torch

from gradian.index.curvature import KroneckerCurvature
from scripts.bench.bench_signbits import eigen_coordinates, pack_signs, packed_sign_scores


def test_packed_scores_equal_the_sign_inner_products():
    gen = torch.Generator().manual_seed(0)
    q, g = torch.randn(3, 21, generator=gen), torch.randn(5, 21, generator=gen)  # 21: a partial last byte
    q_bits, g_bits = pack_signs(q), pack_signs(g)
    assert q_bits.shape == (3, 3) and q_bits.dtype == torch.uint8
    want = torch.where(q >= 0, 1, -1) @ torch.where(g >= 0, 1, -1).T
    assert torch.equal(packed_sign_scores(q_bits, g_bits, 21), want.int())
    # a row against itself scores n, against its negation -n
    assert packed_sign_scores(pack_signs(g[:1]), pack_signs(torch.cat([g[:1], -g[:1]])), 21).tolist() == [[21, -21]]
    assert pack_signs(torch.tensor([[1.0, -1.0, 0.0, -2.0, 3.0, -1.0, -1.0, 1.0]])).tolist() == [[0b10101001]]


def _curvature(shapes: list[tuple[int, int]], rows: torch.Tensor) -> KroneckerCurvature:
    """Random orthonormal bases and the rows' EK-FAC eigenvalues in them."""
    gen = torch.Generator().manual_seed(1)
    q_in = [torch.linalg.qr(torch.randn(k_i, k_i, generator=gen, dtype=torch.float64))[0] for _, k_i in shapes]
    q_out = [torch.linalg.qr(torch.randn(k_o, k_o, generator=gen, dtype=torch.float64))[0] for k_o, _ in shapes]
    eig, start = [], 0
    for m, (k_o, k_i) in enumerate(shapes):
        block = rows[:, start:start + k_o * k_i].double().reshape(-1, k_o, k_i)
        eig.append((q_out[m].T @ block @ q_in[m]).pow(2).mean(0))
        start += k_o * k_i
    return KroneckerCurvature(shapes, q_in, q_out, eig, damping=0.1)


def test_all_coordinates_in_float_give_the_ekfac_score():
    shapes = [(4, 3), (2, 5)]
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(9, 22, generator=gen) * torch.linspace(0.1, 3.0, 22)
    queries = torch.randn(4, 22, generator=gen)
    curv = _curvature(shapes, rows)
    full_q, full_g = eigen_coordinates(queries, curv, None), eigen_coordinates(rows, curv, None)
    want = curv.precondition(queries).double() @ rows.double().T  # qᵀ (F + λI)⁻¹ g
    assert torch.allclose(full_q.double() @ full_g.double().T, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_kept_coordinates_are_those_of_largest_eigenvalue():
    shapes = [(3, 3)]
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(50, 9, generator=gen) * torch.tensor([0.1, 5.0, 0.2, 0.3, 4.0, 0.1, 0.2, 3.0, 0.1])
    curv = _curvature(shapes, rows)
    curv.q_in, curv.q_out = [torch.eye(3, dtype=torch.float64)], [torch.eye(3, dtype=torch.float64)]
    curv.eigenvalues = [rows.double().pow(2).mean(0).reshape(3, 3)]
    kept = eigen_coordinates(rows, curv, 3)
    scale = (curv.eigenvalues[0].flatten() + curv.lambdas[0]).sqrt()
    # coordinates 1, 4, 7 carry the variance, in that order of eigenvalue
    order = curv.eigenvalues[0].flatten()[[1, 4, 7]].argsort(descending=True)
    want = (rows.double() / scale)[:, [1, 4, 7]][:, order]
    assert torch.allclose(kept.double(), want, atol=1e-6)
