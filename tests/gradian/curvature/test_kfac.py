"""K-FAC and EK-FAC in the projected space (gradian.curvature.factors): the factors, the EK-FAC eigenvalues
and the kfac / ekfac scores against a brute-force dense computation; sums across shards, workers
and resumes; `inspect --verify`; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from circuitkit.models.loading import load_model
from circuitkit_app.config import compose
from gradian.build.indexer import build_index
from gradian.capture.gradients import token_losses
from gradian.curvature.factors import CURVATURE_FILE, factor_names
from gradian.data.rows import load_rows, policy_of
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector
from gradian.rank.scores import stream_topk

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows
DIM = 16  # 4 x 4 factors per module: ~290 positions make both factors full rank


def _cfg(root: Path, *overrides: str):
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose(["model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
                      f"grads.data_path={data}", *overrides])
    return cfg


def _build(root: Path, name: str, *overrides: str) -> Path:
    cfg = _cfg(root, *overrides)
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("curvature")


@pytest.fixture(scope="module")
def index(root: Path) -> Path:
    return _build(root, "kfac", "grads.preconditioner=module+kfac", "grads.rows_per_shard=7")


def _brute_force(index_dir: Path) -> dict[str, list[torch.Tensor]]:
    """Per module, by the definitions and one example at a time: the projected inputs a_t and
    output gradients s_t of every position (autograd of the summed loss of the supervised
    tokens, the index's `loss`), their factor sums, and each example's projected gradient Σ_t s_t a_tᵀ."""
    manifest = IndexReader(index_dir).manifest
    cfg = _cfg(index_dir.parent)
    loaded = load_model(cfg.model)
    model = loaded.model
    rows, _ = load_rows(manifest["data_file"], loaded.tokenizer, manifest["max_seq_length"], policy=policy_of(manifest))
    proj = manifest["projection"]
    names = list(proj["modules"])
    projector = Projector.from_description({n: tuple(e["shape"]) for n, e in proj["modules"].items()}, proj)
    modules = {n: model.get_submodule(n) for n in names}
    a_sum = {n: 0 for n in names}
    s_sum = {n: 0 for n in names}
    grads = {n: [] for n in names}
    tokens = 0
    xs: dict[str, torch.Tensor] = {}
    ys: dict[str, torch.Tensor] = {}
    for row in rows:
        ids = torch.tensor([row.input_ids])
        sup = torch.tensor([row.supervised])
        xs.clear()
        ys.clear()

        def hook(name):
            def fn(module, args, out):
                xs[name] = args[0].detach()[0].double()
                out.retain_grad()
                ys[name] = out
            return fn

        handles = [modules[n].register_forward_hook(hook(n)) for n in names]
        emb = model.get_input_embeddings()
        h = emb.register_forward_hook(lambda m, a, o: o.requires_grad_(True))
        try:
            with torch.enable_grad():
                logits = model(input_ids=ids).logits[0].float()
                targets = ids[0, 1:][sup[0, 1:]]
                loss = token_losses(logits[:-1][sup[0, 1:]], targets, manifest["loss"]).sum()
                loss.backward()
        finally:
            for handle in [*handles, h]:
                handle.remove()
        tokens += ids.shape[1]
        for n in names:
            p_out, p_in = (p.double() for p in projector.kronecker_matrices(n))
            a = xs[n] @ p_in.T  # (T, k_i)
            s = ys[n].grad[0].double() @ p_out.T  # (T, k_o)
            a_sum[n] = a_sum[n] + a.T @ a
            s_sum[n] = s_sum[n] + s.T @ s
            grads[n].append((s.T @ a).flatten())
    return {"names": names, "a": [a_sum[n] for n in names], "s": [s_sum[n] for n in names],
            "g": [torch.stack(grads[n]) for n in names], "tokens": tokens}


def _dense_kfac_scores(bf: dict, q: torch.Tensor, kind: str, damping: float = 0.1) -> torch.Tensor:
    """qᵀ (F + λI)⁻¹ g summed over modules, with F formed as a dense (k, k) matrix per module."""
    n = bf["g"][0].shape[0]
    out = torch.zeros(q.shape[0], n, dtype=torch.float64)
    for m in range(len(bf["names"])):
        s, a = bf["s"][m] / n, bf["a"][m] / bf["tokens"]
        g = bf["g"][m]
        k = g.shape[1]
        if kind == "kfac":
            fisher = torch.kron(s, a)
            lam = damping * torch.trace(fisher) / k
        else:
            basis = torch.kron(torch.linalg.eigh(s).eigenvectors, torch.linalg.eigh(a).eigenvectors)
            corrected = torch.diagonal(basis.T @ (g.T @ g / n) @ basis)
            fisher = basis @ torch.diag(corrected) @ basis.T
            lam = damping * corrected.mean()
        qm = q[:, m * k:(m + 1) * k]
        out += torch.linalg.solve(fisher + lam * torch.eye(k, dtype=torch.float64), qm.T).T @ g.T
    return out


@pytest.fixture(scope="module")
def brute(index: Path) -> dict:
    return _brute_force(index)


def test_factors_and_rows_equal_a_brute_force_computation(index: Path, brute: dict) -> None:
    reader = IndexReader(index)
    stored = torch.cat([g for _, g, _ in reader.shards()]).double()
    k = DIM
    for m in range(len(brute["names"])):
        torch.testing.assert_close(stored[:, m * k:(m + 1) * k], brute["g"][m], rtol=1e-4, atol=1e-5)
    from safetensors.torch import load_file

    shards = [load_file(str(index / name)) for name in sorted(reader.manifest["shards"])]
    assert sum(int(t["kfac_tokens"][0]) for t in shards) == brute["tokens"]
    for m in range(len(brute["names"])):
        key_in, key_out = factor_names(m)
        a = sum(t[key_in].double() for t in shards)
        s = sum(t[key_out].double() for t in shards)
        torch.testing.assert_close(a, brute["a"][m], rtol=1e-4, atol=1e-4 * brute["a"][m].abs().max().item())
        torch.testing.assert_close(s, brute["s"][m], rtol=1e-4, atol=1e-4 * brute["s"][m].abs().max().item())


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("damping", [None, 0.1])
def test_kfac_scores_equal_a_dense_computation(index: Path, brute: dict, kind: str, damping: float | None) -> None:
    stored = torch.cat([g for _, g, _ in IndexReader(index).shards()]).double()
    gen = torch.Generator().manual_seed(0)
    q = torch.cat([stored[:3], torch.randn(2, stored.shape[1], generator=gen, dtype=torch.float64) * stored.std()])
    want = _dense_kfac_scores(brute, q, kind, 0.01 if damping is None else damping)  # None: the default 0.01
    top = stream_topk(index, q.float(), top_k=len(ROWS), score=kind, damping=damping)
    got = torch.zeros_like(want).scatter_(1, top["query_rows"], top["query_scores"].double())
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4 * want.abs().max().item())


def test_ekfac_differs_from_kfac_and_influence(index: Path) -> None:
    q = torch.cat([g for _, g, _ in IndexReader(index).shards()])[:6]
    scores = {s: stream_topk(index, q, top_k=len(ROWS), score=s)["query_rows"] for s in ("influence", "kfac", "ekfac")}
    assert not torch.equal(scores["kfac"], scores["ekfac"])
    assert not torch.equal(scores["ekfac"], scores["influence"])


def test_factors_do_not_depend_on_workers_and_resume(root: Path, index: Path) -> None:
    workers = root / "workers"
    for w in (0, 1):
        cfg = _cfg(root, "grads.preconditioner=module+kfac", "grads.rows_per_shard=7", "grads.num_shards=2",
                   f"grads.shard_index={w}")
        build_index(cfg.model, cfg.grads, workers)
    # A killed run: the last shard and the curvature file are gone; the same command resumes.
    resumed = root / "resumed"
    shutil.copytree(index, resumed)
    manifest = json.loads((resumed / "manifest.json").read_text())
    del manifest["shards"]["shard-00002.safetensors"], manifest["curvature"]
    manifest["complete"] = False
    (resumed / "manifest.json").write_text(json.dumps(manifest))
    (resumed / "shard-00002.safetensors").unlink()
    (resumed / CURVATURE_FILE).unlink()
    assert IndexReader(resumed).verify() != []
    _build(root, "resumed", "grads.preconditioner=module+kfac", "grads.rows_per_shard=7")
    want = (index / CURVATURE_FILE).read_bytes()
    for other in (workers, resumed):
        assert IndexReader(other).verify() == []
        assert (other / CURVATURE_FILE).read_bytes() == want  # same shards, same bytes
        for name in IndexReader(index).manifest["shards"]:
            assert (other / name).read_bytes() == (index / name).read_bytes()


def test_factors_sum_across_shard_sizes(root: Path, index: Path) -> None:
    one = _build(root, "one-shard", "grads.preconditioner=kfac", "grads.rows_per_shard=64")
    from safetensors.torch import load_file

    big = load_file(str(one / "shard-00000.safetensors"))
    small = [load_file(str(index / n)) for n in sorted(IndexReader(index).manifest["shards"])]
    assert "second_moment" not in big and int(big["kfac_tokens"][0]) == sum(int(t["kfac_tokens"][0]) for t in small)
    for key in factor_names(0) + factor_names(7):
        torch.testing.assert_close(big[key].double(), sum(t[key].double() for t in small), rtol=1e-5, atol=1e-4)
    q = torch.cat([g for _, g, _ in IndexReader(one).shards()])[:4]
    a = stream_topk(one, q, top_k=5, score="ekfac")
    b = stream_topk(index, q, top_k=5, score="ekfac")
    assert torch.equal(a["query_rows"], b["query_rows"])
    torch.testing.assert_close(a["query_scores"], b["query_scores"], rtol=1e-4, atol=1e-6)


def test_verify_checks_factors_and_curvature(index: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from circuitkit.core.io import sha256_file

    def forge(copy: Path, name: str, change) -> list[str]:
        tensors = load_file(copy / name)
        change(tensors)
        save_file(tensors, copy / name)
        manifest = json.loads((copy / "manifest.json").read_text())
        entry = manifest["shards"].get(name) or manifest["curvature"]
        entry["sha256"], entry["bytes"] = sha256_file(copy / name), (copy / name).stat().st_size
        if name != CURVATURE_FILE:  # a consistent forgery of the shard and the curvature built on it
            from gradian.index.curvature import shards_digest

            manifest["curvature"]["shards_sha256"] = shards_digest(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return IndexReader(copy).verify()

    def ekfac_scaled(t):
        t["ekfac.3"] = t["ekfac.3"] * 1.01

    def factor_asym(t):
        t["kfac_in.2"][0, 1] += 1.0

    def factor_scaled(t):
        t["kfac_out.1"] = t["kfac_out.1"] * 1.5

    copy = tmp_path / "a"
    shutil.copytree(index, copy)
    assert forge(copy, CURVATURE_FILE, ekfac_scaled) == [
        f"{CURVATURE_FILE} ekfac.3 is not the stored rows' second moment in the K-FAC eigenbasis"]
    copy = tmp_path / "b"
    shutil.copytree(index, copy)
    assert forge(copy, "shard-00001.safetensors", factor_asym) == [
        "shard-00001.safetensors kfac_in.2 is not a sum of outer products (not finite, not symmetric or a negative"
        " diagonal)"]
    copy = tmp_path / "c"
    shutil.copytree(index, copy)
    assert forge(copy, "shard-00001.safetensors", factor_scaled) == [
        f"{CURVATURE_FILE} q_out.1 / e_out.1 are not the eigendecomposition of the shards' summed kfac_out.1"]
    copy = tmp_path / "d"
    shutil.copytree(index, copy)
    (copy / CURVATURE_FILE).write_bytes(b"x" + (copy / CURVATURE_FILE).read_bytes()[1:])
    assert "changed after it was written" in IndexReader(copy).verify()[0]


def test_inspect_verify_says_what_it_checked(index: Path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    assert main(["inspect", str(index), "--verify"]) == 0
    line = " ".join(capsys.readouterr().err.split())
    assert "second moments (recomputed from the stored rows)" in line
    assert "EK-FAC eigenvalues recomputed from the stored rows" in line


def test_refusals(root: Path, index: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from circuitkit_app.gradian_cli import main

    plain = _build(root, "module-only", "grads.preconditioner=module", "grads.rows_per_shard=7")
    with pytest.raises(IndexMismatchError, match="grads.preconditioner=kfac"):
        stream_topk(plain, torch.ones(1, 8 * DIM), score="ekfac")
    with pytest.raises(ValueError, match="only influence, whitened, kfac, ekfac use a damping"):
        stream_topk(index, torch.ones(1, 8 * DIM), score="cosine", damping=0.1)
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")
    assert main(["rank", "--index", str(plain), "--queries", str(queries), "--score", "kfac"]) == 2
    assert main(["rank", "--index", str(index), "--queries", str(queries), "--score", "cosine", "--damping", "0.1"]) == 2
    assert "--score cosine: cosine uses no curvature" in " ".join(capsys.readouterr().err.split())
    assert main(["rank", "--index", str(plain), "--queries", str(queries), "--damping", "0.1"]) == 2  # auto: cosine
    assert "so --score auto is cosine, which uses no damping" in " ".join(capsys.readouterr().err.split())
    from circuitkit.core.errors import UserError
    from gradian.build import indexer

    # dense rows with the default kfac: one line naming the fix, before the model loads
    cfg = _cfg(root, "grads.projection=dense")
    monkeypatch.setattr(indexer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UserError, match=r"\(the default\) needs the Kronecker structure .* grads.preconditioner=none"):
        build_index(cfg.model, cfg.grads, tmp_path / "dense")
    assert not (tmp_path / "dense").exists()


def test_resume_with_another_preconditioner_is_refused_before_the_model_loads(index: Path, monkeypatch) -> None:
    import gradian.build.indexer as indexer

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(indexer, "load_model", no_load)
    cfg = _cfg(index.parent, "grads.preconditioner=module", "grads.rows_per_shard=7")
    with pytest.raises(IndexMismatchError, match="preconditioner: index has 'module\\+kfac', asked 'module'"):
        build_index(cfg.model, cfg.grads, index)


def test_resume_with_another_projection_is_refused_before_the_model_loads(index: Path, monkeypatch) -> None:
    # The default projection changed (kronecker -> kronecker_orthogonal): an index built with the
    # old one is refused at once, naming the key, not after the model has loaded.
    import gradian.build.indexer as indexer

    monkeypatch.setattr(indexer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    built = json.loads((index / "manifest.json").read_text())["projection"]
    other = "kronecker" if built["kind"] == "kronecker_orthogonal" else "kronecker_orthogonal"
    for override, message in ((f"grads.projection={other}", f"projection: index has '{built['kind']}', asked '{other}'"),
                              ("grads.projection_seed=5", "projection_seed: index has 0, asked 5")):
        cfg = _cfg(index.parent, "grads.preconditioner=module+kfac", "grads.rows_per_shard=7", override)
        with pytest.raises(IndexMismatchError, match=message):
            build_index(cfg.model, cfg.grads, index)


def test_rank_with_kfac_from_the_command_line_and_a_short_summary(index: Path, tmp_path: Path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    out = tmp_path / "ranked.jsonl"
    assert main(["rank", "--index", str(index), "--queries", str(queries), "--score", "ekfac", "--top-k", "3",
                 "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "first 3 ranks of 3 of 4 queries" in text and "first 5 ranks" not in text
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 5 * 3
    assert [r["row_id"] for r in results if r["rank"] == 1][:4] == [0, 1, 2, 3]  # each row finds itself first


def test_default_index_holds_kfac_and_the_disk_estimate_counts_it(root: Path, index: Path) -> None:
    """grads.preconditioner defaults to kfac; `estimate_grads`'s index_bytes counts the shards'
    factor sums and curvature.safetensors (and the module second moments) as they are on disk."""
    from safetensors import safe_open

    from gradian.build.memory import grads_index_bytes, preconditioner_index_bytes
    from gradian.curvature.factors import is_factor_tensor

    assert _cfg(root).grads.preconditioner == "kfac"
    reader = IndexReader(index)
    manifest = reader.manifest
    proj = manifest["projection"]
    projector = Projector.from_description({n: tuple(e["shape"]) for n, e in proj["modules"].items()}, proj)
    factor_bytes = moment_bytes = 0
    for name in manifest["shards"]:
        with safe_open(str(index / name), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                size = fh.get_tensor(key).nbytes
                if is_factor_tensor(key):
                    factor_bytes += size
                elif key == "second_moment":
                    moment_bytes += size
    curvature = (index / CURVATURE_FILE).stat().st_size
    n_shards = len(manifest["shards"])
    assert n_shards == 3 and factor_bytes > 0 and moment_bytes > 0
    kfac = preconditioner_index_bytes(projector, "kfac", n_shards)
    module = preconditioner_index_bytes(projector, "module", n_shards)
    assert module == moment_bytes
    # curvature.safetensors: its tensors + a header (42 tensor names here: under 4 KiB)
    assert kfac - factor_bytes <= curvature <= kfac - factor_bytes + 4096
    assert preconditioner_index_bytes(projector, "module+kfac", n_shards) == kfac + module
    assert preconditioner_index_bytes(projector, "none", n_shards) == 0
    from circuitkit.preflight.memory import shape_for
    from gradian.build.memory import estimate_grads

    cfg = _cfg(root)
    est = estimate_grads(shape_for(cfg.model), 4, 2, 32, 16, projector, 4, 20, preconditioner="kfac", rows_per_shard=7)
    assert est.index_bytes == grads_index_bytes(20, projector.total_width, 4) + kfac
    assert est.terms["K-FAC factor scratch"] > 0
    plain = estimate_grads(shape_for(cfg.model), 4, 2, 32, 16, projector, 4, 20)
    assert "K-FAC factor scratch" not in plain.terms
    assert est.total_bytes - plain.total_bytes == est.terms["K-FAC factor scratch"]
