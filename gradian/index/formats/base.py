"""The row-format interface: everything the writer, the reader, `gradian inspect --verify`, the scores and
the curvature need to know about how an index stores its rows, in one class per format.

A format is bound to one index (`from_manifest`: its width, dtype and layout come from the manifest or
the indexer's header); what is known from the config alone, before any row (the stored width, the
bytes per value, what the capture computes), is a classmethod taking `grads` (a `GradsConfig`).

    pack(rows)          (B, computed) float32 on the device -> stored (B, width), norms (B,), finite (B, 2)
    norms(stored)       (n, width) stored -> (n,) float32: the norms cosine divides by
    scorer(q, ...)      (Q, query_width) float32 -> a function (grads, norms) -> (Q, n) scores
    ekfac_squares(...)  one shard's contribution to EK-FAC's Σ (Q_outᵀ G Q_in)² per module

`pack` runs on the device inside the index loop: no `.item()`, `.cpu()`, `.tolist()` or `nonzero` (the
host learns which rows were not finite from the flags, once per shard). Refusals are one sentence that
names the setting to change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from circuitkit.core.device import DTYPES

# The scores `gradian rank` knows (`gradian.rank.scores`); a format lists those it can be scored by.
SCORES = ("cosine", "dot", "influence", "whitened", "kfac", "ekfac")
# Norms below this count as zero: a zero gradient has no direction, its cosine is defined as 0.
EPS = 1e-12

# (grads (n, width) as `IndexReader.shards` hands them out, norms (n,)) -> scores (Q, n) float32
Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_unit_norm(scores: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Scores (Q, n) divided by the rows' stored norms (n,): the cosine's row side (a zero row scores 0)."""
    return scores / norms.float().clamp_min(EPS)


class StorageOverflowError(OverflowError):
    """Values do not fit the storage dtype (float16 tops out at 65504)."""


def overflow_error(rows: list[int], k: int, finite_in_float32: bool) -> StorageOverflowError:
    """The refusal of shard k, whose `rows` are not finite once stored: float16's range exceeded
    (`finite_in_float32`) or not finite to begin with. Nothing of the shard is written."""
    why = "exceed the float16 range (|x| > 65504)" if finite_in_float32 else "are not finite (inf/nan) in float32 already"
    return StorageOverflowError(f"rows {rows[:10]} of shard {k} {why}; nothing of this shard was written. Set"
                                " grads.storage_dtype=bfloat16 (same size, float32's range) or float32.")


def no_sign_error(rows: list[int]) -> StorageOverflowError:
    """The refusal of sign rows whose gradients are not finite (a NaN has no sign)."""
    return StorageOverflowError(f"rows {rows[:10]} have gradients that are not finite (inf/nan), so they have no sign;"
                                " nothing of this shard was written. Check those rows, or run with"
                                " model.precision=float32.")


