"""Fixtures of gradian's refusal tests (tests/gradian/{rank,build,index}/test_refusals.py). A module
that builds an index of its own defines its own `built`, which takes precedence there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from circuitkit.models.config import ModelConfig
from gradian.index.reader import IndexReader
from gradian.settings.grads import GradsConfig
from tests.helpers.gradian_refusals import ROWS


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A 12-row index (3 shards of 4 rows, dim 16) of the tiny GPT-2 fixture, with its data."""
    from gradian.build.indexer import build_index

    root = tmp_path_factory.mktemp("trust")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    grads = GradsConfig(data_path=str(data), projection_dim=16, rows_per_shard=4, batch_size=8)
    build_index(ModelConfig(precision="float32"), grads, root / "index")
    assert IndexReader(root / "index").complete
    return root
