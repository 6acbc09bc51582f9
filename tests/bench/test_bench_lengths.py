"""scripts/bench/bench_lengths.py: interleaved rounds summarised as medians of paired ratios."""

from __future__ import annotations

import pytest

from scripts.bench.bench_lengths import summarize_indexing


def _run(tool: str, r: int, seconds: float, **extra) -> dict:
    return {"tool": tool, "precision": "bfloat16", "round": r, "n_rows": 96, "seconds": seconds,
            "peak_mib": 700.0, "padding_share": 0.07, **extra}


def test_speedups_are_medians_of_ratios_within_a_round():
    # The machine is twice as slow in round 1: both tools slow down, the ratio holds.
    runs = [_run("gradian", 0, 10.0), _run("bergson", 0, 20.0),
            _run("gradian", 1, 20.0), _run("bergson", 1, 44.0),
            _run("gradian", 2, 12.0), _run("bergson", 2, 18.0)]
    lines = {line["tool"]: line for line in summarize_indexing(runs, "bfloat16")}
    assert lines["bergson"]["speedup"] == pytest.approx(2.0)
    assert lines["bergson"]["speedup_range"] == pytest.approx((1.5, 2.2))
    assert lines["gradian"]["seconds"] == 12.0 and lines["gradian"]["examples_per_s"] == pytest.approx(8.0)


def test_floor_ratio_pairs_each_index_with_the_floor_timed_next_to_it():
    runs = [_run("gradian", 0, 10.0, index_preloaded_runs=[9.0, 18.0, 9.5], floor_supervised_runs=[9.0, 20.0, 9.5],
                 floor_ratio=1.0, floor_padding_free_seconds=15.0)]
    lines = {line["tool"]: line for line in summarize_indexing(runs, "bfloat16")}
    floor = lines["floor: fwd+bwd of the same length buckets"]
    assert floor["floor_ratio"] == pytest.approx(1.0) and floor["floor_ratio_range"] == pytest.approx((0.9, 1.0))
    assert lines["floor: exact-length batches, no padding at all"]["padding_share"] == 0.0


def test_a_tool_that_failed_every_round_is_a_line_with_its_error():
    runs = [_run("gradian", 0, 10.0), {"tool": "bergson", "precision": "bfloat16", "round": 0, "error": "no venv"}]
    lines = {line["tool"]: line for line in summarize_indexing(runs, "bfloat16")}
    assert lines["bergson"] == {"tool": "bergson", "error": "no venv"}
