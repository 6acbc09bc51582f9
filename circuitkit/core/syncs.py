"""Count the calls that make the host wait for an accelerator, on any device (the CPU included).

On CUDA a kernel launch returns at once; the host waits only when it needs a value the device
computes: a Python scalar (`.item()`, `int(t)`, `if t.any():`), a copy to host memory (`.cpu()`,
`.numpy()`, `.tolist()`), or an op whose output size depends on the data (`nonzero`, boolean
masking, `unique`, `bincount`, `repeat_interleave` with a tensor). A hot loop that does one of
these per module or per layer runs at the speed of Python, not of the device. On the CPU the
same calls cost nothing, so they cannot be timed here; they can be counted:

    with BlockingCalls() as calls:
        run_one_batch()
    calls.total, calls.by_name     # e.g. 1, {"Tensor.cpu": 1}

Counted: the profiler's ATen events in `BLOCKING_OPS` (`.item()`, `bool(t)` and `int(t)` all reach
`aten::_local_scalar_dense`) and the Python methods in `BLOCKING_METHODS`, patched for the
duration. Tests hold the hot paths to a small budget per batch (tests/gradian/build/test_blocking_calls.py);
`scripts/bench/bench_gpu.py` reports the same count next to `torch.cuda.set_sync_debug_mode`.
"""

from __future__ import annotations

import collections
import functools
import threading

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# ATen ops whose result the host must wait for (data-dependent sizes or a scalar read).
BLOCKING_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
                          "aten::masked_select", "aten::bincount", "aten::nonzero_static"})
# Tensor methods that copy to host memory (`.item()` is counted through its ATen op instead).
BLOCKING_METHODS = ("cpu", "numpy", "tolist")


class BlockingCalls:
    """A context manager counting blocking calls made inside it (module docstring), by the thread that
    entered it (a background writer's host work is not the loop's).

    `by_name`: name -> count ("aten::nonzero", "Tensor.cpu", ...); `total`: their sum. Not
    re-entrant; one at a time per process (it patches `torch.Tensor`)."""

    def __init__(self) -> None:
        self.by_name: collections.Counter[str] = collections.Counter()
        self._profile = None
        self._saved: dict[str, object] = {}
        self._thread = threading.get_ident()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def _patch(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        self._saved[name] = original
        counter, thread = self.by_name, self._thread

        @functools.wraps(original)
        def counted(tensor, *args, **kwargs):
            if threading.get_ident() == thread:
                counter[f"Tensor.{name}"] += 1
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    def __enter__(self) -> BlockingCalls:
        self._thread = threading.get_ident()
        for name in BLOCKING_METHODS:
            self._patch(name)
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        with record_function("BlockingCalls"):  # marks the entering thread among the profiled ones
            pass
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._profile.__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()
        threads = {event.thread for event in self._profile.events() if event.name == "BlockingCalls"}
        for event in self._profile.events():
            if event.name in BLOCKING_OPS and (not threads or event.thread in threads):
                self.by_name[event.name] += 1

    def __repr__(self) -> str:
        return f"BlockingCalls({self.total}: {dict(self.by_name)})"


def all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor, whether every element is finite; one host wait per device the tensors are on
    (the flags are stacked where they were computed), not one per tensor."""
    flags: list[bool | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(tensors):
        by_device[t.device].append(i)
    for idx in by_device.values():
        # a sum is non-finite exactly when an element is (inf + finite = inf, inf - inf = NaN, NaN spreads;
        # real weights cannot overflow float32's range, which bfloat16 shares; float16's they can, so its sum
        # is float32) and, unlike isfinite(t).all(), needs no copy of the tensor (Gemma 3's embedding: 671 MB)
        stacked = torch.stack([torch.isfinite(tensors[i].sum(dtype=torch.float32) if tensors[i].dtype == torch.float16
                                              else tensors[i].sum()) for i in idx]).tolist()
        for i, ok in zip(idx, stacked, strict=True):
            flags[i] = bool(ok)
    return [bool(f) for f in flags]
