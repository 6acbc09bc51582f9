"""The on-disk gradient index: atomic shards, resume, workers, mismatch and overflow errors."""

from __future__ import annotations

import filecmp

import pytest
import torch

from circuitkit.core.io import file_lock
from gradian.index.formats.base import StorageOverflowError
from gradian.index.manifest import IndexMismatchError, shard_name
from gradian.index.reader import IndexReader
from gradian.index.writer import IndexWriter

HEADER = {"model": "tiny", "weights_sha256": "ab" * 32, "modules": ["mlp.c_proj"], "projection": "kronecker",
          "projection_dim": 16, "projection_seed": 0, "storage_dtype": "float16", "loss_reduction": "sum"}
N, WIDTH, PER_SHARD = 10, 16, 4


def _grads() -> torch.Tensor:
    return torch.randn(N, WIDTH, generator=torch.Generator().manual_seed(0))


def _build(index_dir, shards_to_write=None, num_shards=1, shard_index=0, header=HEADER):
    writer = IndexWriter(index_dir, header, N, PER_SHARD, num_shards, shard_index)
    grads = _grads()
    for k in writer.pending() if shards_to_write is None else shards_to_write:
        start, end = writer.row_range(k)
        writer.write_shard(k, grads[start:end], torch.arange(start, end))
    return writer


def _same_tree(a, b) -> None:
    names_a = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    names_b = sorted(p.name for p in b.iterdir() if not p.name.startswith("."))
    assert names_a == names_b
    for name in names_a:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_index_layout_and_reader(tmp_path):
    _build(tmp_path)
    reader = IndexReader(tmp_path)
    assert reader.complete and sorted(reader.manifest["shards"]) == [shard_name(k) for k in range(3)]
    rows, grads = [], []
    for r, g, n in reader.shards():
        rows.append(r)
        grads.append(g)
        torch.testing.assert_close(n, g.norm(dim=1))
    assert torch.cat(rows).tolist() == list(range(N))
    torch.testing.assert_close(torch.cat(grads), _grads().half().float())
    summary = reader.summary()
    assert summary["rows_stored"] == N and summary["n_shard_files"] == 3
    payload = N * WIDTH * 2 + N * 4 + N * 8  # float16 grads + float32 norms + int64 rows
    assert payload <= summary["bytes"] <= payload + 3 * 400 + 2000  # + safetensors headers + manifest


def test_interrupted_run_resumes_to_identical_bytes(tmp_path):
    _build(tmp_path / "straight")
    _build(tmp_path / "resumed", shards_to_write=[0])  # "killed" after one shard
    (tmp_path / "resumed" / f".{shard_name(1)}.123.tmp").write_bytes(b"half a shard")  # killed mid-write
    (tmp_path / "resumed" / ".manifest.json.456.tmp").write_bytes(b"{")  # killed while writing the manifest
    writer = IndexWriter(tmp_path / "resumed", HEADER, N, PER_SHARD)
    assert writer.pending() == [1, 2]
    assert not list((tmp_path / "resumed").glob("*.tmp"))
    _build(tmp_path / "resumed")
    _same_tree(tmp_path / "straight", tmp_path / "resumed")


def test_workers_write_the_same_index_as_one(tmp_path):
    _build(tmp_path / "one")
    for w in (1, 0):  # any order
        _build(tmp_path / "many", num_shards=2, shard_index=w)
    _same_tree(tmp_path / "one", tmp_path / "many")


def test_a_different_config_is_refused_naming_the_keys(tmp_path):
    _build(tmp_path)
    with pytest.raises(IndexMismatchError, match="projection_dim: index has 16, asked 32"):
        IndexWriter(tmp_path, {**HEADER, "projection_dim": 32}, N, PER_SHARD)


def test_float16_overflow_is_reported_not_stored(tmp_path):
    writer = IndexWriter(tmp_path, HEADER, N, PER_SHARD)
    grads = _grads()[:4].clone()
    grads[2, 0] = 1e6
    with pytest.raises(StorageOverflowError, match=r"rows \[2\].*bfloat16"):
        writer.write_shard(0, grads, torch.arange(4))
    assert not (tmp_path / shard_name(0)).exists() and writer.pending() == [0, 1, 2]


def test_two_writers_on_one_shard_are_refused(tmp_path):
    writer = IndexWriter(tmp_path, HEADER, N, PER_SHARD)
    with file_lock(tmp_path / f".{shard_name(0)}.lock"):
        with pytest.raises(RuntimeError, match="another process is writing"):
            writer.write_shard(0, _grads()[:4], torch.arange(4))


def test_gradian_inspect_prints_the_summary(tmp_path, capsys):
    from circuitkit_app.gradian_cli import main

    _build(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "10 of 10 rows in 3 shards (complete)" in out and "MiB" in out and "kronecker" in out
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["nope"])  # an unknown command: usage and status 2
    assert exit_info.value.code == 2
