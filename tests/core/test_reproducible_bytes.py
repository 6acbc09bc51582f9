"""Reproducible bytes: two identical runs write identical artifacts; safetensors and torch.save bytes do not
depend on metadata order or file name; written files follow the umask.
"""

from __future__ import annotations

import os

import pytest
import torch

from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline
from tests.helpers.refusals import (
    SMALL,
)


def test_two_identical_runs_write_identical_bytes(tmp_path):
    cfg = compose(["stages=[data,attribution,pruning]", *SMALL])[1]
    for name in ("a", "b"):
        run_pipeline(cfg, tmp_path / name)
    for artifact in ("circuit.pt", "data.safetensors", "scores.safetensors"):
        assert (tmp_path / "a" / artifact).read_bytes() == (tmp_path / "b" / artifact).read_bytes(), artifact
    assert torch.load(tmp_path / "a" / "circuit.pt", weights_only=True)["head_mask"].dtype == torch.bool


def test_safetensors_bytes_do_not_depend_on_metadata_order(tmp_path):
    from safetensors import safe_open

    from circuitkit.core.io import atomic_save_safetensors

    t = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    meta = {f"k{i}": str(i) for i in range(20)}
    one = atomic_save_safetensors(tmp_path / "one.safetensors", t, meta)
    two = atomic_save_safetensors(tmp_path / "two.safetensors", dict(reversed(t.items())),
                                  dict(reversed(meta.items())))
    assert one.read_bytes() == two.read_bytes()
    with safe_open(str(one), framework="pt") as fh:
        assert fh.metadata() == meta and torch.equal(fh.get_tensor("b"), t["b"])


def test_torch_save_bytes_do_not_depend_on_the_file_name(tmp_path):
    from circuitkit.core.io import atomic_torch_save

    obj = {"x": torch.arange(4)}
    a, b = atomic_torch_save(tmp_path / "a.pt", obj), atomic_torch_save(tmp_path / "other_name.pt", obj)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    from circuitkit.core.io import atomic_write_json

    old = os.umask(umask)
    try:
        path = atomic_write_json(tmp_path / "m.json", {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
