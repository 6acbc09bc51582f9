"""Sharded attribution: N shards merged equal one job over all examples; refusals; resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from circuitkit.core.config import ConfigError
from circuitkit.core.pipeline import PipelineError, load_manifest
from circuitkit.discovery.attribution import load_scores
from circuitkit.discovery.attribution.shards import shard_range
from circuitkit.discovery.circuit import load_circuit
from circuitkit_app.cli import main as cli_main
from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline

# 11 attribution examples over 4 shards: ranges of 2, 3, 3, 3 examples, batches of 2 (so the
# shards' batches differ from the single job's and the float sums are added in another order).
COMMON = ["stages=[data,attribution,pruning]", "model.precision=float32", "discovery.data_params.num_examples=11",
          "discovery.data_params.eval_examples=4", "discovery.data_params.seq_len=32", "discovery.level=edge",
          "discovery.ig_steps=2", "discovery.batch_size=2", "pruning.graph=false"]


def _cfg(*overrides):
    return compose([*COMMON, *overrides])[1]


def _shard(tmp_path, i, n=4, *extra):
    return run_pipeline(_cfg(f"discovery.num_shards={n}", f"discovery.shard_index={i}", *extra),
                        tmp_path / "sweep" / str(i))


def _assert_close(single, merged):
    """Equal up to float32 addition order. Measured (4 shards, edge level): largest difference
    2e-6 of the largest score (the embedding node's score, a sum with cancellation), 0 for most."""
    for name in ("head", "mlp", "embed", "edges"):
        a, b = getattr(single, name), getattr(merged, name)
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        scale = a.abs().max()
        print(f"{name}: max abs diff {(a - b).abs().max().item():.3g}, relative {((a - b).abs().max() / scale).item():.3g}")
        assert (a - b).abs().max() <= 2e-5 * scale, (name, (a - b).abs().max().item(), scale.item())
    assert merged.n_examples == single.n_examples == 11
    assert merged.metric_clean == pytest.approx(single.metric_clean, rel=1e-6)


def _assert_files_equal(single_path, merged_path, per_example=("head", "edges")):
    """Every tensor and metadata key of one job's scores.safetensors is in the merged one, equal
    to float32 round-off. Measured (tiny GPT-2, 11 examples, 4 shards and 2 shards, batches of 2,
    so the shard boundaries move the batches): `per_example_head` bitwise equal (each row is one
    example's own contraction); `per_example_edges` 2.3e-10 of 1.2e-3 (1.9e-7 relative: a matmul
    over a batch of other rows adds in another order); the means as in _assert_close (the sums
    of the shards are added in another order, up to 2.2e-6 relative for the embedding node)."""
    from safetensors import safe_open

    with safe_open(str(single_path), "pt") as a, safe_open(str(merged_path), "pt") as b:
        assert set(a.keys()) == set(b.keys()), (sorted(a.keys()), sorted(b.keys()))
        assert {f"per_example_{k}" for k in per_example} <= set(a.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.shape == y.shape and x.dtype == y.dtype == torch.float32, key
            scale = x.abs().max()
            print(f"{key}: max abs diff {(x - y).abs().max().item():.3g} of {scale.item():.3g}")
            assert (x - y).abs().max() <= 2e-5 * scale, (key, (x - y).abs().max().item(), scale.item())
        meta_a, meta_b = a.metadata(), b.metadata()
    assert set(meta_a) == set(meta_b)
    for key in meta_a:
        if key.startswith("metric_"):
            assert float(meta_a[key]) == pytest.approx(float(meta_b[key]), rel=1e-6), key
        else:
            assert meta_a[key] == meta_b[key], key


def test_shard_ranges_are_contiguous_and_cover_the_examples():
    assert [shard_range(11, 4, i) for i in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 11)]
    for n, k in [(1, 1), (7, 7), (100, 3), (10_000, 16)]:
        ranges = [shard_range(n, k, i) for i in range(k)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_shard_keys_are_checked():
    with pytest.raises(ConfigError, match="discovery.shard_index' = 4 must be < discovery.num_shards = 4"):
        _cfg("discovery.num_shards=4", "discovery.shard_index=4")
    with pytest.raises(ConfigError, match="discovery.num_shards' = 12 exceeds"):
        _cfg("discovery.num_shards=12")


def test_four_shards_merge_to_the_single_job_and_the_last_prunes(tmp_path):
    run_pipeline(_cfg(), tmp_path / "single")
    single = load_scores(tmp_path / "single" / "scores.safetensors")
    for i in (3, 0, 2):  # any order; the last to finish merges
        manifest = _shard(tmp_path, i)
        assert manifest["stages"]["attribution"]["summary"]["merged"] is False
        assert manifest["stages"]["pruning"]["status"] == "skipped"
        assert not (tmp_path / "sweep" / str(i) / "scores.safetensors").exists()
    manifest = _shard(tmp_path, 1)
    summary = manifest["stages"]["attribution"]["summary"]
    assert summary["merged"] is True and summary["example_range"] == [2, 5]
    assert [s["shard_index"] for s in summary["shards"]] == [0, 1, 2, 3]
    assert [s["example_range"] for s in summary["shards"]] == [[0, 2], [2, 5], [5, 8], [8, 11]]
    assert manifest["stages"]["pruning"]["status"] == "ok"
    merged = load_scores(tmp_path / "sweep" / "1" / "scores.safetensors")
    _assert_close(single, merged)
    _assert_files_equal(tmp_path / "single" / "scores.safetensors", tmp_path / "sweep" / "1" / "scores.safetensors")
    assert merged.per_example["head"].shape == (11, 2, 4) and merged.per_example["edges"].shape[0] == 11
    shared = load_scores(tmp_path / "sweep" / "attribution_shards" / "scores.safetensors")
    assert torch.equal(shared.edges, merged.edges)
    record = json.loads((tmp_path / "sweep" / "attribution_shards" / "merge.json").read_text())
    assert record["n_examples"] == 11 and record["merged_by"] == str((tmp_path / "sweep" / "1").resolve())
    # pruning ran on the merged scores: the same heads as the single job
    a, b = load_circuit(tmp_path / "single" / "circuit.pt"), load_circuit(tmp_path / "sweep" / "1" / "circuit.pt")
    assert torch.equal(a["head_mask"], b["head_mask"])


def test_merge_command_refuses_shards_of_another_config(tmp_path, capsys):
    for i in (0, 1):
        _shard(tmp_path, i, 3)
    with pytest.raises(PipelineError, match="config key 'discovery.ig_steps' differs"):
        _shard(tmp_path, 2, 3, "discovery.ig_steps=3")  # the last one: the automatic merge is refused
    manifest = load_manifest(tmp_path / "sweep" / "2")
    assert manifest["stages"]["attribution"]["status"] == "failed"
    assert "config key 'discovery.ig_steps' differs (2 vs 3)" in manifest["stages"]["attribution"]["error"]
    code = cli_main(["merge", *(str(tmp_path / "sweep" / str(i)) for i in range(3)), "--out", str(tmp_path / "m")])
    assert code == 1
    assert "discovery.ig_steps' differs" in capsys.readouterr().err
    code = cli_main(["merge", str(tmp_path / "sweep" / "0"), "--out", str(tmp_path / "m")])
    assert code != 0 and "shard(s) [1, 2] missing" in capsys.readouterr().err


def test_merge_command_merges_and_prunes(tmp_path):
    run_pipeline(_cfg(), tmp_path / "single")
    for i in range(2):
        _shard(tmp_path, i, 2, f"discovery.shard_dir={tmp_path / f'apart{i}'}")  # never meet: no automatic merge
    assert not (tmp_path / "sweep" / "1" / "scores.safetensors").exists()
    assert cli_main(["merge", str(tmp_path / "sweep" / "1"), str(tmp_path / "sweep" / "0"),
                     "--out", str(tmp_path / "merged")]) == 0
    _assert_close(load_scores(tmp_path / "single" / "scores.safetensors"),
                  load_scores(tmp_path / "merged" / "scores.safetensors"))
    _assert_files_equal(tmp_path / "single" / "scores.safetensors", tmp_path / "merged" / "scores.safetensors")
    manifest = load_manifest(tmp_path / "merged")
    assert [s["shard_index"] for s in manifest["attribution_shards"]] == [0, 1]
    assert manifest["stages"]["pruning"]["status"] == "ok" and (tmp_path / "merged" / "circuit.pt").is_file()


def test_a_killed_shard_reruns_alone(tmp_path, monkeypatch):
    import circuitkit.discovery.attribution as attribution

    for i in (0, 2):
        _shard(tmp_path, i, 3)
    real = attribution.run_attribution

    def killed(*args, **kwargs):
        raise RuntimeError("killed")
    monkeypatch.setattr(attribution, "run_attribution", killed)
    with pytest.raises(PipelineError, match="killed"):
        _shard(tmp_path, 1, 3)
    monkeypatch.setattr(attribution, "run_attribution", real)
    before = {i: load_manifest(tmp_path / "sweep" / str(i)) for i in (0, 2)}
    manifest = _shard(tmp_path, 1, 3)
    assert manifest["stages"]["data"].get("skipped_on_rerun") is True  # only the attribution reran
    assert manifest["stages"]["attribution"]["summary"]["merged"] is True
    assert {i: load_manifest(tmp_path / "sweep" / str(i)) for i in (0, 2)} == before  # the others untouched
    # a rerun of a finished shard does nothing
    again = _shard(tmp_path, 0, 3)
    assert again["stages"]["attribution"].get("skipped_on_rerun") is True


def test_three_joblib_workers_merge_to_one_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    env = {**os.environ, "COLUMNS": "160", "OMP_NUM_THREADS": "1"}

    def run(*args):
        flags = [a for a in args if a == "-m"]  # Hydra's flags come before the overrides
        overrides = [a for a in args if a != "-m"]
        proc = subprocess.run([sys.executable, "-m", "circuitkit.run", *flags, *COMMON, *overrides], capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run_pipeline(_cfg(), tmp_path / "single")
    run("-m", "hydra/launcher=local", "hydra.launcher.n_jobs=3", "discovery.num_shards=3",
        "discovery.shard_index=range(3)", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    record = json.loads((tmp_path / "sweep" / "attribution_shards" / "merge.json").read_text())
    assert [s["shard_index"] for s in record["shards"]] == [0, 1, 2]
    merged = load_scores(tmp_path / "sweep" / "attribution_shards" / "scores.safetensors")
    _assert_close(load_scores(tmp_path / "single" / "scores.safetensors"), merged)
    pruned = [d for d in (tmp_path / "sweep").iterdir() if (d / "circuit.pt").is_file()]
    assert len(pruned) == 1  # exactly one job merged and pruned


def test_discover_circuit_on_shards_names_the_pending_ones_then_returns_the_circuit(tmp_path):
    from circuitkit import discover_circuit

    base = {"stages": ["data", "attribution", "pruning"], "model": {"precision": "float32"},
            "discovery": {"level": "node", "ig_steps": 2, "batch_size": 2, "num_shards": 2,
                          "data_params": {"num_examples": 6, "eval_examples": 2, "seq_len": 16}},
            "pruning": {"graph": False, "random_baselines": 0}, "output_path": str(tmp_path / "circuit.pt")}
    first = {**base, "discovery": {**base["discovery"], "shard_index": 0}}
    with pytest.raises(ValueError, match="attribution shard 0 of 2 finished, but other shards were still running"):
        discover_circuit(first, run_dir=tmp_path / "sweep" / "0")
    last = {**base, "discovery": {**base["discovery"], "shard_index": 1}}
    circuit = discover_circuit(last, run_dir=tmp_path / "sweep" / "1")
    assert (tmp_path / "circuit.pt").is_file() and circuit["metrics"]["faithfulness"] is not None


def test_per_example_rows_are_in_data_order_whatever_the_batching():
    """Pairs of different lengths are batched by length; the rows still follow the examples, so
    the rows of shards (contiguous example ranges) concatenate to one job's."""
    from circuitkit.discovery.attribution import attribute, run_attribution
    from circuitkit.discovery.config import DiscoveryConfig
    from tests.discovery.attribution.test_task_lengths import _lm, _pairs

    data = _pairs(9, seed=2)
    assert data.lengths() != sorted(data.lengths(), reverse=True)  # batching by length reorders them
    cfg = DiscoveryConfig(level="node", ig_steps=2, batch_size=4)
    got = run_attribution(_lm().adapter, data, cfg, progress=False).per_example["head"]
    one_by_one = attribute(_lm().adapter, data, "eap-ig", "node", ig_steps=2, batch_size=1, progress=False,
                           group_by_length=False, per_example=True).per_example["head"]
    assert torch.allclose(got, one_by_one, rtol=1e-4, atol=1e-6)
    shards = [run_attribution(_lm().adapter, data[a:b], cfg, progress=False, sums=True).per_example["head"]
              for a, b in (shard_range(9, 2, 0), shard_range(9, 2, 1))]
    assert torch.allclose(torch.cat(shards), got, rtol=1e-4, atol=1e-6)


def test_bootstrap_selection_and_stability_on_merged_shards(tmp_path):
    node = ["discovery.level=node", "pruning.selection=bootstrap", "pruning.bootstrap_resamples=50"]
    single = run_pipeline(_cfg(*node), tmp_path / "single")
    for i in (0, 1):
        manifest = _shard(tmp_path, i, 2, *node)
    _assert_files_equal(tmp_path / "single" / "scores.safetensors", tmp_path / "sweep" / "1" / "scores.safetensors",
                        per_example=("head",))
    a, b = load_circuit(tmp_path / "single" / "circuit.pt"), load_circuit(tmp_path / "sweep" / "1" / "circuit.pt")
    assert a["selection"] == b["selection"] == "bootstrap"
    assert torch.equal(a["head_mask"], b["head_mask"])
    assert b["stability"] is not None and b["stability"]["n_examples"] == 11 and b["stability"]["n_resamples"] == 50
    assert b["stability"]["jaccard_mean"] == pytest.approx(a["stability"]["jaccard_mean"], abs=1e-9)
    summary = manifest["stages"]["pruning"]["summary"]
    assert summary["selection"] == "bootstrap"
    assert summary["stability_jaccard_mean"] == single["stages"]["pruning"]["summary"]["stability_jaccard_mean"]
    record = json.loads((tmp_path / "sweep" / "attribution_shards" / "merge.json").read_text())
    assert record["per_example"] == ["head"] and "per_example_missing" not in record


def _as_written_before(run_dir):
    """Rewrite a shard file as CircuitKit wrote it before shards kept per-example rows (and
    record its new checksum, as that version did)."""
    from safetensors import safe_open

    from circuitkit.core.io import atomic_save_safetensors, atomic_write_json, sha256_file
    from circuitkit.core.pipeline import MANIFEST
    from circuitkit.discovery.attribution.shards import PARTIAL_FILE, SHARD_SHA_KEY

    path = run_dir / PARTIAL_FILE
    with safe_open(str(path), "pt") as fh:
        meta = {k: v for k, v in fh.metadata().items() if k != "per_example"}
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if not k.startswith("per_example_")}
    atomic_save_safetensors(path, tensors, meta)
    manifest = load_manifest(run_dir)
    manifest["stages"]["attribution"][SHARD_SHA_KEY] = sha256_file(path)
    atomic_write_json(run_dir / MANIFEST, manifest)


def test_old_shard_files_merge_as_before_and_say_what_they_lack(tmp_path, capsys):
    from safetensors import safe_open

    node = ["discovery.level=node"]
    for i in (0, 1):
        _shard(tmp_path, i, 2, *node, f"discovery.shard_dir={tmp_path / f'apart{i}'}")
    dirs = [str(tmp_path / "sweep" / str(i)) for i in (0, 1)]
    assert cli_main(["merge", *dirs, "--out", str(tmp_path / "new"), "--no-prune"]) == 0
    _as_written_before(tmp_path / "sweep" / "0")
    capsys.readouterr()
    assert cli_main(["merge", *dirs, "--out", str(tmp_path / "old"), "--no-prune"]) == 0
    out = capsys.readouterr().err  # the console of the pipeline is stderr
    assert "shard(s) [0] hold no per-example scores" in " ".join(out.split())
    assert "need shards written by this version" in " ".join(out.split())
    with safe_open(str(tmp_path / "old" / "scores.safetensors"), "pt") as old, \
            safe_open(str(tmp_path / "new" / "scores.safetensors"), "pt") as new:
        assert set(old.keys()) == {"head_scores", "mlp_scores", "embed_score"}  # what a merge gave before
        assert set(new.keys()) == set(old.keys()) | {"per_example_head"}
        for key in old.keys():
            assert torch.equal(old.get_tensor(key), new.get_tensor(key))
    record = json.loads((tmp_path / "old" / "merge.json").read_text())
    assert record["per_example"] == [] and "rerun shard(s) [0]" in record["per_example_missing"]
