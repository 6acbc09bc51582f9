"""scripts/bench/yardsticks_factored.py: the equal-bytes pairing of factored and dense rows.

Oracle: a dense k_o x k_i block stores k_o k_i numbers, rank-c factors c (k_o' + k_i'); the paired
width's factorisation (as `kronecker_factors` picks it for each module) must make them equal.
"""

from __future__ import annotations

import pytest

from gradian.projection.projector import kronecker_factors
from scripts.bench.yardsticks_factored import comparison_markdown, equal_bytes_width, parse_row_formats

FIXTURE_MLP = {"blocks.0.mlp.c_fc": (256, 64), "blocks.0.mlp.c_proj": (64, 256)}  # tiny GPT-2: d_model 64, d_mlp 256
SMOLLM2_DOWN = {"model.layers.29.mlp.down_proj": (576, 1536)}


@pytest.mark.parametrize(("shapes", "dense", "rank", "expected"), [
    (FIXTURE_MLP, 1024, 8, 4096),     # 32 x 32 <-> 64 x 64 at c = 8: 8 (64 + 64) = 1024
    (FIXTURE_MLP, 4096, 16, 12288),   # 64 x 64 <-> 192 x 64 at c = 16: 16 (192 + 64) = 4096
    (FIXTURE_MLP, 1024, 4, 12288),    # 32 x 32 <-> 192 x 64 at c = 4
    (SMOLLM2_DOWN, 4096, 8, 65536),   # 64 x 64 <-> 256 x 256 at c = 8
])
def test_equal_bytes_width_stores_the_dense_numbers(shapes, dense, rank, expected):
    width = equal_bytes_width(dense, rank, shapes)
    assert width == expected
    for d_out, d_in in shapes.values():
        k_o, k_i = kronecker_factors(width, d_out, d_in)
        assert rank * (k_o + k_i) == dense  # factored numbers per module == dense numbers per module


def test_equal_bytes_width_refuses_what_no_module_can_hold():
    # c = 8 at 4096 needs k_o' + k_i' = 512; the fixture's modules allow at most 256 + 64
    with pytest.raises(ValueError, match="512"):
        equal_bytes_width(4096, 8, FIXTURE_MLP)
    with pytest.raises(ValueError, match="multiple of the rank"):
        equal_bytes_width(1024, 3, FIXTURE_MLP)


def test_parse_row_formats():
    assert parse_row_formats("dense,factored:8") == [("dense", None), ("factored", 8)]
    with pytest.raises(SystemExit, match="factored:C"):
        parse_row_formats("factored")


def test_comparison_pairs_each_factored_row_with_its_dense_row():
    common = {"yardstick": "B", "style": "para", "loss": "ce", "width": "1024", "score": "cosine"}
    summary = [common | {"setup": "kronecker, empirical", "r10": 0.5, "r10_sd": 0.1, "stream_s": 0.01,
                         "bytes": {"rows": 4000}},
               common | {"setup": "kronecker, empirical, factored c=8 @4096", "r10": 0.6, "r10_sd": 0.05,
                         "stream_s": 0.03, "bytes": {"rows": 4000}}]
    table = comparison_markdown(summary, {"B": 10}).splitlines()
    assert table[2] == "| B para | ce | 1024 | cosine | dense | recall@10 | 0.500 ± 0.100 | 400 | 1.00 |"
    assert table[3] == ("| B para | ce | 1024 | cosine | factored c=8 @4096 | recall@10 | 0.600 ± 0.050 | 400 |"
                        " 3.00 |")
