"""grads.fisher=sampled (the true Fisher): K-FAC factors and EK-FAC eigenvalues from labels sampled
from the model's own prediction, against a dense autograd recomputation; the same factors whatever
the batching, sharding or row order; the stored rows untouched; resume refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from circuitkit.models.loading import load_model
from gradian.build.indexer import build_index
from gradian.capture.gradients import sampling_seed
from gradian.curvature.factors import CURVATURE_FILE, FISHER_ROWS, factor_names
from gradian.data.rows import load_rows, policy_of
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import Projector
from tests.gradian.curvature.test_kfac import _build, _cfg


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fisher")


@pytest.fixture(scope="module")
def sampled(root: Path) -> Path:
    return _build(root, "sampled", "grads.fisher=sampled", "grads.rows_per_shard=7")


@pytest.fixture(scope="module")
def empirical(root: Path) -> Path:
    return _build(root, "empirical", "grads.rows_per_shard=7")


def _shards(index: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(index / n)) for n in sorted(IndexReader(index).manifest["shards"])]


def _dense_sampled(index_dir: Path) -> dict:
    """One row at a time: labels drawn by the inverse CDF of the row's seeded uniforms from
    softmax of its logits (float64), the summed cross-entropy of those labels backpropagated by
    autograd, and per module Σ_t s_t s_tᵀ, Σ_t a_t a_tᵀ and the row's Σ_t s_t a_tᵀ."""
    manifest = IndexReader(index_dir).manifest
    loaded = load_model(_cfg(index_dir.parent).model)
    model = loaded.model
    rows, _ = load_rows(manifest["data_file"], loaded.tokenizer, manifest["max_seq_length"], policy=policy_of(manifest))
    proj = manifest["projection"]
    names = list(proj["modules"])
    projector = Projector.from_description({n: tuple(e["shape"]) for n, e in proj["modules"].items()}, proj)
    seed = proj["seed"]
    a_sum = {n: 0 for n in names}
    s_sum = {n: 0 for n in names}
    g = {n: [] for n in names}
    xs, ys = {}, {}
    for row_id, row in enumerate(rows):
        ids = torch.tensor([row.input_ids])
        sup = torch.tensor(row.supervised)[1:]

        def hook(name):
            def fn(module, args, out):
                xs[name] = args[0].detach()[0].double()
                out.retain_grad()
                ys[name] = out
            return fn

        handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
        h = model.get_input_embeddings().register_forward_hook(lambda m, a, o: o.requires_grad_(True))
        try:
            with torch.enable_grad():
                logits = model(input_ids=ids).logits[0, :-1][sup].float()
                u = torch.rand(int(sup.sum()), dtype=torch.float64,
                               generator=torch.Generator().manual_seed(sampling_seed(seed, row_id)))
                cdf = torch.softmax(logits.detach().double(), dim=-1).cumsum(-1)
                labels = torch.tensor([int((cdf[t] > u[t] * cdf[t, -1]).nonzero()[0]) for t in range(len(u))])
                torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
        finally:
            for handle in [*handles, h]:
                handle.remove()
        for n in names:
            p_out, p_in = (p.double() for p in projector.kronecker_matrices(n))
            a, s = xs[n] @ p_in.T, ys[n].grad[0].double() @ p_out.T
            a_sum[n] = a_sum[n] + a.T @ a
            s_sum[n] = s_sum[n] + s.T @ s
            g[n].append((s.T @ a).flatten())
    return {"a": [a_sum[n] for n in names], "s": [s_sum[n] for n in names],
            "g": [torch.stack(g[n]) for n in names]}


def test_sampled_factors_and_eigenvalues_equal_a_dense_recomputation(sampled: Path, empirical: Path) -> None:
    dense = _dense_sampled(sampled)
    shards, emp = _shards(sampled), _shards(empirical)
    k = IndexReader(sampled).manifest["row_width"] // len(dense["g"])
    rows = torch.cat([t[FISHER_ROWS] for t in shards]).double()
    curv = load_file(str(sampled / CURVATURE_FILE))
    n = rows.shape[0]
    for m in range(len(dense["g"])):
        key_in, key_out = factor_names(m)
        s = sum(t[key_out].double() for t in shards)
        a = sum(t[key_in].double() for t in shards)
        torch.testing.assert_close(s, dense["s"][m], rtol=1e-4, atol=1e-4 * dense["s"][m].abs().max().item())
        torch.testing.assert_close(a, dense["a"][m], rtol=1e-4, atol=1e-4 * dense["a"][m].abs().max().item())
        torch.testing.assert_close(rows[:, m * k:(m + 1) * k], dense["g"][m], rtol=1e-4, atol=1e-5)
        # The sampled Fisher is not the empirical one (the activations' factor is).
        s_emp = sum(t[key_out].double() for t in emp)
        assert (s - s_emp).abs().max() > 0.05 * s_emp.abs().max()
        torch.testing.assert_close(a, sum(t[key_in].double() for t in emp), rtol=1e-6, atol=1e-6)
        # EK-FAC eigenvalues: the sampled rows' second moment in the stored basis.
        q_out, q_in = curv[f"q_out.{m}"].double(), curv[f"q_in.{m}"].double()
        rotated = q_out.T @ dense["g"][m].reshape(n, *q_out.shape[:1], q_in.shape[0]) @ q_in
        want = (rotated**2).sum(0) / n
        torch.testing.assert_close(curv[f"ekfac.{m}"].double(), want, rtol=1e-3, atol=1e-6 * want.max().item())
    assert IndexReader(sampled).verify() == []


