"""A fourth row format is one file, one registry line, one schema choice and one test file: "halves", a
toy defined here (dense rows stored as float16 whatever grads.storage_dtype says, cosine and dot only),
registered at test time, builds an index with `gradian index`'s loop, reads back, verifies and ranks.

A real fourth format would be this diff (nothing else in the writer, reader, verify, scores or indexer):

    gradian/index/formats/halves.py        new: `class HalvesFormat(RowFormat)` as below, maths in the docstring
    gradian/index/formats/__init__.py      + from gradian.index.formats.halves import HalvesFormat
                                           + "halves": HalvesFormat,             (in FORMATS)
    gradian/settings/grads.py              row_format: ... choices=("dense", "factored", "signs", "halves")
    tests/gradian/index/test_halves.py     new: its bytes, its scores against an oracle, its refusals

plus, when its rows change what the index holds, a FORMAT_VERSION step (gradian.index.manifest) so older
readers refuse it rather than misread it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from circuitkit_app.config import compose
from gradian.build.indexer import build_index
from gradian.build.memory import grads_estimate
from gradian.index import formats
from gradian.index.formats.base import EPS, RowFormat, Scorer
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.rank.scores import stream_topk
from gradian.settings.grads import GradsConfig

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows


@dataclass(frozen=True)
class HalvesFormat(RowFormat):
    """Dense rows stored as float16, (n, row_width), whatever grads.storage_dtype records; the norm of a
    row is that of its float16 values, so cosine = qᵀ g / (|q| |g|) of what is stored."""

    name = "halves"
    scores = ("cosine", "dot")
    float_rows = True  # the stored values are the dense rows (rounded): any float reader can use them

    storage_dtype: str
    row_width: int | None = None

    @classmethod
    def config_problem(cls, grads) -> str | None:
        if grads.preconditioner == "none":
            return None
        return f"grads.row_format=halves with grads.preconditioner={grads.preconditioner}; set grads.preconditioner=none."

    @classmethod
    def value_bytes(cls, grads) -> int:
        return 2

    @classmethod
    def computed_text(cls, grads) -> str:
        return "float16 values"

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> HalvesFormat:
        return cls(manifest["storage_dtype"], manifest.get("row_width"))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16

    @property
    def dtype_text(self) -> str:
        return "float16 (halves)"

    @property
    def width(self) -> int | None:
        return self.row_width

    def norms(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.float().norm(dim=1)

    def scorer(self, queries: torch.Tensor, *, cosine: bool, preconditioned: bool) -> Scorer:
        def score(grads: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
            scores = queries @ grads.T
            return scores / norms.clamp_min(EPS) if cosine else scores

        return score


@pytest.fixture
def halves(monkeypatch) -> None:
    """HalvesFormat in the registry and "halves" among grads.row_format's choices, for one test."""
    monkeypatch.setitem(formats.FORMATS, "halves", HalvesFormat)
    field = next(f for f in dataclasses.fields(GradsConfig) if f.name == "row_format")
    monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata,
                                                             "choices": (*field.metadata["choices"], "halves")}))


def _build(root: Path, name: str, *overrides: str) -> Path:
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose(["model.precision=float32", "grads.projection_dim=64", "grads.module_filter=[mlp]",
                      "grads.rows_per_shard=7", "grads.storage_dtype=float32", "grads.preconditioner=none",
                      f"grads.data_path={data}", *overrides])
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


def test_the_registry_lists_the_schemas_row_formats() -> None:
    assert tuple(formats.FORMATS) == dataclasses.fields(GradsConfig)[
        [f.name for f in dataclasses.fields(GradsConfig)].index("row_format")].metadata["choices"]


def test_a_toy_fourth_format_builds_verifies_and_ranks(halves, tmp_path) -> None:
    dense = _build(tmp_path, "dense")
    toy = _build(tmp_path, "halves", "grads.row_format=halves")
    reader = IndexReader(toy)
    assert isinstance(reader.row_format, HalvesFormat) and reader.manifest["row_format"] == "halves"
    assert reader.verify() == []
    rows = torch.cat([g for _, g, _ in IndexReader(dense).shards()])  # float32, (20, 256)
    stored = [g for _, g, _ in reader.shards(formats=("halves",))]
    assert len(stored) == 3 and torch.equal(torch.cat(stored), rows.half().float())  # the float16 of each row
    # a shard's bytes: 7 rows of 256 float16 values, not float32's
    assert reader.manifest["shards"]["shard-00000.safetensors"]["bytes"] < 7 * 256 * 4
    queries = rows[[3, 11]] + 0.01 * torch.randn(2, rows.shape[1], generator=torch.Generator().manual_seed(1))
    got, want = (stream_topk(index, queries, top_k=5, score="cosine") for index in (toy, dense))
    assert got["query_rows"][:, 0].tolist() == [3, 11]  # each query's own row first
    assert torch.allclose(got["query_scores"], want["query_scores"], atol=1e-3)
    with pytest.raises(IndexMismatchError, match="--score kfac on .*grads.row_format=halves"):
        stream_topk(toy, queries, score="kfac")
    _, cfg = compose(["grads.row_format=halves", "grads.preconditioner=none", "grads.projection_dim=64",
                      "grads.storage_dtype=float32", "grads.module_filter=[mlp]"])
    _, plain = compose(["grads.preconditioner=none", "grads.projection_dim=64", "grads.storage_dtype=float32",
                        "grads.module_filter=[mlp]"])
    # the estimate counts its 2 bytes per value, not float32's 4 (+ 12 bytes of norm and row id each)
    assert (grads_estimate(cfg, n_rows=100).index_bytes - 1200) * 2 == grads_estimate(plain, n_rows=100).index_bytes - 1200
