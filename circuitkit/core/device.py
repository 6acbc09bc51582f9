"""Device selection, free memory, measured peak memory, and whether the device computes bf16.

There is no device config key: `get_device()` picks CUDA > MPS > CPU. Set
`CUDA_VISIBLE_DEVICES=""` to force the CPU.

`bf16_support()` says whether the device computes bfloat16 natively; `resolve_precision()` turns
`model.precision` into the dtype a run uses (`auto`: bfloat16 where native, else float32), and
`model_dtype()` is the one function the loader and every memory estimate read it through. A CPU
without bf16 instructions emulates it: measured 25x slower than float32 for a forward + backward
on an AVX2 EPYC (docs/memory.md).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import platform
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from circuitkit.core.io import atomic_write_json

# The dtypes a config may name (model.precision, grads.storage_dtype): one map for every user.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# model.precision's default: bfloat16 where the device computes it natively, else float32.
PRECISION_AUTO = "auto"


def send(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: through pinned memory to CUDA (a copy
    from pageable memory is staged by the host first); as it is on the CPU; plainly to MPS."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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


# -- bfloat16: native or emulated ----------------------------------------------------------------
# CPU flags (/proc/cpuinfo) of instructions that compute bf16: x86 AVX512-BF16 and AMX-BF16,
# Arm's BF16 extension (its "Features" line names it `bf16`).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# torch CPU capabilities (torch.backends.cpu.get_cpu_capability) below AVX-512: without one of the
# flags above these have no bf16 arithmetic at all, so bf16 is decided "not native" untimed.
CPU_CAPABILITIES_WITHOUT_BF16 = ("NO AVX", "AVX2", "DEFAULT")
# The slowdown quoted where it was decided, not timed: bf16 / float32 wall time of a 4-layer
# GPT-2-width forward + backward on a 2-core AMD EPYC with capability AVX2.
EXPECTED_SLOWDOWN = 25.0
# The timed check: a linear layer (256 x 768) @ (768 x 768)^T in both dtypes, interleaved, the
# fastest of TIMED_REPEATS each. Native bf16 runs it at 0.25-0.4x float32's time (AMX, measured);
# above NATIVE_MAX_SLOWDOWN the device is taken as emulating bf16.
TIMED_SHAPE = (256, 768)
TIMED_REPEATS = 9
NATIVE_MAX_SLOWDOWN = 1.5
BF16_CACHE_VERSION = 1


@dataclass(frozen=True)
class Bf16Support:
    """Whether `device` computes bfloat16 natively, how that was decided, and the measured
    bf16 / float32 time of the timed linear when it was timed (None when decided otherwise)."""

    native: bool
    device: str  # cpu, cuda, mps
    how: str
    slowdown: float | None = None

    def slowdown_text(self) -> str:
        """"measured 1.9x" / "expected about 25x": how much slower bf16 is than float32 here."""
        if self.slowdown is not None:
            return f"measured {self.slowdown:.1f}x slower than float32 (a timed linear layer)"
        return f"expected about {EXPECTED_SLOWDOWN:.0f}x slower than float32 (measured on an AVX2 CPU, docs/memory.md)"


def cache_dir() -> Path:
    """CircuitKit's cache root: ``$CIRCUITKIT_CACHE`` or ``~/.cache/circuitkit`` (the rule of
    `circuitkit.fixtures.cache.cache_root`, which sits above the core)."""
    env = os.environ.get("CIRCUITKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "circuitkit"


def _cpu_flags() -> set[str] | None:
    """The first processor's flags (x86 `flags`, Arm `Features`) from /proc/cpuinfo; None where
    there is no /proc/cpuinfo (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def _cpu_capability() -> str:
    """torch's CPU capability: DEFAULT, VSX, Z VECTOR, NO AVX, AVX2, AVX512 or SVE256 (torch 2.13)."""
    return torch.backends.cpu.get_cpu_capability()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time_bf16_linear() -> float:
    """bf16 / float32 wall time of one linear layer on the CPU (fastest of TIMED_REPEATS each,
    the two dtypes interleaved so that a busy moment slows both)."""
    rows, width = TIMED_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, width, generator=g), torch.randn(width, width, generator=g)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    with torch.no_grad():
        for a, b in pairs.values():  # warm-up: kernels chosen, pages touched
            torch.nn.functional.linear(a, b)
        for _ in range(TIMED_REPEATS):
            for dtype, (a, b) in pairs.items():
                t0 = time.perf_counter()
                torch.nn.functional.linear(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def _bf16_cache_path(capability: str) -> Path:
    """One file per machine (host, CPU, torch capability and version): a shared home directory
    holds one per machine, and a torch upgrade times again."""
    key = json.dumps([BF16_CACHE_VERSION, platform.node(), _cpu_name(), capability, torch.__version__])
    return cache_dir() / "device" / f"bf16_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _timed_cpu_support(capability: str) -> Bf16Support:
    """Decide by the timed linear, read from this machine's cache file or measured and written
    there (atomically: parallel jobs may race, each write is whole)."""
    path = _bf16_cache_path(capability)
    try:
        cached = json.loads(path.read_text())
        return Bf16Support(bool(cached["native"]), "cpu", str(cached["how"]), float(cached["slowdown"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measure again
    slowdown = round(_time_bf16_linear(), 2)
    native = slowdown <= NATIVE_MAX_SLOWDOWN
    support = Bf16Support(native, "cpu", f"timed linear {TIMED_SHAPE[0]}x{TIMED_SHAPE[1]}: bf16 {slowdown:.2f}x"
                          f" float32's time (torch cpu capability {capability}; cached in {path})", slowdown)
    try:
        atomic_write_json(path, asdict(support))
    except OSError:
        pass  # an unwritable cache only costs the timing again next run
    return support


def _cpu_support() -> Bf16Support:
    flags, capability = _cpu_flags(), _cpu_capability()
    native_flags = sorted(set(flags or ()) & set(CPU_BF16_FLAGS))
    if native_flags:
        return Bf16Support(True, "cpu", f"cpu flags {', '.join(native_flags)} (torch cpu capability {capability})")
    if flags is not None and capability in CPU_CAPABILITIES_WITHOUT_BF16:
        return Bf16Support(False, "cpu", f"torch cpu capability {capability}, no avx512_bf16 / amx_bf16 flag")
    return _timed_cpu_support(capability)


def _cuda_support(device: torch.device) -> Bf16Support:
    if torch.version.hip:
        return Bf16Support(True, "cuda", "ROCm device (bf16 on every supported AMD GPU)")
    major, minor = torch.cuda.get_device_capability(device)
    return Bf16Support(major >= 8, "cuda", f"compute capability {major}.{minor}"
                       + ("" if major >= 8 else " (bf16 needs 8.0+)"))


def _mps_support() -> Bf16Support:
    native = torch.backends.mps.is_macos_or_newer(14, 0)
    return Bf16Support(native, "mps", "torch supports bf16 on MPS from macOS 14"
                       + ("" if native else "; this macOS is older"))


@functools.lru_cache(maxsize=8)
def _support_of(device_type: str, index: int | None) -> Bf16Support:
    if device_type == "cuda":
        return _cuda_support(torch.device("cuda", index if index is not None else torch.cuda.current_device()))
    if device_type == "mps":
        return _mps_support()
    return _cpu_support()


def bf16_support(device: torch.device | str | None = None) -> Bf16Support:
    """Does `device` (default: `get_device()`) compute bfloat16 natively? Decided once per process.

    CUDA: compute capability 8.0 or more (ROCm: yes). MPS: what torch supports (macOS 14+).
    CPU: a bf16 flag in /proc/cpuinfo (avx512_bf16, amx_bf16, Arm bf16) is native; torch
    capability AVX2 / NO AVX / DEFAULT without one is not; anything else (AVX-512 without the
    flag, no /proc/cpuinfo) is timed once per machine and cached under `cache_dir()/device`.
    """
    device = torch.device(device) if device is not None else get_device()
    return _support_of(device.type, device.index)


@dataclass(frozen=True)
class Precision:
    """What `model.precision` asked for and the dtype a run uses, with the sentence the manifest records.

    requested: the config's value (auto, bfloat16, float16, float32); used: a DTYPES key;
    support: the device's bf16 support when bf16 was asked for (by default or explicitly), else None.
    """

    requested: str
    used: str
    note: str
    support: Bf16Support | None = None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.used]

    def advice(self) -> str | None:
        """The preflight's one line when bf16 is not native here (None when there is nothing to say)."""
        s = self.support
        if s is None or s.native:
            return None
        if self.requested == PRECISION_AUTO:
            return (f"precision: no native bf16 on {s.device} ({s.how}): bf16 is {s.slowdown_text()}, so this run"
                    " uses float32. Set model.precision=float32 to choose it yourself (model.precision=bfloat16"
                    " keeps bf16).")
        return (f"precision: model.precision=bfloat16 on {s.device} without native bf16 ({s.how}): bf16 is"
                f" {s.slowdown_text()}. Set model.precision=float32 (or auto) unless you need bf16 itself.")

    def record(self) -> dict[str, Any]:
        """The manifest's `precision` entry."""
        out: dict[str, Any] = {"requested": self.requested, "used": self.used, "note": self.note}
        if self.support is not None:
            out["bf16"] = asdict(self.support)
        return out


def resolve_precision(precision: str, device: torch.device | str | None = None) -> Precision:
    """The dtype `model.precision` means on `device` (default `get_device()`): bfloat16, float16
    and float32 mean exactly that; auto means bfloat16 where `bf16_support` says native, else float32."""
    if precision in ("float16", "float32"):
        return Precision(precision, precision, f"{precision} requested, {precision} used")
    if precision not in (PRECISION_AUTO, "bfloat16"):
        raise ValueError(f"model.precision={precision!r}: allowed are {PRECISION_AUTO}, {', '.join(DTYPES)}")
    support = bf16_support(device)
    native = "native" if support.native else "no native"
    if precision == PRECISION_AUTO:
        used = "bfloat16" if support.native else "float32"
        return Precision(precision, used, f"bfloat16 requested by default, {used} used: {native} bf16 on"
                         f" {support.device}", support)
    return Precision(precision, "bfloat16", f"bfloat16 requested explicitly, bfloat16 used: {native} bf16 on"
                     f" {support.device}", support)


def model_dtype(model_cfg: Any, device: torch.device | str | None = None) -> torch.dtype:
    """The dtype the model's weights load in: `resolve_precision(model_cfg.precision, device).dtype`.
    The loader and every memory estimate read it here, so an estimate follows the dtype used."""
    return resolve_precision(model_cfg.precision, device).dtype


def release_memory() -> None:
    """Hand back what a model just dropped held (its accelerator memory) before the next step allocates."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
