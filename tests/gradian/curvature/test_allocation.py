"""grads.width_allocation=spectrum (gradian.curvature.allocation): the split itself, an oracle (every module
at its full size reproduces the unprojected scores), workers and resumes share one allocation,
refusals, `inspect --verify`, old (uniform) indexes unchanged, rank reads the widths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from circuitkit.core.errors import UserError
from circuitkit.core.recorded import IndexIntegrityError
from gradian.build.indexer import build_index
from gradian.curvature.allocation import (
    ALLOCATION_FILE,
    FLOOR_SHARE,
    allocate_widths,
    effective_dimension,
    width_ladder,
)
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector, balanced_width
from tests.gradian.curvature.test_kfac import DIM, ROWS, _cfg  # noqa: F401  (the same 20 rows and config as the K-FAC tests)

ARGS = ("grads.width_allocation=spectrum", "grads.rows_per_shard=7")


def _build(root: Path, name: str, *overrides: str) -> Path:
    cfg = _cfg(root, *ARGS, *overrides)
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("allocation")


@pytest.fixture(scope="module")
def index(root: Path) -> Path:
    return _build(root, "spectrum")


def test_the_split_follows_the_effective_dimension_within_the_budget() -> None:
    # Effective dimension: an isotropic spectrum counts every direction, a rank-one one about one.
    flat, spike = torch.ones(8, dtype=torch.float64), torch.tensor([1.0] + [0.0] * 7, dtype=torch.float64)
    assert effective_dimension(flat, flat, 0.01) == pytest.approx(64 / 1.01)
    assert effective_dimension(spike, spike, 0.01) == pytest.approx(1 / (1 + 0.01 / 64))
    assert effective_dimension(torch.zeros(4, dtype=torch.float64), flat) == 0.0
    shapes = {"a": (64, 256), "b": (64, 256), "c": (256, 64), "d": (64, 64)}
    # Equal dimensions: projection_dim each (the uniform index's widths).
    assert allocate_widths(shapes, dict.fromkeys(shapes, 5.0), 256) == dict.fromkeys(shapes, 256)
    widths = allocate_widths(shapes, {"a": 1000.0, "b": 100.0, "c": 10.0, "d": 3000.0}, 256)
    assert sum(widths.values()) <= 4 * 256 and sum(widths.values()) >= 0.9 * 4 * 256
    assert all(w >= FLOOR_SHARE * 256 for w in widths.values())
    assert widths["a"] > widths["b"] >= widths["c"]
    assert widths["d"] <= 64 * 64 and widths["d"] >= widths["a"]
    for n, w in widths.items():
        assert balanced_width(w, *shapes[n]) or w == shapes[n][0] * shapes[n][1]
        assert w in width_ladder(*shapes[n], 256)
    # A module whose share passes its size is capped there and the rest goes to the others.
    capped = allocate_widths({"big": (64, 256), "small": (8, 8)}, {"big": 1.0, "small": 1000.0}, 64)
    assert capped == {"big": 64, "small": 64} or capped["small"] == 64


def test_the_split_of_a_large_model_is_quick() -> None:
    """A 4B-sized model: 200 modules of 2560 x 10240 (both orientations), budgets of 1024 and 65536 each."""
    import random
    import time

    shapes = {f"m{i}": (2560, 10240) if i % 2 else (10240, 2560) for i in range(200)}
    rng = random.Random(0)
    dims = {n: rng.random() * 1e6 for n in shapes}
    start = time.perf_counter()
    for dim in (1024, 65536):
        widths = allocate_widths(shapes, dims, dim)
        assert 0.99 * 200 * dim <= sum(widths.values()) <= 200 * dim
    assert time.perf_counter() - start < 10


def test_the_index_records_the_widths_and_verifies(index: Path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    manifest = IndexReader(index).manifest
    proj = manifest["projection"]
    widths = {n: e["width"] for n, e in proj["modules"].items()}
    record = proj["allocation"]
    assert record["kind"] == "spectrum" and record["budget"] == DIM * len(widths)
    assert record["total"] == sum(widths.values()) == manifest["row_width"] <= record["budget"]
    assert len(set(widths.values())) > 1, widths  # the tiny GPT-2's modules differ (shapes and spectra)
    stored = json.loads((index / ALLOCATION_FILE).read_text())
    assert stored["widths"] == widths and set(stored["effective_dimension"]) == set(widths)
    for e in proj["modules"].values():
        assert e["factors"][0] * e["factors"][1] == e["width"]
    assert IndexReader(index).verify() == []
    assert main(["inspect", str(index), "--verify"]) == 0
    assert "spectrum allocation, total" in capsys.readouterr().out


def test_full_widths_reproduce_the_unprojected_scores(root: Path) -> None:
    """Oracle: a budget above every module's size caps each at its whole (d_out, d_in): the orthogonal
    factors are then square rotations, so rows keep every inner product of the raw gradients."""
    full = _build(root, "full", "grads.projection_dim=16384", "grads.module_filter=[mlp]",
                  "grads.preconditioner=none")
    raw = _build(root, "raw", "grads.projection_dim=null", "grads.module_filter=[mlp]", "grads.preconditioner=none",
                 "grads.width_allocation=uniform")
    manifest = IndexReader(full).manifest
    assert all(e["width"] == e["shape"][0] * e["shape"][1] for e in manifest["projection"]["modules"].values())
    rows_full = torch.cat([g for _, g, _ in IndexReader(full).shards()]).double()
    rows_raw = torch.cat([g for _, g, _ in IndexReader(raw).shards()]).double()
    assert not torch.allclose(rows_full, rows_raw)  # rotated, not copied
    gram_full, gram_raw = rows_full @ rows_full.T, rows_raw @ rows_raw.T
    torch.testing.assert_close(gram_full, gram_raw, rtol=1e-4, atol=1e-4 * gram_raw.abs().max().item())


def test_workers_and_resume_share_one_allocation(root: Path, index: Path, monkeypatch) -> None:
    import gradian.build.indexer as indexer

    workers = root / "workers"
    cfg = _cfg(root, *ARGS, "grads.num_shards=2", "grads.shard_index=0")
    build_index(cfg.model, cfg.grads, workers)
    # The second worker reads the allocation the first wrote: no factor pass.
    monkeypatch.setattr(indexer, "factor_pass", lambda *a, **k: pytest.fail("the factor pass ran again"))
    cfg = _cfg(root, *ARGS, "grads.num_shards=2", "grads.shard_index=1")
    build_index(cfg.model, cfg.grads, workers)
    monkeypatch.undo()
    # A killed run: the last shard is gone; the same command resumes.
    resumed = root / "resumed"
    shutil.copytree(index, resumed)
    manifest = json.loads((resumed / "manifest.json").read_text())
    del manifest["shards"]["shard-00002.safetensors"], manifest["curvature"]
    manifest["complete"] = False
    (resumed / "manifest.json").write_text(json.dumps(manifest))
    (resumed / "shard-00002.safetensors").unlink()
    (resumed / "curvature.safetensors").unlink()
    _build(root, "resumed")
    for other in (workers, resumed):
        assert IndexReader(other).verify() == []
        assert json.loads((other / "manifest.json").read_text()) == json.loads((index / "manifest.json").read_text())
        for name in [*IndexReader(index).manifest["shards"], ALLOCATION_FILE, "curvature.safetensors"]:
            assert (other / name).read_bytes() == (index / name).read_bytes(), name


def test_resume_with_another_allocation_or_a_changed_file_is_refused(index: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    import gradian.build.indexer as indexer

    monkeypatch.setattr(indexer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = _cfg(index.parent, "grads.rows_per_shard=7")
    with pytest.raises(IndexMismatchError, match="width_allocation: index has 'spectrum', asked 'uniform'"):
        build_index(cfg.model, cfg.grads, index)
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    text = (copy / ALLOCATION_FILE).read_text()
    (copy / ALLOCATION_FILE).write_text(text.replace('"floor_share"', '"floor_share" ', 1))
    with pytest.raises(IndexIntegrityError, match=r"allocation.json \(the width allocation\) .* changed after it was written"):
        build_index(cfg.model, _cfg(index.parent, *ARGS).grads, copy)
    assert any("changed after it was written" in p for p in IndexReader(copy).verify())
    # An uniform index asked to resume with spectrum is refused too.
    uniform = tmp_path / "uniform"
    shutil.copytree(index, uniform)
    manifest = json.loads((uniform / "manifest.json").read_text())
    del manifest["projection"]["allocation"]
    (uniform / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexMismatchError, match="width_allocation: index has 'uniform', asked 'spectrum'"):
        build_index(cfg.model, _cfg(index.parent, *ARGS).grads, uniform)


def test_edited_widths_are_refused_by_verify_and_rank(index: Path, tmp_path: Path) -> None:
    from circuitkit.models.loading import load_model
    from gradian.rank.checks import check_compatible

    copy = tmp_path / "edited"
    shutil.copytree(index, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    entries = list(manifest["projection"]["modules"].values())
    entries[0]["width"], entries[1]["width"] = entries[1]["width"], entries[0]["width"]
    entries[0]["factors"], entries[1]["factors"] = entries[1]["factors"], entries[0]["factors"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert any("projection" in p for p in IndexReader(copy).verify())
    loaded = load_model(_cfg(index.parent).model)
    with pytest.raises(IndexMismatchError, match="projection"):
        check_compatible(IndexReader(copy).manifest, loaded, copy)
    projector = check_compatible(IndexReader(index).manifest, loaded, index)
    assert projector.widths == {n: e["width"] for n, e in IndexReader(index).manifest["projection"]["modules"].items()}


def test_rank_with_the_allocated_widths(index: Path, tmp_path: Path) -> None:
    from circuitkit.models.loading import load_model
    from gradian.rank.ranking import rank

    loaded = load_model(_cfg(index.parent).model)
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    for score in ("ekfac", "cosine"):
        results = rank(index, queries, top_k=3, score=score, loaded=loaded)
        assert [r["row_id"] for r in results if r["rank"] == 1][:4] == [0, 1, 2, 3]  # each row finds itself


def test_uniform_indexes_are_unchanged_and_refusals_come_first(root: Path, tmp_path: Path) -> None:
    shapes = {"m": (64, 256)}
    uniform = Projector(shapes, "kronecker_orthogonal", 256, 0)
    same = Projector(shapes, "kronecker_orthogonal", 256, 0, widths={"m": 256})
    assert "allocation" not in uniform.describe()
    assert torch.equal(uniform.kronecker_matrices("m")[0], same.kronecker_matrices("m")[0])
    # An old manifest (no allocation record) reads back as uniform.
    back = Projector.from_description(shapes, uniform.describe())
    assert back.widths is None and back.width("m") == 256
    for bad, match in ((("grads.projection=dense",), "grads.projection=dense has none"),
                       (("grads.projection_dim=null",), "raw rows"),
                       (("grads.preconditioner=module",), "one second moment per module")):
        cfg = _cfg(root, "grads.width_allocation=spectrum", *bad)
        with pytest.raises(UserError, match=match):
            build_index(cfg.model, cfg.grads, tmp_path / "refused")


def test_memory_estimate_counts_the_factor_pass(root: Path) -> None:
    from gradian.build.memory import grads_estimate

    spectrum, uniform = _cfg(root, *ARGS), _cfg(root)
    est, ref = grads_estimate(spectrum), grads_estimate(uniform)
    assert est.terms["factor pass (width allocation)"] > 0
    assert "factor pass (width allocation)" not in ref.terms


def test_the_preflight_prints_each_widths_disk_and_measured_figures(root: Path) -> None:
    from gradian.build.memory import GRADS_MEMORY
    from gradian.build.width_table import MEASURED, MEASURED_SIGNS

    width_note = GRADS_MEMORY.note
    cfg = _cfg(root, "grads.projection_dim=1024", "grads.storage_dtype=float16")
    line = width_note(cfg)
    # 20 rows x 8 modules x 1024 x 2 bytes = 320 KiB; the tiny GPT-2's smallest module holds 4096 weights
    assert "rows on disk for 20 rows of 8 modules in float16" in line
    assert "1024 (this run): 320.0 KiB" in line and f"S {MEASURED[1024][0]:.3f}, LDS {MEASURED[1024][1]:.3f}" in line
    assert "; 4096:" not in line  # not below the smallest module's size: no projection to speak of
    # sign rows: 4096 coordinates (the smallest module's size) = 20 x 8 x 512 bytes, with their figure
    assert f"signs 4096: 80.0 KiB (LDS {MEASURED_SIGNS[4096][1]:.3f})" in line and "signs 16384" not in line
    signs = width_note(_cfg(root, "grads.projection_dim=4096", "grads.row_format=signs",
                            "grads.preconditioner=none"))
    assert "signs 4096 (this run): 80.0 KiB" in signs and "1024:" in signs
    assert width_note(_cfg(root, "grads.projection_dim=null")) is None
