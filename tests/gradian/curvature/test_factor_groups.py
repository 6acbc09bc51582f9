"""K-FAC factor sums of several modules in one stacked product (`FactorSums.add_group`, fed by
`FactorSumsConsumer` in groups of consecutive modules) equal one product per module, to float64
rounding (a batched product may block its sums otherwise: bit for bit on the index's shapes,
tests/gradian/index/test_formats_bytes.py, not on every shape)."""

from __future__ import annotations

import torch

from gradian.capture.consumers import BatchFacts
from gradian.curvature.consumers import GROUP, FactorSumsConsumer
from gradian.curvature.factors import FactorSums


def _pairs(seed: int, names, shapes):
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(3, 11, k_i, generator=g), torch.randn(3, 11, k_o, generator=g))
            for name, (k_o, k_i) in zip(names, shapes, strict=True)]


def test_grouped_sums_equal_one_product_per_module_over_batches():
    # two shapes, interleaved so that groups break where the shape changes, and more than GROUP alike
    shapes = [(4, 6)] * (GROUP + 3) + [(5, 2)] * 2 + [(4, 6)]
    names = [f"m{i}" for i in range(len(shapes))]
    grouped, single = FactorSums(names), FactorSums(names)
    facts = BatchFacts(spans=[11, 11, 11], real_tokens=33)
    for seed in range(3):
        consumer = FactorSumsConsumer(grouped)
        for name, xp, dp in _pairs(seed, names, shapes):
            consumer.take(name, xp, dp, facts)
            single.add(name, xp, dp)
        consumer.flush()
    assert grouped._stacks  # the stacked path ran
    for name in names:
        torch.testing.assert_close(grouped.a[name], single.a[name], rtol=1e-14, atol=1e-13)
        torch.testing.assert_close(grouped.s[name], single.s[name], rtol=1e-14, atol=1e-13)
    grouped.symmetric()
    single.symmetric()
    for name, xp, dp in _pairs(9, names, shapes):  # after the totals were replaced: module by module
        grouped.add_group([name], [xp], [dp])
        single.add(name, xp, dp)
    for name in names:
        torch.testing.assert_close(grouped.a[name], single.a[name], rtol=1e-14, atol=1e-13)
        torch.testing.assert_close(grouped.s[name], single.s[name], rtol=1e-14, atol=1e-13)