def test_stored_rows_keep_the_data_labels(sampled: Path, empirical: Path) -> None:
    got = torch.cat([g for _, g, _ in IndexReader(sampled).shards()])
    want = torch.cat([g for _, g, _ in IndexReader(empirical).shards()])
    assert torch.equal(got, want)
    assert IndexReader(sampled).manifest["fisher"] == "sampled"
    assert IndexReader(empirical).manifest["fisher"] == "empirical"
    assert not torch.equal(torch.cat([t[FISHER_ROWS] for t in _shards(sampled)]), want)


def test_sampled_factors_do_not_depend_on_batching_or_sharding(root: Path, sampled: Path) -> None:
    other = root / "other"
    for w in (0, 1):  # two workers, batches of 3 in source order, one shard of 20 rows apiece
        cfg = _cfg(root, "grads.fisher=sampled", "grads.rows_per_shard=10", "grads.batch_size=3",
                   "grads.group_by_length=false", "grads.num_shards=2", f"grads.shard_index={w}")
        build_index(cfg.model, cfg.grads, other)
    a, b = _shards(sampled), _shards(other)
    assert sum(int(t["kfac_tokens"][0]) for t in a) == sum(int(t["kfac_tokens"][0]) for t in b)
    for key in factor_names(0) + factor_names(7):
        x, y = sum(t[key].double() for t in a), sum(t[key].double() for t in b)
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * x.abs().max().item())
    x, y = (torch.cat([t[FISHER_ROWS] for t in s]) for s in (a, b))
    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6 * x.abs().max().item())
    ca, cb = load_file(str(sampled / CURVATURE_FILE)), load_file(str(other / CURVATURE_FILE))
    torch.testing.assert_close(ca["ekfac.0"], cb["ekfac.0"], rtol=1e-3, atol=1e-6 * ca["ekfac.0"].max().item())


def test_resume_with_another_fisher_is_refused_before_the_model_loads(sampled: Path, monkeypatch) -> None:
    import gradian.build.indexer as indexer

    monkeypatch.setattr(indexer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = _cfg(sampled.parent, "grads.rows_per_shard=7")
    with pytest.raises(IndexMismatchError, match="fisher: index has 'sampled', asked 'empirical'"):
        build_index(cfg.model, cfg.grads, sampled)


def test_an_index_without_fisher_reads_as_empirical_and_inspect_shows_it(empirical: Path, tmp_path: Path,
                                                                          capsys) -> None:
    import shutil

    from circuitkit_app.gradian_cli import main

    old = tmp_path / "old"
    shutil.copytree(empirical, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["fisher"]
    manifest["format_version"] = 5
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert IndexReader(old).manifest["fisher"] == "empirical"
    manifest["format_version"] = 6
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="no fisher"):
        IndexReader(old)
    assert main(["inspect", str(empirical.parent / "sampled")]) == 0
    out = " ".join(w for w in capsys.readouterr().out.replace("│", " ").split())
    assert "sampled Fisher" in out


def test_memory_estimate_bounds_the_sampled_label_pass() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from circuitkit.core.device import measure_peak
    from circuitkit.models.adapters import get_adapter
    from circuitkit.models.linear_modules import module_shapes, select_modules
    from circuitkit.preflight.memory import shape_from_config
    from gradian.build.memory import estimate_grads
    from gradian.capture.consumers import RowsConsumer, SampledFisherConsumer
    from gradian.capture.gradients import SampledLabels, capture_batch
    from gradian.curvature.consumers import FactorSumsConsumer
    from gradian.curvature.factors import FactorSums

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=50257, n_positions=128)).eval()
    model.requires_grad_(False)
    adapter = get_adapter(model)
    modules = select_modules(model, adapter, ["mlp.c_proj"])
    projector = Projector(module_shapes(modules), "kronecker", 64, seed=0)
    ids = torch.randint(0, 50257, (4, 64), generator=torch.Generator().manual_seed(0))
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, 48:] = True
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervised": sup}
    peaks, est = {}, {}
    for fisher in ("empirical", "sampled"):
        est[fisher] = estimate_grads(shape_from_config(model.config), 4, 4, 64, 16, projector, 4, 4,
                                     preconditioner="kfac", fisher=fisher).total_bytes
        with measure_peak(torch.device("cpu")) as peak:
            consumers = [RowsConsumer(projector, projector.names), FactorSumsConsumer(FactorSums(projector.names), fisher)]
            if fisher == "sampled":
                consumers.append(SampledFisherConsumer(projector, projector.names))
            capture_batch(model, adapter, modules, projector, batch, consumers, sampled=SampledLabels([0, 1, 2, 3], 0))
        peaks[fisher] = peak.peak_bytes
    assert peaks["sampled"] > peaks["empirical"]  # the second pass costs something
    for fisher in peaks:
        assert peaks[fisher] <= est[fisher], (peaks, est)