class RowFormat(ABC):
    """How an index stores its rows (module docstring). Subclasses are frozen dataclasses holding what
    one index's manifest says of its rows; `FORMATS` in `gradian.index.formats` lists them by name."""

    name: ClassVar[str]  # grads.row_format, recorded as the manifest's row_format
    scores: ClassVar[tuple[str, ...]] = SCORES  # what `stream_topk` can score the rows by
    float_rows: ClassVar[bool] = False  # the stored values are the dense rows: any float reader can use them
    moments: ClassVar[bool] = False  # shards may hold the module second moments of their rows
    read_dtype: ClassVar[torch.dtype] = torch.float32  # what `IndexReader.shards` hands the rows out as
    storage_dtype: str  # grads.storage_dtype as recorded (a format may store another dtype: `dtype`)

    # -- from the config, before any row (the indexer and the memory estimate) ------------------------------
    @classmethod
    def config_problem(cls, grads) -> str | None:
        """What this format cannot store with the other grads settings (one sentence naming the keys), or None."""
        return None

    @classmethod
    def capture(cls, grads, projector) -> Any:
        """What stands in for `Projector.combine` while the rows are computed (`gradian.capture.gradients`,
        its `factored` argument): None, the projector's dense blocks."""
        return None

    @classmethod
    def computed_width(cls, grads, projector) -> int:
        """float32 values per row as the capture computes it, before it is stored."""
        return projector.total_width

    @classmethod
    def stored_width(cls, grads, projector) -> int:
        """Values per stored row (the manifest's row_width), `value_bytes` each."""
        return cls.computed_width(grads, projector)

    @classmethod
    def value_bytes(cls, grads) -> int:
        """Bytes of one stored value."""
        return DTYPES[grads.storage_dtype].itemsize

    @classmethod
    def computed_text(cls, grads) -> str:
        """What a computed row's values are, for the indexer's opening line ("float16 values")."""
        return f"{grads.storage_dtype} values"

    @classmethod
    def stored_text(cls, grads) -> str:
        """What the stored width counts, for the shard-buffer refusal ("float16 values")."""
        return f"{grads.storage_dtype} values"

    # -- from the manifest -----------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> RowFormat:
        """The format of the index whose manifest (or the indexer's header) this is."""

    @classmethod
    def manifest_problems(cls, manifest: Mapping[str, Any], where: str) -> list[str]:
        """What a reader cannot take in a manifest of this format, each a sentence ending with its fix."""
        rank = manifest.get("row_rank")
        return [] if rank is None else [f"{where}: row_rank {rank!r} with {cls.name} rows; rebuild the index"]

    @classmethod
    def describe(cls, summary: Mapping[str, Any]) -> tuple[str, str]:
        """`gradian inspect`'s lines "row width" and "row format" for an index's summary."""
        return f"{summary.get('row_width')} ({summary.get('storage_dtype')})", cls.name

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored rows (a shard's grads)."""
        return DTYPES[self.storage_dtype]

    @property
    @abstractmethod
    def width(self) -> int | None:
        """Values per stored row (None: a bare store whose header records none)."""

    @property
    def query_width(self) -> int | None:
        """The width of the dense query rows the scores take."""
        return self.width

    def pack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows (B, computed) float32 -> (stored (B, width) in `dtype`, norms (B,) float32 of what is stored,
        finite (B, 2) bool: the stored and the computed values finite), on rows' device, with no wait."""
        computed = rows.float()
        stored = computed.to(self.dtype)
        finite = torch.stack([torch.isfinite(stored).all(dim=1), torch.isfinite(computed).all(dim=1)], dim=1)
        return stored, self.norms(stored), finite

    @abstractmethod
    def norms(self, stored: torch.Tensor) -> torch.Tensor:
        """(n, width) stored rows -> (n,) float32: the norms of what the rows stand for."""

    def non_finite_error(self, rows: list[int], k: int, finite_in_float32: bool) -> Exception:
        """The refusal of shard k whose `rows` (row ids) are not finite once stored (`pack`'s flags)."""
        return overflow_error(rows, k, finite_in_float32)

    def stored_problem(self, stored: torch.Tensor) -> str | None:
        """What is wrong with rows handed to `IndexWriter.write_shard` in their stored form, or None."""
        return None

    def grads_problems(self, name: str, grads: torch.Tensor, n_rows: int) -> list[str]:
        """What in shard `name`'s grads (expected: `n_rows` rows) disagrees with the manifest."""
        problems = []
        want = (n_rows, self.width) if isinstance(self.width, int) else (n_rows,) + tuple(grads.shape[1:])
        if tuple(grads.shape) != want or grads.ndim != 2:
            problems.append(f"{name} grads have shape {tuple(grads.shape)}, the manifest says {want}")
        if grads.dtype != self.dtype:
            problems.append(f"{name} grads are {grads.dtype}, the manifest says {self.dtype_text}")
        return problems

    @property
    def dtype_text(self) -> str:
        """The stored dtype as a refusal names it."""
        return str(self.storage_dtype)

    def projection_width(self, projector) -> tuple[int, str]:
        """(row_width, how it follows from the projector's width) of rows of `projector` in this format."""
        return projector.total_width, ""

    def reader_refusal(self, index_dir: Path) -> str:
        """Why a reader of dense float rows cannot use this index (`float_rows` False)."""
        return (f"{index_dir} stores {self.name} rows (grads.row_format={self.name}), which this reader cannot use"
                " as dense float rows. Rank it with `gradian rank`, or rebuild it with grads.row_format=dense.")

    def score_refusal(self, index_dir: Path, score: str) -> str:
        """Why `score` cannot rank this index (a score not in `scores`)."""
        return (f"--score {score} on {index_dir}: it stores {self.name} rows (grads.row_format={self.name}); rank"
                f" it with --score {' or '.join(self.scores)}, or rebuild it with grads.row_format=dense.")

    @abstractmethod
    def scorer(self, queries: torch.Tensor, *, cosine: bool, preconditioned: bool) -> Scorer:
        """Scores of the rows against `queries` (Q, query_width) float32 (unit rows when `cosine`): ⟨q, g⟩,
        divided by the row norms when `cosine`. `preconditioned`: the queries are (F + λI)⁻¹ q, of full rank."""

    def ekfac_squares(self, rows: torch.Tensor, shapes: list[tuple[int, int]], q_in: list[torch.Tensor],
                      q_out: list[torch.Tensor]) -> list[torch.Tensor]:
        """Σ over `rows` of (Q_outᵀ G Q_in)² per module, (k_o, k_i) float64: a shard's part of EK-FAC's
        eigenvalues (`gradian.index.curvature.ekfac_eigenvalues`)."""
        raise ValueError(f"{self.name} rows hold no gradient blocks to compute EK-FAC eigenvalues from; rebuild the"
                         " index with grads.row_format=dense.")
