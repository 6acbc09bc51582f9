"""The grads stage / `gradian index` end to end on a tiny model."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch

from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline
from gradian.index.reader import IndexReader

BASE = ["model.precision=float32", "grads.projection_dim=64", "grads.rows_per_shard=10", "grads.batch_size=4"]


def test_grads_stage_indexes_the_sample_and_records_it(tmp_path):
    _, cfg = compose(["stages=[grads]", *BASE])
    manifest = run_pipeline(cfg, tmp_path)
    entry = manifest["stages"]["grads"]
    assert entry["status"] == "ok" and entry["summary"]["rows_stored"] == 24
    reader = IndexReader(tmp_path / "index")
    assert reader.complete and reader.manifest["row_width"] == 8 * 64  # 8 linear modules of tiny-gpt2
    assert "index/manifest.json" in entry["artifacts"] and "index/shard-00002.safetensors" in entry["artifacts"]
    rows = torch.cat([r for r, _, _ in reader.shards()])
    assert rows.tolist() == list(range(24))
    # size on disk: rows x width x 2 bytes (float16) + norms + row ids, and (grads.preconditioner=kfac,
    # the default) per shard 8 modules' 8 x 8 factor pair + a position count, and curvature.safetensors
    # (8 x (two 8 x 8 bases, two 8-vectors of eigenvalues, 8 x 8 EK-FAC eigenvalues) + two counts),
    # + headers and manifest
    assert reader.manifest["preconditioner"] == "kfac"
    payload = 24 * 8 * 64 * 2 + 24 * 12 + 3 * (8 * 2 * 64 * 4 + 8) + 8 * (3 * 64 + 2 * 8) * 4 + 16
    assert payload <= reader.summary()["bytes"] <= payload + 20_000


def test_module_filter_and_storage_dtype_shrink_the_index(tmp_path):
    sizes = {}
    for name, extra in (("all_fp32", ["grads.storage_dtype=float32"]), ("all_fp16", []),
                        ("cproj_fp16", ["grads.module_filter=[mlp.c_proj]"])):
        # the rows alone (no K-FAC factors, which are float32 whatever storage_dtype is)
        _, cfg = compose(["stages=[grads]", *BASE, "grads.preconditioner=none", *extra])
        run_pipeline(cfg, tmp_path / name)
        sizes[name] = sum(p.stat().st_size for p in (tmp_path / name / "index").glob("shard-*"))
    assert sizes["all_fp16"] < 0.6 * sizes["all_fp32"]
    assert IndexReader(tmp_path / "cproj_fp16" / "index").manifest["row_width"] == 2 * 64  # 2 of 8 modules
    assert sizes["cproj_fp16"] < 0.3 * sizes["all_fp16"]  # a quarter of the values + fixed norms/row ids


def test_grads_off_is_skipped(tmp_path):
    _, cfg = compose(["stages=[grads]", "grads=off"])
    manifest = run_pipeline(cfg, tmp_path)
    assert manifest["stages"]["grads"]["status"] == "skipped" and not (tmp_path / "index").exists()


def test_a_second_worker_fills_the_same_index(tmp_path):
    one = tmp_path / "one"
    _, cfg = compose(["stages=[grads]", *BASE, f"grads.index_dir={one}"])
    run_pipeline(cfg, tmp_path / "run1")
    many = tmp_path / "many"
    for w in (0, 1):
        _, cfg = compose(["stages=[grads]", *BASE, f"grads.index_dir={many}", "grads.num_shards=2",
                          f"grads.shard_index={w}"])
        run_pipeline(cfg, tmp_path / f"worker{w}")
    for name in ["manifest.json", *json.loads((one / "manifest.json").read_text())["shards"]]:
        assert filecmp.cmp(one / name, many / name, shallow=False), name


def test_index_of_another_config_is_refused(tmp_path):
    _, cfg = compose(["stages=[grads]", *BASE, f"grads.index_dir={tmp_path / 'idx'}"])
    run_pipeline(cfg, tmp_path / "a")
    _, other = compose(["stages=[grads]", *BASE, "grads.projection_seed=1", f"grads.index_dir={tmp_path / 'idx'}"])
    from circuitkit.core.pipeline import PipelineError

    with pytest.raises(PipelineError, match="made differently.*seed"):
        run_pipeline(other, tmp_path / "b")


def test_a_shard_that_cannot_fit_in_host_memory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import gradian.build.checks as checks
    import gradian.build.indexer as indexer
    from circuitkit.core.errors import UserError
    from circuitkit.models.config import ModelConfig
    from gradian.settings.grads import GradsConfig

    # Raw gradients of the tiny GPT-2's two mlp.c_proj: 2 x 64 x 256 float32 values per row.
    grads = GradsConfig(projection_dim=None, module_filter=["mlp.c_proj"], rows_per_shard=4096)
    width = 2 * 64 * 256
    # + the default kfac's float64 factor sums: (64 x 64 and 256 x 256) per module
    monkeypatch.setattr(checks, "free_memory_bytes", lambda device=None: 20 * width * 4)
    sides = [(64, 256), (64, 256)]
    assert checks.check_shard_buffer(grads, 5, width, 2, sides) == 5 * width * 4 + 2 * (64**2 + 256**2) * 8
    monkeypatch.setattr(checks, "free_memory_bytes", lambda device=None: 10 * width * 4)
    plain = GradsConfig(projection_dim=None, module_filter=["mlp.c_proj"], rows_per_shard=4096, preconditioner="none")
    assert checks.check_shard_buffer(plain, n_rows=5, row_width=width) == 5 * width * 4  # 5 rows fit
    with pytest.raises(UserError, match=r"grads.rows_per_shard=4096: a shard holds 24 rows .* Lower"
                                        r" grads.rows_per_shard \(e.g. 5\)"):
        indexer.build_index(ModelConfig(name="builtin:tiny-gpt2", precision="float32"), grads, tmp_path / "idx")
    assert not (tmp_path / "idx").exists() or not any((tmp_path / "idx").glob("*.safetensors"))
