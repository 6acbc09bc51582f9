"""Attribution over pairs of very different lengths: batches grouped by length give the same scores."""

from __future__ import annotations

import functools

import torch

from circuitkit.discovery.attribution import attribute
from circuitkit.discovery.tasks.base import from_token_lists
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model


@functools.cache
def _lm():
    return load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32"))


def _pairs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = _lm().model.config.vocab_size
    clean, corrupted = [], []
    for _ in range(n):
        length = int(torch.randint(4, 60, (1,), generator=g))
        row = torch.randint(10, vocab, (length,), generator=g).tolist()
        other = list(row)
        other[int(torch.randint(0, length - 1, (1,), generator=g))] = 5
        clean.append(row)
        corrupted.append(other)
    answers = [[int(t)] for t in torch.randint(10, vocab, (n,), generator=g)]
    wrong = [[int(t)] for t in torch.randint(10, vocab, (n,), generator=g)]
    return from_token_lists(clean, corrupted, answers, wrong, pad_id=0)


def test_length_batches_cover_every_pair_and_trim_padding():
    data = _pairs(23)
    batches = data.length_batches(5)
    assert sum(len(b) for b in batches) == 23
    assert all(len(b) <= 5 for b in batches)
    # Each batch is trimmed to its longest pair, and the batches follow the length order.
    assert [b.clean_ids.shape[1] for b in batches] == [max(b.lengths()) for b in batches]
    widths = [b.clean_ids.shape[1] for b in batches]
    assert widths == sorted(widths, reverse=True)
    lengths = sorted(data.lengths(), reverse=True)
    chunks = sum(min(5, 23 - i) * lengths[i] for i in range(0, 23, 5))  # fixed chunks of 5
    assert sum(b.clean_ids.numel() for b in batches) <= chunks
    in_order = data.length_batches(5, group_by_length=False)
    assert torch.equal(torch.cat([b.answer_pos for b in in_order]), data.answer_pos)


def test_grouped_batches_give_the_scores_of_data_order():
    data = _pairs(12, seed=1)
    kw = dict(algorithm="eap-ig", level="edge", ig_steps=2, batch_size=4, progress=False)
    grouped = attribute(_lm().adapter, data, group_by_length=True, **kw)
    ordered = attribute(_lm().adapter, data, group_by_length=False, **kw)
    single = attribute(_lm().adapter, data, **{**kw, "batch_size": 1})
    for other in (ordered, single):
        assert torch.allclose(grouped.head, other.head, rtol=1e-4, atol=1e-6)
        assert torch.allclose(grouped.edges, other.edges, rtol=1e-4, atol=1e-6)
