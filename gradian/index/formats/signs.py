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
(`IndexReader.shards(signs=False)`, the default). `SignsFormat` is the format's side of
`gradian.index.formats.base.RowFormat`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradian.index.formats.base import RowFormat, Scorer, no_sign_error

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


@dataclass(frozen=True)
class SignsFormat(RowFormat):
    """Rows of `coordinates` signs, packed into (n, packed_width(coordinates)) uint8; every row's norm is
    √coordinates. Scored by cosine and dot only; no curvature is computed from them."""

    name = SIGNS
    scores = ("cosine", "dot")
    read_dtype = torch.uint8

    coordinates: int
    storage_dtype: str = "float16"  # recorded, unused: a sign takes a bit whatever the dtype

    @classmethod
    def config_problem(cls, grads) -> str | None:
        if grads.preconditioner == "none":
            return None
        return (f"grads.row_format=signs with grads.preconditioner={grads.preconditioner}: sign rows keep one bit per"
                " coordinate, no magnitudes, so no second moment or K-FAC curvature can be computed from them or"
                " applied to them. Set grads.preconditioner=none (with grads.projection=eigen, as the grads=signs"
                " preset, or whitened the signs are already of K-FAC-preconditioned coordinates), or"
                " grads.row_format=dense.")

    @classmethod
    def stored_width(cls, grads, projector) -> int:
        return packed_width(projector.total_width)

    @classmethod
    def value_bytes(cls, grads) -> int:
        return 1  # `stored_width` counts bytes

    @classmethod
    def computed_text(cls, grads) -> str:
        return "sign bits"

    @classmethod
    def stored_text(cls, grads) -> str:
        return "bytes of packed sign bits"

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> SignsFormat:
        return cls(coordinates(manifest), manifest.get("storage_dtype", "float16"))

    @classmethod
    def manifest_problems(cls, manifest: Mapping[str, Any], where: str) -> list[str]:
        problems = super().manifest_problems(manifest, where)
        if not problems and manifest.get("preconditioner", "none") != "none":
            return [f"{where}: sign rows with preconditioner {manifest.get('preconditioner')!r} (no curvature is"
                    " computed from signs); rebuild the index"]
        return problems

    @classmethod
    def describe(cls, summary: Mapping[str, Any]) -> tuple[str, str]:
        return (f"{summary.get('row_width')} bytes (packed sign bits)",
                "signs: one bit per projected coordinate, scored by n - 2 x Hamming distance")

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def width(self) -> int:
        return packed_width(self.coordinates)

    @property
    def query_width(self) -> int:
        return self.coordinates

    @property
    def dtype_text(self) -> str:
        return "packed sign bits (uint8)"

    def pack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`pack_rows` on the device; a row that is not finite has no sign (both flags false). Rows given
        as uint8 are taken as packed already."""
        if rows.dtype == torch.uint8:
            finite = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
            packed = rows
        else:
            packed, finite = pack_rows(rows)
        return packed, self.norms(packed), torch.stack([finite, finite], dim=1)

    def norms(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.full((stored.shape[0],), math.sqrt(self.coordinates), dtype=torch.float32, device=stored.device)

    def non_finite_error(self, rows: list[int], k: int, finite_in_float32: bool) -> Exception:
        return no_sign_error(rows)

    def stored_problem(self, stored: torch.Tensor) -> str | None:
        if tuple(stored.shape[1:]) == (self.width,):
            return None
        return (f"sign rows of {tuple(stored.shape[1:])} bytes, the header's {self.coordinates} coordinates pack into"
                f" {self.width}.")

    def projection_width(self, projector) -> tuple[int, str]:
        return packed_width(projector.total_width), " (bytes of packed sign bits)"

    def reader_refusal(self, index_dir: Path) -> str:
        return (f"{index_dir} stores sign rows (grads.row_format=signs: one bit per coordinate, no magnitudes), which"
                " this reader cannot use as float rows. Rank it with `gradian rank` (cosine or dot), or rebuild it"
                " with grads.row_format=dense.")

    def score_refusal(self, index_dir: Path, score: str) -> str:
        return (f"--score {score} on {index_dir}: it stores sign rows (grads.row_format=signs, one bit per coordinate),"
                f" which carry no magnitudes for {score}. Rank it with --score cosine or dot (n - 2 x Hamming distance;"
                " with grads.projection=eigen or whitened the signs are already of K-FAC-preconditioned coordinates),"
                " or rebuild it with grads.row_format=dense.")

    def scorer(self, queries: torch.Tensor, *, cosine: bool, preconditioned: bool) -> Scorer:
        signed = SignScorer(queries)  # n - 2 x Hamming distance; cosine divides by n (every ±1 row has norm √n)

        def score(grads: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
            return signed(grads) / (signed.n if cosine else 1.0)

        return score
