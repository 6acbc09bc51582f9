"""Benchmark: what grads.preconditioner costs at indexing time (none, kfac, module), side by side.

The planted-fact corpus B (scripts/bench/planted_facts_b.py) on the tiny GPT-2 fixture, the MLP's two
linear layers of each block, float16 rows, `--width` per module; each preconditioner builds the
same index in `--rounds` interleaved rounds in one process (the machine is shared: ratios to
`none` in the same round, medians over rounds). Reported: seconds (kfac includes writing
curvature.safetensors, one more pass over the rows) and bytes on disk.

    python scripts/bench/bench_curvature_cost.py [--width 1024] [--entities 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root, for the `scripts.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rich.console import Console  # noqa: E402

from circuitkit.models.config import ModelConfig  # noqa: E402
from circuitkit.models.loading import load_model  # noqa: E402
from gradian.build.indexer import build_index  # noqa: E402
from gradian.index.reader import IndexReader
from gradian.settings.grads import GradsConfig  # noqa: E402
from scripts.bench.planted_facts_b import make_corpus_b  # noqa: E402

KINDS = ("none", "kfac", "module")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--entities", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    corpus = make_corpus_b(args.entities)
    model_cfg = ModelConfig(name="builtin:tiny-gpt2", precision="float32")
    loaded = load_model(model_cfg)
    quiet = Console(stderr=True, quiet=True)
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="curvature_cost_") as tmp:
        docs = Path(tmp) / "docs.jsonl"
        docs.write_text("".join(json.dumps(r) + "\n" for r in corpus.docs))
        for r in range(args.rounds + 1):  # round 0 warms up
            for kind in KINDS:
                grads = GradsConfig(data_path=str(docs), module_filter=["mlp"], projection_dim=args.width,
                                    preconditioner=kind, rows_per_shard=4096)
                index_dir = Path(tmp) / f"{kind}_{r}"
                start = time.perf_counter()
                build_index(model_cfg, grads, index_dir, quiet, loaded=loaded)
                if r:
                    seconds[kind].append(time.perf_counter() - start)
                sizes[kind] = IndexReader(index_dir).summary()["bytes"]
                shutil.rmtree(index_dir)
    n = len(corpus.docs)
    print(f"{n} rows, 4 modules x {args.width}, float16; median of {args.rounds} interleaved rounds")
    for kind in KINDS:
        ratio = statistics.median(a / b for a, b in zip(seconds[kind], seconds["none"], strict=True))
        print(f"{kind:>7}: {statistics.median(seconds[kind]):6.2f} s ({ratio:.2f}x none), {sizes[kind] / 2**20:7.2f} MiB"
              f" ({sizes[kind] / sizes['none']:.2f}x none)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
