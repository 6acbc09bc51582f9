"""The capture hands every consumer the bytes it always did: small fixed-seed indexes on the tiny
fixture model that exercise each consumer of a batch's (input, output-gradient) pairs (the rows,
the K-FAC factor sums of the data's labels and of sampled labels, the sampled-label rows, factored
rows, the factor pass of the whitened, eigen and spectrum projections, the module second moments),
and the sha256 of each shard, curvature.safetensors and the stored projection or widths compared
with values recorded from the code before the capture handed its pairs to consumers.

A change here is a change of the stored values: it needs a new FORMAT_VERSION, not new hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from circuitkit.core.io import sha256_file
from circuitkit_app.config import compose
from gradian.build.indexer import build_index

ROWS = [{"prompt": f"The {s} ", "completion": f"{v} near the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for s in ("cat", "dog", "owl", "fox", "elk")
                                      for v in ("runs", "naps") for p in ("lake", "hill"))]  # 20 rows
COMMON = ("model.precision=float32", "grads.projection_dim=16", "grads.module_filter=[mlp]",
          "grads.rows_per_shard=7", "grads.projection_seed=0", "grads.storage_dtype=float32")
CASES = {
    # rows only, the other loss and reduction
    "rows": ("grads.preconditioner=none", "grads.loss=ce", "grads.loss_reduction=mean"),
    # factor sums of the data's labels beside the rows, and the module second moments
    "kfac_empirical": ("grads.preconditioner=module+kfac",),
    # a second backward of sampled labels: its factor sums and rows, with the activations recomputed
    "kfac_sampled": ("grads.preconditioner=kfac", "grads.fisher=sampled", "grads.activations=recompute"),
    # factored rows of both backwards
    "factored_sampled": ("grads.preconditioner=kfac", "grads.fisher=sampled", "grads.row_format=factored",
                         "grads.row_rank=2"),
    # the raw factor pass of sampled labels (projection.safetensors), then the rows
    "whitened_sampled": ("grads.projection=whitened", "grads.preconditioner=kfac", "grads.fisher=sampled"),
    # the projected factor pass
    "eigen": ("grads.projection=eigen", "grads.preconditioner=kfac"),
    # the raw factor pass of the width allocation
    "spectrum": ("grads.width_allocation=spectrum", "grads.preconditioner=none"),
}
# sha256 of each file the index holds besides manifest.json (whose header records the software).
SHA256: dict[str, dict[str, str]] = {
    "rows": {
        "shard-00000.safetensors": "6174ee14473a610ca3d96ef8c03cd67e4f8ea2ecf88d4dc5529da5ca9cb09668",
        "shard-00001.safetensors": "fa48c51615968e190e3836a6b90ee9af7361c02ef39af0c050aba0834768a787",
        "shard-00002.safetensors": "7c358c4a2d245eeaf208c9fb449725f1f7dd14b93d0dcaf37d79c81785315793",
    },
    "kfac_empirical": {
        "curvature.safetensors": "ccfe694094886a24c80e1e11a857cd7ccc8dbad10c8e140d3aaf0dce60583f23",
        "shard-00000.safetensors": "d53c195153a0587bab6605a866a95e40adf3a24a692e11550c5fedc006a673fc",
        "shard-00001.safetensors": "e76cc1214c1945edbe5e3937dde299c112858d488db236a9c656a1a358ff6ecf",
        "shard-00002.safetensors": "402045f8a08e27643dbc3a73d0e69cddf88221d0c76e086c308aa572d15962fa",
    },
    "kfac_sampled": {
        "curvature.safetensors": "d974b78abe6acef9b8102c26c07fe2e92ef7bf3abf3a3315ee38a028bc49c4c1",
        "shard-00000.safetensors": "6e705314e9811bb2edbc3a1cac1f4f89d3b4b68be101fa6979ba118025d11cf3",
        "shard-00001.safetensors": "c3f4da10287d948f43808df74a33f5613a4bae04c3d404e3cbcfa872439e7f53",
        "shard-00002.safetensors": "245b31b57b2cb06e420ede68997f65a2b365327f2116f4140028e9972a2f81da",
    },
    "factored_sampled": {
        "curvature.safetensors": "bc0e21aaa35d7eb22424e0bebe467926b19681d0cb19320014d4ecd2089f44fb",
        "shard-00000.safetensors": "48a465cb33ed700b43713a7b9261f91882f79f058af9c2d07a02165ad469b921",
        "shard-00001.safetensors": "dee4c79daf993e66a001a69c83a7511a3ca8fccc618fc16287446f1bf444b312",
        "shard-00002.safetensors": "a89cf25524a558f386bb56205fc9332605fc485d445197c9cae279084203c987",
    },
    "whitened_sampled": {
        "curvature.safetensors": "9d63b628b3dd03506c9815a7f00a4e5d95183d7526eed0dca5dea73f01891ff5",
        "projection.safetensors": "b216fe8eff6c1b0c43f2f0d86fac706b0ecdb539fb5f099e0160d9fee7da94f1",
        "shard-00000.safetensors": "8e118df00ac6e6790a352cd82c5ada5d8b41cdfa1c87b81b1cd130e2a9ad0a1c",
        "shard-00001.safetensors": "1ec0704d1c621c446455d0a4aa174bb6fe5a86a0f08666c99f8273388fe8b96b",
        "shard-00002.safetensors": "9508cf0a6ec08d3fec3f76358b489915bcfae09d97b201d754fe8a4b5a84268d",
    },
    "eigen": {
        "curvature.safetensors": "b7e59a08cea2de770dad721427cc7802cd2fe7d4cd8673db8a73457825bad060",
        "projection.safetensors": "a9768d8fa63218b231f03471e483f46571f921c83f6920777838e7424a474e68",
        "shard-00000.safetensors": "f4bb1beffd9e63c6104372745fcf363b300bafb0cc4f9df92bdfb5dd17e1202d",
        "shard-00001.safetensors": "8f778b7d1cf92f6236c6916f7be2f2d9f94be442aa53e4d69c20dae1ddda9191",
        "shard-00002.safetensors": "0edd0c0346555d7c29bbe93eda5588047f42ce58d94f61d6421412e005ce216a",
    },
    "spectrum": {
        "allocation.json": "9ed8a8378bff06bfe257730f5e12ced1b4a858f126bc81249a75b8678fa55e77",
        "shard-00000.safetensors": "aec6adec5bd2bd6b72492c420a6b7f768c6aa22a7b5249aba59e7658852dc7dd",
        "shard-00001.safetensors": "0fc77b61bf347148e8fb338de1a845f0e40d9dbcd8a8f942322f7297959bc93b",
        "shard-00002.safetensors": "b4f3ec5898732f6cd17a4702017301c6df9b8fce9ae34e5b860afaa30a0e780c",
    },
}
SHARED_FILES = ("projection.safetensors", "allocation.json")


def build(root: Path, name: str) -> Path:
    """The index of case `name`, built under `root` (the data file written once)."""
    data = root / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _, cfg = compose([*COMMON, f"grads.data_path={data}", *CASES[name]])
    build_index(cfg.model, cfg.grads, root / name)
    return root / name


def values_sha256(path: Path) -> str:
    """sha256 of what the factor pass decided in a shared file, without the settings it records (they
    name the data file's path): the tensors of projection.safetensors, the widths of allocation.json."""
    digest = hashlib.sha256()
    if path.suffix == ".json":
        values = {k: v for k, v in json.loads(path.read_text()).items() if k != "settings"}
        digest.update(json.dumps(values, sort_keys=True).encode())
    else:
        for name, tensor in sorted(load_file(str(path)).items()):
            digest.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def file_hashes(index_dir: Path) -> dict[str, str]:
    """name -> sha256 of every file of the index but the manifest (the shared files' values only)."""
    return {p.name: values_sha256(p) if p.name in SHARED_FILES else sha256_file(p) for p in sorted(index_dir.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"}


@pytest.mark.parametrize("name", list(CASES))
def test_an_index_is_byte_identical_to_the_recorded_one(tmp_path, name: str) -> None:
    got = file_hashes(build(tmp_path, name))
    assert got == SHA256[name]
