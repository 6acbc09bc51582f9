"""What a stage's input fingerprint costs on a rerun: content hash vs the size+mtime fast path.

    python scripts/bench/bench_fingerprint.py [--mib 512]

Writes a file of random bytes, then times, back to back in this process, (a) hashing it
(first run, or a file whose mtime moved) and (b) the fast path (size and mtime match the
record, the recorded sha256 is reused), and prints both and their ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from circuitkit.core.fingerprint import Fingerprinter


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the test file (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.bin"
        with open(path, "wb") as fh:
            for _ in range(args.mib):
                fh.write(os.urandom(1 << 20))
        record = Fingerprinter().file(path)
        full = _best_of(lambda: Fingerprinter().file(path), args.repeats)
        fast = _best_of(lambda: Fingerprinter([record]).file(path), args.repeats * 100)
    print(f"file {args.mib} MiB: content hash {full:.3f} s ({args.mib / full:.0f} MiB/s),"
          f" size+mtime fast path {fast * 1e6:.1f} us, ratio {full / fast:.0f}x")


if __name__ == "__main__":
    main()
