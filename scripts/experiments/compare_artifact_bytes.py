"""Byte comparison of circuit.pt and a gradient index, before and after a refactor.

Runs the pipeline (data, attribution, pruning, grads restricted to the circuit, plus one
unrestricted index) on the fixture models in a fixed directory, then hashes what it wrote:

* circuit.pt: the sha256 of the file, and one sha256 per field (tensors by dtype, shape and
  bytes; plain values as JSON), so a difference names the field;
* each index: the sha256 of every shard, and of manifest.json with its format version left out.

    python scripts/experiments/compare_artifact_bytes.py --save before.json      # on the old code
    python scripts/experiments/compare_artifact_bytes.py --compare before.json   # on the new code

`--compare` lists every hash that differs (format_version and the fields named with
`--ignore` aside) and exits 1 if any does. Same directory both times (`--work`, default
/tmp/ck-artifact-bytes): the config stored in circuit.pt names its paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

FIXTURES = ("tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-qwen2", "tiny-gemma3")
ROWS = [{"prompt": f"When Mary and John went to the store {i},", "completion": " John gave a drink to Mary."}
        for i in range(6)]
# Format versions, and the hash of a whole circuit.pt file (which holds its format version).
VOLATILE = ("format_version", "circuit.sha256")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _value_hash(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        head = f"{t.dtype}{tuple(t.shape)}".encode()
        return _sha(head + t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else head)
    if isinstance(value, dict):
        return _sha(json.dumps({k: _value_hash(v) for k, v in sorted(value.items())}).encode())
    if isinstance(value, list | tuple):
        return _sha(json.dumps([_value_hash(v) for v in value]).encode())
    return _sha(json.dumps(value, sort_keys=True, default=str).encode())


def _circuit_hashes(path: Path) -> dict[str, str]:
    circuit = torch.load(path, weights_only=True, map_location="cpu")
    out = {"file": _sha(path.read_bytes())}
    out.update({f"field:{k}": _value_hash(v) for k, v in sorted(circuit.items())})
    return out


def _index_hashes(index_dir: Path) -> dict[str, str]:
    out = {}
    for path in sorted(index_dir.iterdir()):
        if path.name == "manifest.json":
            manifest = json.loads(path.read_text())
            out["manifest.json"] = _sha(json.dumps(manifest, sort_keys=True).encode())
            for key, value in sorted(manifest.items()):
                if key == "circuit" and isinstance(value, dict):
                    # Its sha256 is circuit.pt's file hash, which holds circuit.pt's format version
                    # (compared field by field above); the rest of the record is compared here.
                    out["manifest:circuit.sha256"] = value.get("sha256", "")
                    value = {k: v for k, v in value.items() if k != "sha256"}
                out[f"manifest:{key}"] = _sha(json.dumps(value, sort_keys=True).encode())
        elif path.suffix == ".safetensors":
            out[path.name] = _sha(path.read_bytes())
    return out


def produce(work: Path) -> dict[str, dict[str, str]]:
    """Run the pipeline on every fixture under `work` and hash what it wrote."""
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    hashes: dict[str, dict[str, str]] = {}
    for fixture in FIXTURES:
        run_dir = work / fixture
        common = [f"model.name=builtin:{fixture}", "model.precision=float32",
                  "discovery.task=induction", "discovery.data_params.num_examples=4",
                  "discovery.data_params.eval_examples=2", "discovery.data_params.seq_len=16",
                  "discovery.ig_steps=2", "grads.projection_dim=16", f"grads.data_path={data}"]
        _, cfg = compose([*common, "stages=[data,attribution,pruning,grads]", "grads.circuit=run"])
        run_pipeline(cfg, run_dir)
        hashes[f"{fixture}/circuit.pt"] = _circuit_hashes(run_dir / "circuit.pt")
        hashes[f"{fixture}/index(circuit)"] = _index_hashes(run_dir / "index")
        _, cfg = compose([*common, "stages=[grads]", f"grads.index_dir={work / fixture / 'index-full'}"])
        run_pipeline(cfg, work / f"{fixture}-full")
        hashes[f"{fixture}/index(full)"] = _index_hashes(work / fixture / "index-full")
    return hashes


def differences(before: dict, after: dict, ignore: tuple[str, ...]) -> list[str]:
    out = []
    skip = {*VOLATILE, *ignore}
    for artifact in sorted(set(before) | set(after)):
        b, a = before.get(artifact, {}), after.get(artifact, {})
        for key in sorted(set(b) | set(a)):
            name = key.split(":", 1)[-1]
            if name in skip or key in ("file", "manifest.json"):
                continue  # whole-file hashes include the format version; the per-field ones decide
            if b.get(key) != a.get(key):
                out.append(f"{artifact} {key}: {'missing' if key not in b else b[key][:12]} ->"
                           f" {'missing' if key not in a else a[key][:12]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ck-artifact-bytes"))
    parser.add_argument("--save", type=Path, help="write the hashes to this JSON file")
    parser.add_argument("--compare", type=Path, help="compare with hashes saved earlier")
    parser.add_argument("--ignore", nargs="*", default=[], help="more fields (circuit.pt or manifest keys) to leave out")
    args = parser.parse_args(argv)
    hashes = produce(args.work)
    if args.save:
        args.save.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        print(f"wrote {sum(len(h) for h in hashes.values())} hashes of {len(hashes)} artifacts to {args.save}")
    if args.compare:
        diff = differences(json.loads(args.compare.read_text()), hashes, tuple(args.ignore))
        for line in diff:
            print(line)
        total = sum(len(h) for h in hashes.values())
        print(f"{len(diff)} of {total} hashes differ (format_version{', ' if args.ignore else ''}"
              f"{', '.join(args.ignore)} aside)")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
