"""scripts/bench/bench_lexsi.py and scripts/peers/neutral_heads.py: the neutral judge against two
oracles, the harness's parsing of the workers' results, and a missing Lexsi venv (no peer venv needed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scripts.bench import bench_lexsi
from scripts.peers.neutral_heads import NeutralJudge, Pairs, load_model, top_heads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GPT-2 fixture (2 layers x 4 heads) and 12 IOI pairs of unequal lengths."""
    from circuitkit.discovery.tasks import ioi
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model as load_fixture

    lm = load_fixture(ModelConfig(name="builtin:tiny-gpt2", precision="float32"))
    task = tmp_path_factory.mktemp("lexsi") / "ioi.safetensors"
    data = ioi.build(lm.tokenizer, 12, 0)
    assert len(set(data.lengths())) > 1  # right padding is exercised
    data.save(task)
    return Path(lm.path), task


def test_patching_every_head_reproduces_the_corrupted_run(tiny):
    # IOI (s2) changes one name before the answer position, whose own token is the same in both
    # prompts: with every head's output taken from the corrupted run, the answer position computes
    # exactly what the corrupted run does. An oracle that owes nothing to either tool's code.
    model_dir, task = tiny
    judge = NeutralJudge(load_model(model_dir), Pairs.load(task), batch_size=5)
    gap = abs(judge.m_all - judge.m_corrupted)  # what the corruption changes: 2.2e-4 on this random model
    assert gap > 1e-4
    assert judge.m_none == pytest.approx(judge.m_corrupted, abs=gap / 100)
    everything = torch.ones(judge.n_layers, judge.n_heads, dtype=torch.bool)
    assert judge.faithfulness(everything) == pytest.approx(1.0)
    assert judge.faithfulness(~everything) == pytest.approx(0.0)


def test_the_judge_agrees_with_the_pruning_evaluator_at_any_batch_size(tiny):
    from circuitkit.discovery.pruning.heads import Evaluator
    from circuitkit.discovery.tasks.base import TaskData
    from circuitkit.models.adapters import get_adapter

    model_dir, task = tiny
    model = load_model(model_dir)
    judges = [NeutralJudge(model, Pairs.load(task), batch_size=b) for b in (1, 12)]
    ours = Evaluator(get_adapter(model), TaskData.load(task), "logit_diff", "corrupted", None, 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        kept = torch.rand(2, 4, generator=g) > 0.5
        expected = ours(kept)
        for judge in judges:
            assert judge.metric(kept) == pytest.approx(expected, abs=1e-5)


def test_top_heads_rank_by_magnitude_and_counts_follow_mib():
    kept = top_heads([[0.1, -0.9, 0.0], [0.5, -0.2, 0.5]], 3)
    assert kept.tolist() == [[False, True, False], [True, False, True]]
    assert bench_lexsi.head_counts(144, [5, 10, 20, 50]) == [7, 14, 28, 72]
    assert bench_lexsi.head_counts(270, [5, 10, 20, 50]) == [13, 27, 54, 135]


def _result(head: list[list[float]], seconds: float, peak: int, **extra) -> dict:
    return {"head": head, "mlp": [0.0, 0.0], "seconds": seconds, "cpu_seconds": seconds, "peak_bytes": peak, **extra}


def test_faithfulness_rows_and_targets_from_worker_results(tiny):
    model_dir, task = tiny
    ours_heads = [[0.9, 0.1, -0.5, 0.0], [0.2, -0.8, 0.3, 0.05]]
    lexsi_heads = [[0.9, 0.1, 0.0, 0.5], [0.2, 0.3, -0.8, 0.05]]
    lexsi_own = {"by_size": {"2": {"patching": {"score": 0.5, "raw_ratio": 0.5}, "n_heads_kept": 2}}}
    results = {a: {"circuitkit": _result(ours_heads, 1.0, 100),
                   "lexsi": _result(lexsi_heads, 8.0, 300, faithfulness=lexsi_own)} for a in bench_lexsi.ALGORITHMS}
    faith = bench_lexsi.faithfulness_rows(model_dir, task, results, [2, 4], batch=4)
    rows = {(r["algorithm"], r["n_heads"]): r for r in faith["rows"]}
    assert set(rows) == {(a, k) for a in bench_lexsi.ALGORITHMS for k in (2, 4)}
    r2 = rows[("eap", 2)]
    assert r2["shared_heads"] == 1  # by |score|: ours {L0H0, L1H1}, Lexsi's {L0H0, L1H2}
    assert r2["own_lexsi"] == 0.5 and r2["own_lexsi_n_heads"] == 2 and "own_lexsi" not in rows[("eap", 4)]
    # ours' own figure (the pruning Evaluator) and the judge share a definition: equal numbers
    for r in faith["rows"]:
        assert r["own_circuitkit"] == pytest.approx(r["neutral_circuitkit"], abs=1e-4)
        assert math.isfinite(r["neutral_lexsi"])
    timing = [{"algorithm": a, "speedup": 8.0, "peak_ratio": 3.0} for a in bench_lexsi.ALGORITHMS]
    goal = bench_lexsi.targets({"tiny": {"timing": timing, "faithfulness": faith}})["tiny/eap"]
    assert goal["speedup_5x"] and goal["peak_at_or_below"]
    assert goal["neutral_at_least"] == all(r["neutral_circuitkit"] >= r["neutral_lexsi"]
                                           for r in faith["rows"] if r["algorithm"] == "eap")


def test_a_failed_lexsi_run_leaves_ours_in_the_rows(tiny):
    model_dir, task = tiny
    error = {"error": "RuntimeError: boom"}
    results = {a: {"circuitkit": _result([[1.0, 0.0, 0.0, 0.0], [0.0] * 4], 1.0, 1), "lexsi": error}
               for a in bench_lexsi.ALGORITHMS}
    rows = bench_lexsi.faithfulness_rows(model_dir, task, results, [1], batch=4)["rows"]
    assert all("neutral_circuitkit" in r and "neutral_lexsi" not in r and "shared_heads" not in r for r in rows)
    assert bench_lexsi.best_of([error, error]) == error


def test_a_missing_lexsi_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_lexsi, "LEXSI_PYTHON", tmp_path / "missing" / "python")
    out = bench_lexsi.measure_once("lexsi", tmp_path, tmp_path / "t.safetensors", "eap", 5, 4, tmp_path)
    assert "does not exist" in out["error"] and "make peers" in out["error"]


@pytest.mark.slow
def test_lexsi_eap_head_scores_equal_ours(tiny, tmp_path):
    # EAP at heads is the same quantity in both tools (Δ activation · gradient, mean over pairs):
    # equal to float32 round-off once the worker undoes Lexsi's extra 1 / batch.
    if not bench_lexsi.LEXSI_PYTHON.is_file():
        pytest.skip(f"{bench_lexsi.LEXSI_PYTHON} missing: `PEERS=lexsi make peers` builds it")
    model_dir, task = tiny
    runs = {tool: bench_lexsi.measure_once(tool, model_dir, task, "eap", 3, 4, tmp_path)
            for tool in ("circuitkit", "lexsi")}
    assert not any(r.get("error") for r in runs.values()), runs
    ours = torch.tensor(runs["circuitkit"]["head"])
    theirs = torch.tensor(runs["lexsi"]["head"])
    assert float((ours - theirs).abs().max()) < 1e-4 * float(ours.abs().max())
