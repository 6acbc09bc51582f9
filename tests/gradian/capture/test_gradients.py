"""Gradian's per-example gradients and projections against autograd, on the tiny fixtures (float32)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.models.loading import load_model
from gradian.capture.gradients import per_example_gradients
from gradian.projection.projector import Projector, kronecker_factors


@functools.cache
def _load(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"), device=torch.device("cpu"))


def _rows(seqs: list[torch.Tensor], sup_from: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded batch: sequence i supervised from position sup_from[i] to its end."""
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    sup = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, k) in enumerate(zip(seqs, sup_from, strict=True)):
        ids[i, :len(s)], mask[i, :len(s)], sup[i, k:len(s)] = s, 1, True
    return {"input_ids": ids, "attention_mask": mask, "supervised": sup}


def _random_seqs(n: int, seed: int, lo: int = 8, hi: int = 20) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    seqs = [torch.randint(5, 250, (n_tok,), generator=g) for n_tok in lengths]
    return seqs, [max(1, n_tok // 2) for n_tok in lengths]  # second half supervised (a "completion")


def _autograd_reference(lm, modules, seq: torch.Tensor, sup_from: int, reduction: str) -> dict[str, torch.Tensor]:
    """Each module's weight gradient for one example alone, via the model's own full logits.

    Returned in nn.Linear orientation (d_out, d_in): Conv1D's (in, out) gradient is transposed.
    """
    from transformers.pytorch_utils import Conv1D

    for _, m in modules:
        m.weight.requires_grad_(True)
        m.weight.grad = None
    try:
        logits = lm.model(input_ids=seq[None]).logits[0].float()  # (T, V), softcap included
        tok = F.cross_entropy(logits[sup_from - 1:-1], seq[sup_from:], reduction="none")
        (tok.sum() if reduction == "sum" else tok.mean()).backward()
        return {n: (m.weight.grad.T if isinstance(m, Conv1D) else m.weight.grad).clone() for n, m in modules}
    finally:
        for _, m in modules:
            m.weight.requires_grad_(False)
            m.weight.grad = None


@pytest.mark.parametrize("fixture,reduction", [("tiny-gpt2", "sum"), ("tiny-llama", "sum"),
                                               ("tiny-llama", "mean"), ("tiny-gemma3", "sum")])
def test_raw_gradients_equal_autograd(fixture: str, reduction: str, monkeypatch) -> None:
    lm = _load(fixture)
    if fixture == "tiny-gemma3":
        # The fixture leaves softcapping off; switch it on so the replicated head is exercised
        # (logits here are ~0.6 in size, so a cap of 0.2 changes them a lot).
        monkeypatch.setattr(lm.adapter.config, "final_logit_softcapping", 0.2)
    modules = select_modules(lm.model, lm.adapter, None)
    projector = Projector(module_shapes(modules), projection_dim=None)
    seqs, sup_from = _random_seqs(3, seed=1)
    got = per_example_gradients(lm.model, lm.adapter, modules, projector, _rows(seqs, sup_from),
                                loss_reduction=reduction)
    worst = 0.0
    for b, (seq, k) in enumerate(zip(seqs, sup_from, strict=True)):
        ref = _autograd_reference(lm, modules, seq, k, reduction)
        for name, _ in modules:
            exp, row = ref[name].flatten(), got[name][b]
            worst = max(worst, ((row - exp).norm() / exp.norm()).item())
    print(f"{fixture}/{reduction}: max relative error vs autograd {worst:.2e}")
    assert worst <= 1e-5
    assert got.losses.shape == (3,) and got.n_supervised.tolist() == [len(s) - k for s, k in zip(seqs, sup_from, strict=True)]


@pytest.mark.parametrize("fixture", ["tiny-gpt2", "tiny-llama"])
def test_row_does_not_depend_on_batch(fixture: str) -> None:
    lm = _load(fixture)
    modules = select_modules(lm.model, lm.adapter, ["*.mlp.*", "o_proj", "attn.c_proj"])
    projector = Projector(module_shapes(modules), "kronecker", 64, seed=3)
    seqs, sup_from = _random_seqs(5, seed=2, lo=6, hi=24)
    mixed = per_example_gradients(lm.model, lm.adapter, modules, projector, _rows(seqs, sup_from))
    for b in (0, 3):
        alone = per_example_gradients(lm.model, lm.adapter, modules, projector, _rows([seqs[b]], [sup_from[b]]))
        a, m = alone.row()[0], mixed.row()[b]
        assert F.cosine_similarity(a, m, dim=0) >= 0.999
        torch.testing.assert_close(m, a, rtol=1e-4, atol=1e-5 * a.abs().max().item())
        torch.testing.assert_close(mixed.losses[b], alone.losses[0])


def _clustered_batch() -> dict[str, torch.Tensor]:
    """Near-duplicate groups: gradients with a spread of inner products (independent random rows
    have nearly orthogonal gradients, so any Pearson would measure noise)."""
    from scripts.bench.bench_projection import clustered_batch

    return clustered_batch()


# Measured on tiny-llama down_proj (64 x 128 = 8192 weights), 24 clustered rows, seeds 0-2:
#   kronecker 64: 0.70-0.73, 256: 0.85-0.87, 1024: 0.94-0.95, 4096: 0.98
#   dense     64: 0.71-0.78, 256: 0.89-0.91, 1024: 0.97-0.98, 4096: 0.99
@pytest.mark.parametrize("kind,dim,at_least", [("kronecker", 1024, 0.9), ("dense", 1024, 0.9),
                                               ("kronecker", 4096, 0.95)])
def test_projection_preserves_inner_products(kind: str, dim: int, at_least: float) -> None:
    lm = _load("tiny-llama")
    modules = select_modules(lm.model, lm.adapter, ["down_proj"])
    shapes = module_shapes(modules)
    batch = _clustered_batch()
    raw = per_example_gradients(lm.model, lm.adapter, modules, Projector(shapes, projection_dim=None), batch)
    projector = Projector(shapes, kind, dim, seed=0)
    proj = per_example_gradients(lm.model, lm.adapter, modules, projector, batch)
    # The streamed projection equals projecting the formed gradients (same matrices, same maths).
    for name, (d_out, d_in) in shapes.items():
        formed = projector.project_gradient(name, raw[name].view(-1, d_out, d_in))
        torch.testing.assert_close(proj[name], formed, rtol=1e-4, atol=1e-4 * formed.abs().max().item())
    n = batch["input_ids"].shape[0]
    iu = torch.triu_indices(n, n, 1)  # off-diagonal pairs: the diagonal (norms) would be trivially easy
    exact, approx = (raw.row() @ raw.row().T)[iu[0], iu[1]], (proj.row() @ proj.row().T)[iu[0], iu[1]]
    pearson = torch.corrcoef(torch.stack([exact, approx]))[0, 1].item()
    print(f"{kind} projection_dim={dim}: Pearson of pairwise inner products {pearson:.4f}")
    assert pearson >= at_least


def test_logits_are_gathered_before_unembedding() -> None:
    lm = _load("tiny-llama")
    modules = select_modules(lm.model, lm.adapter, ["down_proj"])
    seqs, sup_from = _random_seqs(4, seed=5, lo=10, hi=30)
    batch = _rows(seqs, sup_from)
    shapes: list[tuple[int, ...]] = []
    handle = lm.adapter.unembed.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        per_example_gradients(lm.model, lm.adapter, modules, Projector(module_shapes(modules), "kronecker", 16),
                              batch)
    finally:
        handle.remove()
    n_sup = int(batch["supervised"].sum())
    assert n_sup < batch["input_ids"].numel()
    assert shapes == [(n_sup, lm.adapter.vocab_size)]


def test_kronecker_matrices_are_seeded() -> None:
    shapes = {"model.layers.0.mlp.down_proj": (64, 128), "model.layers.1.mlp.down_proj": (64, 128)}
    a, b, c = Projector(shapes, "kronecker", 256, 7), Projector(shapes, "kronecker", 256, 7), \
        Projector(shapes, "kronecker", 256, 8)
    name0, name1 = list(shapes)
    for pa, pb in zip(a.kronecker_matrices(name0), b.kronecker_matrices(name0), strict=True):
        assert torch.equal(pa, pb)
    assert a.kronecker_matrices(name0)[0].shape == (16, 64)
    assert not torch.equal(a.kronecker_matrices(name0)[0], c.kronecker_matrices(name0)[0])
    assert not torch.equal(a.kronecker_matrices(name0)[1], c.kronecker_matrices(name0)[1])
    # Same shape, another module: another matrix (the name is part of the seed).
    assert not torch.equal(a.kronecker_matrices(name0)[0], a.kronecker_matrices(name1)[0])
    assert set(a.kronecker_matrices(name0)[0].unique().tolist()) == {-0.25, 0.25}  # ±1/sqrt(16)
    d1, d2 = Projector(shapes, "dense", 32, 7), Projector(shapes, "dense", 32, 7)
    assert torch.equal(d1.dense_matrix(name0), d2.dense_matrix(name0))


def test_kronecker_factors() -> None:
    assert kronecker_factors(1024, 64, 128) == (32, 32)
    assert kronecker_factors(2048, 64, 128) == (32, 64)  # larger factor to the larger side
    assert kronecker_factors(18 * 18, 768, 3072) == (18, 18)
    with pytest.raises(ValueError, match="projection_dim=4096 has no factorisation.*Try"):
        kronecker_factors(4096, 32, 64)


def test_select_modules() -> None:
    lm = _load("tiny-gpt2")
    all_names = [n for n, _ in select_modules(lm.model, lm.adapter, None)]
    assert all_names[:4] == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                             "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert [n for n, _ in select_modules(lm.model, lm.adapter, ["*.mlp.c_proj"])] == \
        ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]
    assert len(select_modules(lm.model, lm.adapter, ["c_proj"])) == 4  # substring: attn and mlp
    assert module_shapes(select_modules(lm.model, lm.adapter, ["h.0.mlp.c_fc"])) == \
        {"transformer.h.0.mlp.c_fc": (256, 64)}  # Conv1D weight is (64, 256): reported as (out, in)
    with pytest.raises(ValueError, match="down_proj.*matches no linear module.*mlp.c_proj"):
        select_modules(lm.model, lm.adapter, ["down_proj"])


def test_batch_errors() -> None:
    lm = _load("tiny-llama")
    modules = select_modules(lm.model, lm.adapter, ["down_proj"])
    projector = Projector(module_shapes(modules), "kronecker", 16)
    batch = _rows(*_random_seqs(2, seed=0))
    batch["supervised"][1] = False
    with pytest.raises(ValueError, match=r"examples \[1\].*no supervised token"):
        per_example_gradients(lm.model, lm.adapter, modules, projector, batch)
