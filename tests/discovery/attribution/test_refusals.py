"""Attribution shards are verified when merged: a shard changed in the shard dir before the last one
finishes is refused; verified shards merge to the mean.
"""

from __future__ import annotations

import pytest
import torch

from circuitkit.discovery.attribution.shards import (
    PARTIAL_FILE,
    ShardMergeError,
    publish_and_try_merge,
    shard_file_name,
)
from tests.helpers.artifacts import (
    MERGE,
    TINY,
    _change_a_value,
    _scores,
    _shard_run,
    _shards,
)
from tests.helpers.refusals import (  # noqa: F401  (autouse: hub state and loggers reset per test)
    LISA,
    LONG_PROMPT,
    MARY,
    SMALL,
    Case,
    _cache,
    _hub_state,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _loggers_on_this_tests_stderr,
    _model_copy,
    _one_error,
    _pair,
    _r,
    _raiser,
    _replace_stage,
    _saved_circuit,
    _snapshot,
    _tiny,
    _truncate,
    _write,
    error_lines,
    invoke,
)


def test_a_shard_changed_in_the_shard_dir_before_the_last_finishes_is_refused(tmp_path):
    shard_dir = tmp_path / "attribution_shards"
    for i in (0, 1):
        _shard_run(tmp_path, i)
    merged, _, missing = publish_and_try_merge(tmp_path / "shard0" / PARTIAL_FILE, shard_dir, 0, 2,
                                               tmp_path / "shard0")
    assert merged is None and missing == [1]
    _change_a_value(shard_dir / shard_file_name(0, 2))  # while shard 1 still runs
    with pytest.raises(ShardMergeError, match=r"shard-00000-of-00002.safetensors does not have the sha256 its run"
                                              r" recorded in .*shard0/manifest.json"):
        publish_and_try_merge(tmp_path / "shard1" / PARTIAL_FILE, shard_dir, 1, 2, tmp_path / "shard1")
    assert not (shard_dir / "merge.json").exists()


def test_verified_shards_merge_to_the_mean(tmp_path, capsys):
    _shards(tmp_path)
    code, _, err = invoke("cli", MERGE(tmp_path), capsys)
    assert code == 0, err
    from circuitkit.discovery.attribution import load_scores

    merged = load_scores(tmp_path / "merged" / "scores.safetensors")
    want = (_scores(TINY, seed=0).head + _scores(TINY, seed=1).head) / 6  # sums of 3 + 3 examples
    assert torch.allclose(merged.head, want) and merged.n_examples == 6
