"""scripts/bench/bench_peers.py: ranks, per-seed summaries, a missing peer venv as a row, and a quick run."""

from __future__ import annotations

import json

import pytest

from scripts.bench.bench_peers import ROOT, run_worker, summarize, target_ranks


def test_target_ranks_count_only_strictly_better_rows():
    scores = [[0.9, 0.5, 0.1], [0.2, 0.2, 0.7], [0.3, 0.8, 0.8]]
    assert target_ranks(scores, [0, 1, 2]) == [1, 2, 1]


def _run(tool: str, scores: dict, seconds: float = 2.0) -> dict:
    return {"tool": tool, "version": "1", "method": "m", "scoring": "cosine", "n_rows": 3, "row_width": 4,
            "bytes_per_row": 8.0, "index_seconds": seconds, "index_peak_bytes": 1024, "query_seconds": 0.1,
            "scores": scores}


def test_summary_averages_recall_over_seeds_and_times_the_first_run():
    hit = {"full": [[1.0, 0.0, 0.0]], "short": [[1.0, 0.0, 0.0]]}
    miss = {"full": [[0.0, 0.5, 1.0]], "short": [[1.0, 0.0, 0.0]]}
    out = summarize([_run("gradian", hit, 2.0), _run("gradian", miss, 9.0)], targets=[0])
    assert out["examples_per_s"] == pytest.approx(1.5)
    assert out["seeds"] == 2
    assert out["full_mrr"] == pytest.approx((1 + 1 / 3) / 2) and out["short_mrr"] == 1.0
    assert out["full_mrr_sd"] > 0 and out["short_mrr_sd"] == 0


def test_a_failed_tool_is_a_row_with_its_error():
    out = summarize([{"tool": "traker", "error": "RuntimeError: vmap"}], targets=[0])
    assert out == {"tool": "traker", "error": "RuntimeError: vmap"}


def test_a_missing_peer_venv_says_how_to_build_it(tmp_path, monkeypatch):
    from scripts.bench import bench_peers

    monkeypatch.setattr(bench_peers, "ROOT", tmp_path)
    out = run_worker("bergson", {"work_dir": str(tmp_path)}, tmp_path, timeout=10)
    assert out["tool"] == "bergson" and "make peers" in out["error"]


@pytest.mark.slow
def test_quick_run_gradian_against_bergson(tmp_path):
    if not (ROOT / ".venv-peers" / "bin" / "python").exists():
        pytest.skip(".venv-peers missing: `make peers` builds it")
    from scripts.bench.bench_peers import main

    out = tmp_path / "peers.json"
    assert main(["--quick", "--no-circuit", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["tool"]: r for r in report["indexing"]}
    assert set(rows) == {"gradian", "bergson"}
    chance = 10 / report["data"]["n_docs"]
    for tool, row in rows.items():
        assert not row.get("error"), (tool, row.get("error"))
        assert row["full_recall@10"] > 3 * chance and row["examples_per_s"] > 0 and row["bytes_per_row"] > 0
