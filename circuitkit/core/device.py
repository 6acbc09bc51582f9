"""Device selection, free memory, and measured peak memory.

There is no device config key: `get_device()` picks CUDA > MPS > CPU. Set
`CUDA_VISIBLE_DEVICES=""` to force the CPU.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The dtypes a config may name (model.precision, grads.storage_dtype): one map for every user.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def get_device() -> torch.device:
    """The best available device: CUDA, then Apple MPS, then CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _cpu_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device: torch.device | None = None) -> int:
    """Memory a new allocation can use on `device` (default: `get_device()`).

    CUDA: free bytes reported by the driver. MPS: the recommended working set minus what the
    process already holds. CPU: the kernel's MemAvailable.
    """
    device = device or get_device()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return _cpu_available_bytes()


def total_memory_bytes(device: torch.device | None = None) -> int:
    """Total memory of `device` (CPU: physical RAM)."""
    device = device or get_device()
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created while active, and their peak.

    Each storage is counted once, from the op that produced it until it is freed (a weakref
    finalizer on the storage, whose Python object lives as long as the C++ storage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    @staticmethod
    def _storage(t: torch.Tensor):
        if t.device.type != "cpu" or t.is_meta:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = self._storage(t)
        if storage is None:
            return
        key = storage._cdata
        if key in self._live or key in inputs:  # a view or in-place result allocates nothing
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and (storage := self._storage(t)) is not None:
                inputs.add(storage._cdata)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


@dataclass
class PeakMemory:
    """Result of `measure_peak`: bytes at the peak, and how they were measured."""

    peak_bytes: int = 0
    method: str = ""


@contextmanager
def measure_peak(device: torch.device | None = None,
                 resident_bytes: Callable[[], int] = lambda: 0) -> Iterator[PeakMemory]:
    """Measure the peak memory of the enclosed block.

    CUDA: `torch.cuda.max_memory_allocated` after a reset (includes everything resident).
    CPU and MPS: the peak of live tensor bytes created by ops inside the block plus
    `resident_bytes()` read at the end (the model's weights: loading them from safetensors
    does not go through tensor ops), so the figure is comparable to CUDA's.
    """
    device = device or get_device()
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result.peak_bytes = int(torch.cuda.max_memory_allocated(device))
            result.method = "cuda.max_memory_allocated"
        return
    tracker = _LiveTensorBytes()
    try:
        with tracker:
            yield result
    finally:
        result.peak_bytes = int(tracker.peak_bytes + resident_bytes())
        result.method = "live tensor bytes (dispatch tracker) + resident weights"


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
