"""`gradian rank`: query gradients against a streamed index, on the tiny GPT-2 fixture."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from circuitkit.core.device import measure_peak
from circuitkit.models.config import ModelConfig
from circuitkit_app.config import compose
from circuitkit_app.gradian_cli import main
from circuitkit_app.stage_list import run_pipeline
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.index.writer import IndexWriter
from gradian.rank.ranking import rank
from gradian.rank.scores import stream_topk

SUBJECTS = ["cat", "dog", "bird", "fish", "horse", "mouse", "lion", "bear", "wolf", "fox"]
VERBS = ["runs", "sleeps", "eats"]
ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the {'garden' if i % 2 else 'forest'} {i}."}
        for i, (s, v) in enumerate((s, v) for v in VERBS for s in SUBJECTS)]  # 30 distinct rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A 30-row index of the tiny GPT-2 fixture (float32 weights, dim 64, 3 shards)."""
    root = tmp_path_factory.mktemp("rank")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    index_dir = root / "index"
    _, cfg = compose(["stages=[grads]", "model.precision=float32", "grads.projection_dim=64",
                      "grads.rows_per_shard=12", "grads.batch_size=8", f"grads.data_path={data}",
                      f"grads.index_dir={index_dir}"])
    run_pipeline(cfg, root / "run")
    assert IndexReader(index_dir).complete
    return root, index_dir


def _write_queries(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_duplicate_of_a_training_row_ranks_it_first(built):
    root, index_dir = built
    queries = _write_queries(root / "dup.jsonl", [ROWS[7], ROWS[21]])
    results = rank(index_dir, queries, top_k=5, score="cosine", aggregate="max", out_path=root / "dup_out.jsonl")
    by_query = {q: [r for r in results if r["query"] == q] for q in (0, 1, "aggregate")}
    assert [len(v) for v in by_query.values()] == [5, 5, 5]
    for q, row in ((0, 7), (1, 21)):
        first = by_query[q][0]
        assert first["rank"] == 1 and first["row_id"] == row
        assert first["score"] == pytest.approx(1.0, abs=1e-3)  # float16 storage round-off only
        assert by_query[q][1]["score"] < 0.999  # distinct rows are clearly less similar
        assert first["source_line"] == row + 1
        assert first["text_preview"] == ROWS[row]["prompt"] + ROWS[row]["completion"]
    assert {r["row_id"] for r in by_query["aggregate"][:2]} == {7, 21}
    written = [json.loads(line) for line in (root / "dup_out.jsonl").read_text().splitlines()]
    assert written == results


def test_dot_score_and_moved_data_file(built, tmp_path):
    root, index_dir = built
    moved = tmp_path / "index"
    shutil.copytree(index_dir, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["data_file"] = str(tmp_path / "gone.jsonl")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    queries = _write_queries(tmp_path / "q.jsonl", [ROWS[3]])
    results = rank(moved, queries, top_k=3, score="dot", aggregate="mean")
    assert [r["rank"] for r in results] == [1, 2, 3, 1, 2, 3]
    assert all(r["text_preview"] is None for r in results)
    scores = [r["score"] for r in results[:3]]
    assert scores == sorted(scores, reverse=True)


def test_a_mismatched_index_is_refused_naming_the_key(built, tmp_path):
    root, index_dir = built
    queries = _write_queries(tmp_path / "q.jsonl", [ROWS[0]])
    # The model in another precision: other weights than the index was built from.
    with pytest.raises(IndexMismatchError, match="weights_sha256"):
        rank(index_dir, queries, model_cfg=ModelConfig(name="builtin:tiny-gpt2", precision="bfloat16"))
    # A manifest whose module shapes are not the model's.
    edited = tmp_path / "edited"
    shutil.copytree(index_dir, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    first = next(iter(manifest["projection"]["modules"]))
    manifest["projection"]["modules"][first]["shape"] = [3, 5]
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexMismatchError, match=r"projection\.modules"):
        rank(edited, queries)


def _synthetic_index(index_dir, n_rows: int, width: int, rows_per_shard: int) -> None:
    writer = IndexWriter(index_dir, {"storage_dtype": "float16", "row_width": width}, n_rows, rows_per_shard)
    gen = torch.Generator().manual_seed(0)
    for k in writer.pending():
        start, end = writer.row_range(k)
        # Row scales vary so that dot and cosine rank differently.
        grads = torch.randn(end - start, width, generator=gen) * torch.rand(end - start, 1, generator=gen)
        writer.write_shard(k, grads, torch.arange(start, end))


@pytest.mark.parametrize("score,aggregate", [("cosine", "mean"), ("dot", "max")])
def test_stream_topk_matches_brute_force_in_bounded_memory(tmp_path, score, aggregate):
    n_rows, width, top_k = 100_000, 256, 10
    _synthetic_index(tmp_path / "idx", n_rows, width, 8192)
    queries = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    with measure_peak(torch.device("cpu")) as peak:
        top = stream_topk(tmp_path / "idx", queries, top_k, score, aggregate)
    seconds = time.perf_counter() - start
    full_fp32_bytes = n_rows * width * 4
    print(f"stream_topk {score}/{aggregate}: {n_rows / seconds:,.0f} rows/s, peak {peak.peak_bytes / 2**20:.1f} MiB"
          f" of a {full_fp32_bytes / 2**20:.1f} MiB float32 index")
    assert peak.peak_bytes < full_fp32_bytes / 4

    grads = torch.cat([g for _, g, _ in IndexReader(tmp_path / "idx").shards()])
    scores = queries @ grads.T
    if score == "cosine":
        scores = scores / queries.norm(dim=1, keepdim=True) / grads.norm(dim=1)
    agg = scores.mean(dim=0) if aggregate == "mean" else scores.amax(dim=0)
    want_q, want_a = scores.topk(top_k, dim=1), agg.topk(top_k)
    assert torch.equal(top["query_rows"], want_q.indices)
    torch.testing.assert_close(top["query_scores"], want_q.values, rtol=1e-4, atol=1e-5)
    assert torch.equal(top["aggregate_rows"], want_a.indices)
    torch.testing.assert_close(top["aggregate_scores"], want_a.values, rtol=1e-4, atol=1e-5)


def test_cli_rank_writes_jsonl_and_reports_errors(built, tmp_path, capsys):
    root, index_dir = built
    queries = _write_queries(tmp_path / "q.jsonl", [ROWS[2], ROWS[12]])
    out = tmp_path / "ranked.jsonl"
    assert main(["rank", "--index", str(index_dir), "--queries", str(queries), "--top-k", "4",
                 "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 * 4 and lines[0]["row_id"] == 2 and lines[4]["row_id"] == 12
    assert "aggregate" in capsys.readouterr().out
    assert main(["rank", "--index", str(tmp_path / "nope"), "--queries", str(queries)]) == 2
    assert main(["rank", "--index", str(index_dir), "--queries", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_skip_checksums_and_its_deprecated_spelling(capsys) -> None:
    """`--skip-checksums` skips the shards' sha256 check; `--no-verify`, its old spelling (which read as the
    opposite of `gradian attribute --verify`), still works and says what it became."""
    import argparse

    from gradian.rank.checksum_flag import add_skip_checksums, skip_checksums

    parser = argparse.ArgumentParser()
    add_skip_checksums(parser, "skip")
    assert skip_checksums(parser.parse_args([])) is False
    assert skip_checksums(parser.parse_args(["--skip-checksums"])) is True
    assert capsys.readouterr().err == ""
    assert skip_checksums(parser.parse_args(["--no-verify"])) is True
    assert "--no-verify is now --skip-checksums" in capsys.readouterr().err
