"""grads.projection=whitened (gradian.curvature.whitening): the stored matrices and rows against a dense
computation from the exact per-example gradients; workers and resumes give the same bytes and
share one factor pass; refusals before the model loads; `inspect --verify`; rank reads the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from circuitkit.core.recorded import IndexIntegrityError
from circuitkit.models.loading import load_model
from gradian.build.indexer import build_index
from gradian.capture.gradients import token_losses
from gradian.curvature.whitening import WHITEN_DAMPING
from gradian.data.rows import load_rows, policy_of
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import WHITENING_FILE, Projector
from tests.gradian.curvature.test_kfac import DIM, ROWS, _cfg  # noqa: F401  (the same 20 rows and config as the K-FAC tests)

ARGS = ("grads.projection=whitened", "grads.rows_per_shard=7")


def _build(root: Path, name: str, *overrides: str) -> Path:
    cfg = _cfg(root, *ARGS, *overrides)
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("whitened")


@pytest.fixture(scope="module")
def index(root: Path) -> Path:
    return _build(root, "whitened")


def _exact(index_dir: Path) -> dict:
    """Per module and one example at a time, by autograd of the index's loss: each example's full
    weight gradient G = Σ_t δ_t x_tᵀ (d_out, d_in), and the full factors Σ x xᵀ, Σ δ δᵀ (float64)."""
    manifest = IndexReader(index_dir).manifest
    loaded = load_model(_cfg(index_dir.parent).model)
    model = loaded.model
    rows, _ = load_rows(manifest["data_file"], loaded.tokenizer, manifest["max_seq_length"], policy=policy_of(manifest))
    names = list(manifest["projection"]["modules"])
    out = {"names": names, "g": {n: [] for n in names}, "a": dict.fromkeys(names, 0), "s": dict.fromkeys(names, 0),
           "tokens": 0, "n": len(rows)}
    xs, ys = {}, {}
    for row in rows:
        ids = torch.tensor([row.input_ids], device=loaded.device)  # on the model's device (a GPU too)
        sup = torch.tensor([row.supervised], device=loaded.device)

        def hook(name):
            def fn(module, args, output):
                xs[name] = args[0].detach()[0].double().cpu()
                output.retain_grad()
                ys[name] = output
            return fn

        handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
        handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, o: o.requires_grad_(True)))
        try:
            with torch.enable_grad():
                logits = model(input_ids=ids).logits[0].float()
                loss = token_losses(logits[:-1][sup[0, 1:]], ids[0, 1:][sup[0, 1:]], manifest["loss"]).sum()
                loss.backward()
        finally:
            for h in handles:
                h.remove()
        out["tokens"] += ids.shape[1]
        for n in names:
            x, d = xs[n], ys[n].grad[0].double().cpu()  # (T, d_in), (T, d_out)
            out["g"][n].append(d.T @ x)
            out["a"][n] = out["a"][n] + x.T @ x
            out["s"][n] = out["s"][n] + d.T @ d
    return out


def _inv_sqrt(f: torch.Tensor) -> torch.Tensor:
    e, q = torch.linalg.eigh(f)
    e = e.clamp_min(0)
    return q @ torch.diag((e + WHITEN_DAMPING * e.mean()) ** -0.5) @ q.T


def test_rows_are_the_whitened_projection_of_the_exact_gradient(index: Path) -> None:
    from safetensors.torch import load_file

    manifest = IndexReader(index).manifest
    proj = manifest["projection"]
    assert proj["kind"] == "whitened" and proj["whitening"]["damping"] == WHITEN_DAMPING == 0.1
    ex = _exact(index)
    stored = load_file(index / WHITENING_FILE)
    rows = torch.cat([g for _, g, _ in IndexReader(index).shards()]).double()
    orth = Projector({n: tuple(e["shape"]) for n, e in proj["modules"].items()}, "kronecker_orthogonal", DIM, 0)
    start = 0
    for m, n in enumerate(ex["names"]):
        # The stored matrices: the seeded orthogonal factors after the damped full K-FAC whitening.
        p_out, p_in = (p.double() for p in orth.kronecker_matrices(n))
        want_out = p_out @ _inv_sqrt(ex["s"][n] / ex["n"])
        want_in = p_in @ _inv_sqrt(ex["a"][n] / ex["tokens"])
        for got, want in ((stored[f"p_out.{m}"].double(), want_out), (stored[f"p_in.{m}"].double(), want_in)):
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        # Each row: P_out^w G P_in^wᵀ of the example's exact gradient, formed densely.
        w_out, w_in = stored[f"p_out.{m}"].double(), stored[f"p_in.{m}"].double()
        dense = torch.stack([(w_out @ g @ w_in.T).flatten() for g in ex["g"][n]])
        block = rows[:, start:start + DIM]
        assert (block - dense).abs().max() <= 1e-4 * dense.abs().max()
        start += DIM
    assert start == rows.shape[1]
    # Whitening changes the rows: not the orthogonal projection of the same seed.
    g0 = ex["g"][ex["names"][0]][0]
    p_out, p_in = (p.double() for p in orth.kronecker_matrices(ex["names"][0]))
    assert not torch.allclose(rows[0, :DIM], (p_out @ g0 @ p_in.T).flatten(), rtol=0.1)


def test_workers_and_resume_give_the_same_bytes_and_share_one_factor_pass(root: Path, index: Path,
                                                                          monkeypatch) -> None:
    import gradian.build.indexer as indexer

    workers = root / "workers"
    cfg = _cfg(root, *ARGS, "grads.num_shards=2", "grads.shard_index=0")
    build_index(cfg.model, cfg.grads, workers)
    computed = (workers / WHITENING_FILE).read_bytes()
    # The second worker finds the projection written and reuses it: no factor pass.
    monkeypatch.setattr(indexer, "factor_pass", lambda *a, **k: pytest.fail("the factor pass ran again"))
    cfg = _cfg(root, *ARGS, "grads.num_shards=2", "grads.shard_index=1")
    build_index(cfg.model, cfg.grads, workers)
    assert (workers / WHITENING_FILE).read_bytes() == computed
    monkeypatch.undo()
    # A killed run: the last shard and the curvature file are gone; the same command resumes.
    resumed = root / "resumed"
    shutil.copytree(index, resumed)
    manifest = json.loads((resumed / "manifest.json").read_text())
    del manifest["shards"]["shard-00002.safetensors"], manifest["curvature"]
    manifest["complete"] = False
    (resumed / "manifest.json").write_text(json.dumps(manifest))
    (resumed / "shard-00002.safetensors").unlink()
    (resumed / "curvature.safetensors").unlink()
    _build(root, "resumed")
    # A run killed before any shard: only the projection file is there; it is reused as it is.
    early = root / "early"
    early.mkdir()
    shutil.copy(index / WHITENING_FILE, early / WHITENING_FILE)
    monkeypatch.setattr(indexer, "factor_pass", lambda *a, **k: pytest.fail("the factor pass ran again"))
    _build(root, "early")
    monkeypatch.undo()
    for other in (workers, resumed, early):
        assert IndexReader(other).verify() == []
        assert json.loads((other / "manifest.json").read_text()) == json.loads((index / "manifest.json").read_text())
        for name in [*IndexReader(index).manifest["shards"], WHITENING_FILE, "curvature.safetensors"]:
            assert (other / name).read_bytes() == (index / name).read_bytes(), name


def test_a_projection_file_of_other_settings_is_recomputed(root: Path, index: Path) -> None:
    stale = root / "stale"
    _build(root, "stale", "grads.projection_seed=3")
    for p in stale.iterdir():  # a run killed after the factor pass: the file alone, no manifest
        if p.name != WHITENING_FILE:
            p.unlink()
    _build(root, "stale")  # seed 0 now: the seed-3 file no manifest records is replaced
    assert (stale / WHITENING_FILE).read_bytes() == (index / WHITENING_FILE).read_bytes()


def test_resume_with_another_projection_or_a_changed_file_is_refused_before_the_model_loads(
        index: Path, tmp_path: Path, monkeypatch) -> None:
    import gradian.build.indexer as indexer

    monkeypatch.setattr(indexer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = _cfg(index.parent, "grads.rows_per_shard=7", "grads.projection=kronecker_orthogonal")
    with pytest.raises(IndexMismatchError, match="projection: index has 'whitened', asked 'kronecker_orthogonal'"):
        build_index(cfg.model, cfg.grads, index)
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    data = bytearray((copy / WHITENING_FILE).read_bytes())
    data[-1] ^= 1
    (copy / WHITENING_FILE).write_bytes(bytes(data))
    cfg = _cfg(index.parent, *ARGS)
    with pytest.raises(IndexIntegrityError, match=r"projection.safetensors \(the whitened projection\) has sha256"):
        build_index(cfg.model, cfg.grads, copy)


def test_inspect_verify_catches_a_tampered_projection_file(index: Path, tmp_path: Path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    assert IndexReader(index).verify() == []
    assert main(["inspect", str(index), "--verify"]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    data = bytearray((copy / WHITENING_FILE).read_bytes())
    data[-1] ^= 1
    (copy / WHITENING_FILE).write_bytes(bytes(data))
    problems = IndexReader(copy).verify()
    assert len(problems) == 1 and "changed after it was written" in problems[0], problems
    assert main(["inspect", str(copy), "--verify"]) == 1
    (copy / WHITENING_FILE).unlink()
    assert "projection.safetensors (the whitened projection's matrices) is missing" in IndexReader(copy).verify()[0]


def test_rank_uses_the_stored_projection(index: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from gradian.rank.checks import check_compatible
    from gradian.rank.ranking import rank

    manifest = IndexReader(index).manifest
    loaded = load_model(_cfg(index.parent).model)
    projector = check_compatible(manifest, loaded, index)
    stored = load_file(index / WHITENING_FILE)
    name = next(iter(manifest["projection"]["modules"]))
    assert torch.equal(projector.kronecker_matrices(name)[0], stored["p_out.0"])
    with pytest.raises(IndexMismatchError, match="stored in its index directory"):
        check_compatible(manifest, loaded)
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    for score in ("ekfac", "cosine"):
        results = rank(index, queries, top_k=3, score=score, loaded=loaded)
        assert [r["row_id"] for r in results if r["rank"] == 1][:4] == [0, 1, 2, 3]  # each row finds itself
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    (copy / WHITENING_FILE).unlink()
    with pytest.raises(IndexIntegrityError, match="is missing"):
        rank(copy, queries, loaded=loaded)


def test_memory_estimate_counts_the_factor_pass_and_the_file(index: Path) -> None:
    from gradian.build.memory import estimate_grads, whitening_pass_bytes

    loaded = load_model(_cfg(index.parent).model)
    manifest = IndexReader(index).manifest
    shapes = {n: tuple(e["shape"]) for n, e in manifest["projection"]["modules"].items()}
    whitened = Projector(shapes, "whitened", DIM, 0)
    plain = Projector(shapes, "kronecker_orthogonal", DIM, 0)
    args = (loaded.adapter.shape(), 4, 4, 32, 8)
    est, ref = estimate_grads(*args, whitened, 4, 20), estimate_grads(*args, plain, 4, 20)
    # raw inputs instead of projected ones (4 rows x 32 positions) and one module's float64 scratch
    n_tok = 4 * 32
    want = sum(n_tok * (d_in - 4) * 4 for _, d_in in shapes.values()) + max(
        n_tok * (o + i) * 8 + (o * o + i * i) * 8 for o, i in shapes.values())
    assert est.terms["whitening factor pass"] == whitening_pass_bytes(whitened, n_tok) == want
    assert est.total_bytes - ref.total_bytes == want
    file_bytes = (index / WHITENING_FILE).stat().st_size
    # the matrices, Σ (k_o·d_out + k_i·d_in)·4, and the safetensors header (its settings metadata) on top
    assert est.index_bytes - ref.index_bytes == sum((4 * o + 4 * i) * 4 for o, i in shapes.values())
    assert 0 < file_bytes - (est.index_bytes - ref.index_bytes) < 8192
