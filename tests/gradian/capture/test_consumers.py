"""What the capture hands its consumers (`gradian.capture.consumers`): per module and backward the
projected pair (x_p, d_p), from which a consumer of its own rebuilds the stored rows and the K-FAC
factor sums; a sampled-label consumer sees the same x_p with other output gradients; refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from circuitkit.models.adapters import get_adapter
from circuitkit.models.linear_modules import module_shapes, select_modules
from gradian.capture.consumers import DATA, SAMPLED, BatchFacts, RowsConsumer, SampledFisherConsumer
from gradian.capture.gradients import LossSettings, SampledLabels, capture_batch, per_example_gradients
from gradian.curvature.consumers import FactorSumsConsumer
from gradian.curvature.factors import FactorSums
from gradian.projection.projector import Projector

LENGTHS, PROMPT = (12, 7, 9), 3


class Pairs:
    """A consumer that keeps every pair it is handed."""

    def __init__(self, labels: str) -> None:
        self.labels = labels
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.finished: list[BatchFacts] = []

    def take(self, name: str, xp: torch.Tensor, dp: torch.Tensor, batch: BatchFacts) -> None:
        assert name not in self.pairs  # once per module and backward
        self.pairs[name] = (xp.clone(), dp.clone())

    def finish(self, batch: BatchFacts) -> None:
        self.finished.append(batch)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    model = model.eval().requires_grad_(False)
    adapter = get_adapter(model)
    modules = select_modules(model, adapter, ["mlp.c_fc", "attn.c_proj"])
    return model, adapter, modules, Projector(module_shapes(modules), "kronecker", 16, seed=0)


def _batch():
    ids = torch.randint(1, 97, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1
    supervised = mask.bool() & (torch.arange(ids.shape[1]) >= PROMPT)
    return {"input_ids": ids, "attention_mask": mask, "supervised": supervised}


def test_the_pairs_rebuild_the_rows_and_the_factor_sums(lm) -> None:
    model, adapter, modules, projector = lm
    names = [name for name, _ in modules]
    mine, rows, sums = Pairs(DATA), RowsConsumer(projector, names), FactorSums(names)
    got = capture_batch(model, adapter, modules, projector, _batch(), [mine, rows, FactorSumsConsumer(sums)],
                        LossSettings(loss="margin"))
    assert list(mine.pairs) == names[::-1]  # in backward order
    assert mine.finished == [BatchFacts(spans=[n - 1 for n in LENGTHS], real_tokens=sum(LENGTHS))]
    assert sums.tokens == sum(LENGTHS)
    for name, (xp, dp) in mine.pairs.items():
        assert xp.shape[:2] == dp.shape[:2] == (3, max(LENGTHS))
        for b, n in enumerate(LENGTHS):  # padding adds nothing
            assert not xp[b, n:].any() and not dp[b, n:].any()
        torch.testing.assert_close(rows.blocks[name], torch.einsum("bto,bti->boi", dp, xp).flatten(1))
        flat_x, flat_d = xp.reshape(-1, xp.shape[-1]).double(), dp.reshape(-1, dp.shape[-1]).double()
        torch.testing.assert_close(sums.a[name], flat_x.T @ flat_x)
        torch.testing.assert_close(sums.s[name], flat_d.T @ flat_d)
    plain = per_example_gradients(model, adapter, modules, projector, _batch(), loss="margin")
    assert torch.equal(plain.row(), rows.row())
    assert torch.equal(plain.losses, got.losses) and plain.n_supervised.tolist() == [n - PROMPT for n in LENGTHS]


def test_sampled_labels_give_the_same_inputs_other_output_gradients(lm) -> None:
    model, adapter, modules, projector = lm
    names = [name for name, _ in modules]
    data, drawn, fisher_rows = Pairs(DATA), Pairs(SAMPLED), SampledFisherConsumer(projector, names)
    capture_batch(model, adapter, modules, projector, _batch(), [data, drawn, fisher_rows],
                  sampled=SampledLabels([5, 6, 7], seed=0))
    alone = Pairs(SAMPLED)  # without a consumer of the data's labels: one backward, the same draws
    capture_batch(model, adapter, modules, projector, _batch(), [alone], sampled=SampledLabels([5, 6, 7], seed=0))
    for name in names:
        assert torch.equal(data.pairs[name][0], drawn.pairs[name][0])
        assert not torch.allclose(data.pairs[name][1], drawn.pairs[name][1])
        assert torch.equal(alone.pairs[name][1], drawn.pairs[name][1])
        xp, dp = drawn.pairs[name]
        assert torch.equal(fisher_rows.blocks[name], projector.combine(name, xp, dp))


def test_a_sampled_consumer_needs_one_row_id_per_example(lm) -> None:
    model, adapter, modules, projector = lm
    with pytest.raises(ValueError, match="needs row_ids, one per example"):
        capture_batch(model, adapter, modules, projector, _batch(), [Pairs(SAMPLED)])
    with pytest.raises(ValueError, match="needs row_ids, one per example"):
        capture_batch(model, adapter, modules, projector, _batch(), [Pairs(SAMPLED)], sampled=SampledLabels([0], 0))


def test_unknown_labels_and_fishers_are_refused(lm) -> None:
    model, adapter, modules, projector = lm
    with pytest.raises(ValueError, match=r"a consumer reads labels \['model'\]; valid: data, sampled"):
        capture_batch(model, adapter, modules, projector, _batch(), [Pairs("model")])
    with pytest.raises(ValueError, match=r"grads.fisher='true'; valid: empirical, sampled"):
        FactorSumsConsumer(FactorSums(["m"]), "true")
