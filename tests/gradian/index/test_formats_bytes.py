"""Every row format writes the bytes it always wrote: a small fixed-seed index per format (dense in
float16; factored with K-FAC factors, so its curvature rotates factors; signs) and a dense float32 one
with the K-FAC preconditioner, built on the tiny fixture model, and the sha256 of each shard file and
of curvature.safetensors compared with values recorded from the code before the row formats were one
interface (commit ae755b2 and the commit that reorganised gradian/ into rooms gave the same bytes).

A change here is a change of the index format: it needs a new FORMAT_VERSION, not new hashes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from circuitkit.core.io import sha256_file
from circuitkit_app.config import compose
from gradian.build.indexer import build_index

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows
COMMON = ("model.precision=float32", "grads.projection_dim=64", "grads.module_filter=[mlp]",
          "grads.rows_per_shard=7", "grads.projection_seed=0")
CASES = {
    "dense": ("grads.storage_dtype=float16", "grads.preconditioner=none"),
    "factored": ("grads.storage_dtype=float32", "grads.row_format=factored", "grads.row_rank=2",
                 "grads.preconditioner=kfac"),
    "signs": ("grads.row_format=signs", "grads.preconditioner=none"),
    "kfac": ("grads.storage_dtype=float32", "grads.preconditioner=kfac"),
}
# sha256 of each file the index holds besides manifest.json (whose header records the software).
SHA256: dict[str, dict[str, str]] = {
    "dense": {
        "shard-00000.safetensors": "347fb2bcdeed5c61de5f1b1809196e83d9ff3876467507916b1a234e1e0eb725",
        "shard-00001.safetensors": "26fe19a29532f76323a184243968d34cdce43edcc029097f8a1e62e0084ae271",
        "shard-00002.safetensors": "00ea0c676dfb76455ac6db38df1581e58507d14730941e6e37ad0ea12e2b04d1",
    },
    "factored": {
        "curvature.safetensors": "e8c193f4bf7a8803e66174afbc5ea57b7263bc74e50b92f17eecb3ea3f4fc794",
        "shard-00000.safetensors": "a69e794b959d8a4df0ec96dae2b952149b835ad976dead5efdfffe3dc34bed48",
        "shard-00001.safetensors": "eb8989f503924e67cc6a501a9e18d3f13bd7576c35f047d099a1dce3c73de347",
        "shard-00002.safetensors": "fdbc9089d051e33f3b1406eee7ede1675065b4f420c2b891a04e5ea567753b0f",
    },
    "signs": {
        "shard-00000.safetensors": "54cdb4943caa753e8ab07788f96e163eee8ccce94b5a3f626a93bdb444f6e50f",
        "shard-00001.safetensors": "c1eac999420003c1c4d557fe77ebe8a523910f9bef003a71955c968030c73729",
        "shard-00002.safetensors": "bad2d0904cbb339d7a26907280bf8390dd26abecf2edd0e3421d003e878f17c9",
    },
    "kfac": {
        "curvature.safetensors": "7d3043609473c3043e521ecbb5905525229665f5340d2233b2631d4685572db8",
        "shard-00000.safetensors": "fd7346204c6534fbefb00567ee3147ab55c6cd1fe16ed8b589fc8e7f6dd37054",
        "shard-00001.safetensors": "eb38a787bea4bbf9a259ceacebc1048d9856e64638e085c4eaaf35d8015b0199",
        "shard-00002.safetensors": "9bf00fbcfbc1f19b7ad8f66e7d5d8525c5464f86e70b44c811803e96413d9de6",
    },
}


def build(root: Path, name: str) -> Path:
    """The index of case `name`, built under `root` (the data file written once)."""
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose([*COMMON, f"grads.data_path={data}", *CASES[name]])
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


def file_hashes(index_dir: Path) -> dict[str, str]:
    """name -> sha256 of every file of the index but the manifest."""
    return {p.name: sha256_file(p) for p in sorted(index_dir.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"}


@pytest.mark.parametrize("name", list(CASES))
def test_an_index_is_byte_identical_to_the_recorded_one(tmp_path, name: str) -> None:
    got = file_hashes(build(tmp_path, name))
    assert got == SHA256[name]

