"""scripts/bench/bench_methods.py: the smallest-k scan and the per-method rows.

Oracles: on a known faithfulness curve the scan returns its first k at 0.8; on the trained
induction model every method's smallest set is the two known heads (previous-token, induction).
"""

from __future__ import annotations

import functools
import json
import signal
from pathlib import Path

import pytest

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from scripts.bench.bench_methods import METHODS, run_task, smallest_k


@functools.cache
def induction():
    lm = load_model(ModelConfig(name="builtin:induction", precision="float32"))
    data = build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=48, induction_format="single"), 16, 0)
    info = json.loads((Path(lm.path) / "fixture_info.json").read_text())
    return lm, data[:8], data[8:], {tuple(info["prev_token_head"][:2]), tuple(info["induction_head"][:2])}


def test_smallest_k_finds_the_first_k_reaching_the_target():
    calls = []

    def linear(k):  # f = k / 15: 0.8 first at k = 12
        calls.append(k)
        return k / 15

    k, points = smallest_k(linear, 40, 0.8, step=8)
    assert k == 12 and dict(points)[12] == pytest.approx(0.8)
    assert max(calls) == 16 and len(calls) == len(set(calls))  # stops at the first coarse hit, no k twice
    assert [k for k, _ in points] == sorted(calls)
    assert smallest_k(lambda k: 0.5, 20, 0.8, step=8) == (None, [(8, 0.5), (16, 0.5), (20, 0.5)])
    # a hit on the last, short step of the grid (n_total not a multiple of step) is refined too
    assert smallest_k(lambda k: float(k >= 19), 20, 0.8, step=8)[0] == 19


def test_every_method_keeps_the_two_known_heads():
    lm, attr, held, known = induction()
    out = run_task(lm.adapter, attr, held, list(METHODS), batch_size=8, step=2, log=lambda line: None)
    assert out["n_heads"] == 8 and out["compare_k"] == 0 and out["m_full"] > out["m_empty"] + 2.0
    rows = {r["method"]: r for r in out["rows"]}
    assert list(rows) == list(METHODS)
    for method, r in rows.items():
        assert r["status"] == "ok" and r["wall_s"] > 0 and r["peak_mib"] > 0, r
        # one head is not enough, the two known ones are (f near 1)
        assert r["k_at_target"] == 2 and r["f_at_k"] > 0.99, (method, r["points"])
        assert dict(r["points"])[1] < 0.1
    assert rows["eap-ig-mask"]["mask_steps"] == 40 and rows["eap-ig-mask"]["wall_s"] > rows["eap-ig"]["wall_s"]
    assert rows["eap-ig-positive"]["max_heads"] < 8  # only the positive scores can be kept
    assert rows["acdc"]["circuit_heads"] == 2 and rows["acdc"]["circuit_f"] > 0.99
    json.dumps(out)  # the --json output is plain data


def test_a_slow_attribution_is_cut_off_and_recorded():
    lm, attr, held, _ = induction()
    out = run_task(lm.adapter, attr, held, ["acdc", "acdc"], batch_size=8, timeout_s=1e-3, step=2,
                   log=lambda line: None)
    for row in out["rows"]:  # the second row reuses the first's outcome: ACDC is not run twice
        assert row["status"] == "not finished in 0.001 s" and row["wall_s"] == 1e-3, row
        assert row["k_at_target"] is None and row["points"] == [] and row["f_at_compare"] is None
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left to fire later
