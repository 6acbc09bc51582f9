"""Sign rows (`grads.row_format: signs`): one bit per projected coordinate.

A stored row keeps only the sign of each coordinate of the projected gradient g (n coordinates,
every module's block in row order): bit j is 1 where g_j >= 0, packed little-endian into 64-bit
words, so a row takes 8 · ceil(n / 64) bytes instead of n · 2 (float16) or n · 4 (float32). Every
query is signed the same way, and a row's score is the inner product of the two ±1 vectors,

    dot(q, g)    = n - 2 · popcount(bits_q XOR bits_g)      (an integer in [-n, n])
    cosine(q, g) = dot / n                                   (every ±1 row has norm √n)

computed with XOR and a population count on the packed words (`popcount`): the rows are
never unpacked. What the signs stand for depends on the projection:

* ``eigen`` (the preset `conf/grads/signs.yaml`): each coordinate is one direction of the module's
  K-FAC eigenbasis (`gradian.projection.projector`), and ±1 per coordinate weighs every direction alike, as
  EK-FAC's preconditioning whitens them: EOGP's rows (Heo, Rosser, Kim, 2026) with every
  coordinate kept. Wider projections are what the bytes buy (16,384 coordinates per module in the
  bytes of the default's 1,024 float16 values; docs/benchmarks/gradian-indexing.md, "Sign rows, stored").
* ``whitened``: the coordinates are a random orthogonal projection of the damped K-FAC-whitened
  gradient, so the share of equal signs estimates the angle between whitened gradients (1 - θ/π,
  sign random projections: Charikar 2002), a K-FAC-preconditioned cosine.
* ``kronecker_orthogonal`` / ``kronecker``: the same for the raw gradients' cosine.

Sign rows hold no magnitudes, so nothing that needs them reads them: the module second moments
and K-FAC factors (`grads.preconditioner` must be none), and the scores influence, whitened, kfac
and ekfac; every reader that would multiply them as float rows refuses the index
(`IndexReader.shards(signs=False)`, the default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

SIGNS = "signs"
WORD_BYTES = 8  # rows are packed into 64-bit words


def is_signs(manifest: Mapping[str, Any]) -> bool:
    """Whether an index manifest (or header) records sign rows."""
    return manifest.get("row_format", "dense") == SIGNS


def packed_width(n: int) -> int:
    """Bytes of a packed row of n coordinates: whole 64-bit words."""
    return WORD_BYTES * math.ceil(n / 64)


def coordinates(manifest: Mapping[str, Any]) -> int:
    """n, the coordinates a sign row of this manifest stands for: Σ over modules of the projected width."""
    modules = (manifest.get("projection") or {}).get("modules") or {}
    return sum(int(e["width"]) for e in modules.values())


class NonFiniteRows(ValueError):
    """Rows with a value that is not finite (a NaN has no sign); `positions`: their indices in the input."""

    def __init__(self, positions: list[int]) -> None:
        super().__init__(f"rows {positions[:10]} hold values that are not finite: they have no sign.")
        self.positions = positions


def pack_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n) real -> (packed (N, packed_width(n)) uint8, finite (N,) bool), on rows' device with no
    wait for it: bit j of byte w is set where rows[:, 8w + j] >= 0 (numpy's little-endian packbits;
    padding bits 0). A row that is not `finite` has no sign: its bytes are meaningless."""
    n_rows, n = rows.shape
    bits = torch.zeros(n_rows, 8 * packed_width(n), dtype=torch.uint8, device=rows.device)
    bits[:, :n] = rows.detach() >= 0
    weights = torch.ones(8, dtype=torch.uint8, device=rows.device) << torch.arange(8, dtype=torch.uint8, device=rows.device)
    packed = (bits.view(n_rows, -1, 8) * weights).sum(dim=2, dtype=torch.uint8)
    return packed, torch.isfinite(rows.detach()).all(dim=1)


def pack(rows: torch.Tensor) -> torch.Tensor:
    """(N, n) real -> (N, packed_width(n)) uint8 on the host (`pack_rows`).

    NonFiniteRows (a ValueError) naming the rows when a value is not finite."""
    packed, finite = pack_rows(rows)
    finite = finite.cpu()
    if not finite.all():
        raise NonFiniteRows((~finite).nonzero().flatten().tolist())
    return packed.cpu()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ±1 float32 rows (N, n) a packed (N, packed_width(n)) uint8 tensor stands for."""
    bits = np.unpackbits(packed.numpy(), axis=1, bitorder="little")[:, :n]
    return torch.from_numpy(bits.astype(np.float32) * 2 - 1)


def _words(packed: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(packed.numpy()).view(np.uint64)


_BYTE_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per element of a uint64 array: `np.bitwise_count` (NumPy >= 2.0), else a byte table
    (NumPy 1.26, which pyproject.toml admits)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    return _BYTE_POPCOUNT[words.view(np.uint8)].reshape(*words.shape, 8).sum(-1, dtype=np.uint8)


class SignScorer:
    """dot = n - 2 · Hamming distance of each signed query to each packed row (`__call__`:
    (N, packed) uint8 rows -> (Q, N) float32), one XOR and popcount pass per query."""

    def __init__(self, queries: torch.Tensor) -> None:
        self.n = int(queries.shape[1])
        self.width = packed_width(self.n)
        self.queries = _words(pack(queries))  # (Q, words)

    def __call__(self, packed_rows: torch.Tensor) -> torch.Tensor:
        if packed_rows.dtype != torch.uint8 or packed_rows.ndim != 2 or packed_rows.shape[1] != self.width:
            raise ValueError(f"sign rows must be (N, {self.width}) uint8 for {self.n} coordinates, got"
                             f" {tuple(packed_rows.shape)} {packed_rows.dtype}.")
        words = _words(packed_rows)
        out = np.empty((self.queries.shape[0], words.shape[0]), dtype=np.float32)
        for i, q in enumerate(self.queries):
            differ = popcount(words ^ q).sum(axis=1, dtype=np.int64)
            out[i] = self.n - 2 * differ
        return torch.from_numpy(out)
