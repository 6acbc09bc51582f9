"""The index loop never waits for the device: per batch at most a small constant of blocking calls
(`circuitkit.core.syncs.BlockingCalls`), whatever the preconditioner, row format, number of modules or
rows; and the shard writer thread that takes the disk off that loop keeps every guarantee (row order,
bytes, refusals, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gradian.build.indexer as indexer
from circuitkit.core.recorded import MANIFEST
from circuitkit.core.syncs import BlockingCalls
from circuitkit_app.config import compose
from gradian.data.rows import policy_of
from gradian.index.formats.base import StorageOverflowError
from gradian.index.reader import IndexReader

# At most this many blocking calls per index batch (the design allows one: the batch's rows copy).
INDEX_BATCH_BUDGET = 3
ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows


def _cfg(root: Path, *overrides: str):
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose(["model.precision=float32", "grads.projection_dim=16", f"grads.data_path={data}",
                      "grads.batch_size=4", "grads.rows_per_shard=8", *overrides])
    return cfg


def _counts_per_batch(root: Path, name: str, *overrides: str, monkeypatch) -> list[int]:
    counts: list[int] = []
    real = indexer.index_batch

    def counted(*args, **kwargs):
        with BlockingCalls() as calls:
            out = real(*args, **kwargs)
        counts.append(calls.total)
        return out

    monkeypatch.setattr(indexer, "index_batch", counted)
    cfg = _cfg(root, *overrides)
    indexer.build_index(cfg.model, cfg.grads, root / name)
    monkeypatch.setattr(indexer, "index_batch", real)
    return counts


def test_the_counter_sees_what_would_block() -> None:
    x = torch.arange(6.0)
    with BlockingCalls() as calls:
        _ = x.sum().item()
        _ = x.nonzero()
        _ = x.tolist()
        _ = bool(x.any())
    assert calls.by_name == {"aten::_local_scalar_dense": 2, "aten::nonzero": 1, "Tensor.tolist": 1}
    with BlockingCalls() as calls:
        _ = (x * 2 + 1).cumsum(0)
    assert calls.total == 0


@pytest.mark.parametrize("overrides", [
    ("grads.preconditioner=none",),
    ("grads.preconditioner=kfac",),
    ("grads.preconditioner=module",),
    ("grads.preconditioner=module+kfac",),
    ("grads.preconditioner=kfac", "grads.fisher=sampled"),
    ("grads.row_format=signs", "grads.preconditioner=none"),
    ("grads.row_format=factored", "grads.row_rank=2"),
], ids=lambda o: "-".join(v.split("=")[1] for v in o))
def test_an_index_batch_stays_within_its_budget_of_blocking_calls(tmp_path, monkeypatch, overrides) -> None:
    """Per batch: collate on the host, capture, rows stored without a wait. The count must not grow
    with the modules (a per-module sync would) nor with the rows."""
    few = _counts_per_batch(tmp_path, "few", "grads.module_filter=[mlp.c_proj]", *overrides, monkeypatch=monkeypatch)
    every = _counts_per_batch(tmp_path, "every", *overrides, monkeypatch=monkeypatch)
    wide = _counts_per_batch(tmp_path, "wide", "grads.batch_size=8", *overrides, monkeypatch=monkeypatch)
    assert len(every) >= 5 and max(few + every + wide) <= INDEX_BATCH_BUDGET, (few, every, wide)
    assert max(every) == max(few) == max(wide)


@pytest.mark.parametrize("tiny_model_dir", ["tiny-llama"], indirect=True)
def test_a_padded_batch_of_a_gqa_model_is_as_free_of_waits(tmp_path, monkeypatch, tiny_model_dir) -> None:
    counts = _counts_per_batch(tmp_path, "llama", f"model.name={tiny_model_dir}", monkeypatch=monkeypatch)
    assert max(counts) <= INDEX_BATCH_BUDGET, counts


def _index_bytes(index_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(index_dir.glob("shard-*.safetensors"))}


def test_a_row_that_overflows_float16_stops_the_run_and_a_resume_finishes_it(tmp_path, monkeypatch) -> None:
    """The writer thread refuses a shard with a row float16 cannot hold: the run stops with the row
    named, no listed shard holds it, the index does not claim to be complete; rerun without the
    fault, it resumes and ends with the bytes of an uninterrupted build."""
    cfg = _cfg(tmp_path, "grads.preconditioner=none")
    indexer.build_index(cfg.model, cfg.grads, tmp_path / "clean")
    real = indexer.index_batch

    class BlownUp:  # the shard buffer, with row 11 scaled beyond float16 on its way in
        def __init__(self, buffer, at: int) -> None:
            self.buffer, self.at = buffer, at

        def add(self, plan, rows, fisher_rows=None) -> None:
            rows[self.at] *= 1e9
            self.buffer.add(plan, rows, fisher_rows)

    def blown_up(capture, rows, plan, first_row, factors, buffer):
        row_ids = [first_row + i for i in plan]
        return real(capture, rows, plan, first_row, factors,
                    BlownUp(buffer, row_ids.index(11)) if 11 in row_ids else buffer)

    monkeypatch.setattr(indexer, "index_batch", blown_up)
    with pytest.raises(StorageOverflowError, match=r"rows \[11\] of shard 1 exceed the float16 range"):
        indexer.build_index(cfg.model, cfg.grads, tmp_path / "faulty")
    manifest = json.loads((tmp_path / "faulty" / MANIFEST).read_text())
    assert manifest["complete"] is False and "shard-00001.safetensors" not in manifest["shards"]
    monkeypatch.setattr(indexer, "index_batch", real)
    indexer.build_index(cfg.model, cfg.grads, tmp_path / "faulty")
    assert IndexReader(tmp_path / "faulty").verify() == []
    assert _index_bytes(tmp_path / "faulty") == _index_bytes(tmp_path / "clean")


def test_a_failed_shard_write_stops_the_run_and_leaves_no_complete_looking_index(tmp_path, monkeypatch) -> None:
    from gradian.index.writer import IndexWriter

    cfg = _cfg(tmp_path, "grads.preconditioner=kfac")
    real = IndexWriter.write_stored

    def full_disk(self, k, *args, **kwargs):
        if k == 1:
            raise OSError(28, "No space left on device", str(self.index_dir / "shard-00001.safetensors"))
        return real(self, k, *args, **kwargs)

    monkeypatch.setattr(IndexWriter, "write_stored", full_disk)
    with pytest.raises(OSError, match="No space left"):
        indexer.build_index(cfg.model, cfg.grads, tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / MANIFEST).read_text())
    assert manifest["complete"] is False and "curvature" not in manifest
    assert not list((tmp_path / "idx").glob(".*.tmp"))
    monkeypatch.setattr(IndexWriter, "write_stored", real)
    indexer.build_index(cfg.model, cfg.grads, tmp_path / "idx")
    assert IndexReader(tmp_path / "idx").verify() == []


def test_shards_hold_rows_in_row_order_whatever_the_batch_order(tmp_path) -> None:
    """Batches are planned by length, so a shard's buffer fills out of order; the stored shard is in
    row order, each row the one computed alone."""
    from circuitkit.models.linear_modules import module_shapes, select_modules
    from circuitkit.models.loading import load_model
    from gradian.capture.gradients import per_example_gradients
    from gradian.data.batch import collate
    from gradian.data.rows import load_rows
    from gradian.projection.projector import Projector

    cfg = _cfg(tmp_path, "grads.preconditioner=none", "grads.storage_dtype=float32")
    indexer.build_index(cfg.model, cfg.grads, tmp_path / "idx")
    reader = IndexReader(tmp_path / "idx")
    stored = torch.cat([grads for _rows, grads, _norms in reader.shards()]).float()
    loaded = load_model(cfg.model)
    modules = select_modules(loaded.model, loaded.adapter, cfg.grads.module_filter)
    projector = Projector(module_shapes(modules), cfg.grads.projection, cfg.grads.projection_dim,
                          cfg.grads.projection_seed)
    rows, _ = load_rows(cfg.grads.data_path, loaded.tokenizer, cfg.grads.max_seq_length,
                        policy=policy_of(reader.manifest))
    for i in (0, 7, 13, 19):
        alone = per_example_gradients(loaded.model, loaded.adapter, modules, projector, collate([rows[i]], 0),
                                      loss=cfg.grads.loss).row()[0]
        torch.testing.assert_close(stored[i], alone, rtol=1e-4, atol=1e-6)
