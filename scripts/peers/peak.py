"""Peak resident memory of a stretch of work in this process (Linux), for any tool alike.

Peers run in their own virtual environments, where CircuitKit's tensor-level tracker does not
apply (and functorch transforms would bypass it), so every tool — ours included — is measured
the same way: the process's resident-set high-water mark (VmHWM) is reset just before the work
(`/proc/self/clear_refs`, value 5) and read just after; the figure reported is that peak minus
the resident size when the work started (weights, data and imported libraries excluded).
Before that start is read, glibc is asked to hand its free memory back to the system
(`malloc_trim(0)`): otherwise memory freed by earlier work in the process (a warm-up build)
stays resident, counts in the start, and is reused unseen, so that the same work measured
573 to 1338 MiB from one process to the next.
Standard library only, so the peer venvs can import it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def _release_free_memory() -> None:
    """glibc's malloc_trim(0), where the C library has it (elsewhere nothing to do)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@dataclass
class Measure:
    seconds: float = 0.0
    peak_bytes: int = 0  # resident high-water mark above the starting resident size


@contextmanager
def measured() -> Iterator[Measure]:
    """Wall time and peak added resident memory of the block."""
    import gc

    gc.collect()
    _release_free_memory()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    start_rss = _status_kib("VmRSS")
    out = Measure()
    t0 = time.perf_counter()
    yield out
    out.seconds = time.perf_counter() - t0
    out.peak_bytes = max(0, _status_kib("VmHWM") - start_rss) * 1024


def run_measured(fn: Callable[[], object]) -> tuple[object, Measure]:
    with measured() as m:
        result = fn()
    return result, m
