"""`gradian doctor`: an environment report to check a setup and to paste into an issue.

    gradian doctor           Markdown (header with the date, then one table per section)
    gradian doctor --json    the same report as JSON

Sections (keys of `collect()`):

* ``versions``: installed torch, transformers, hydra-core, omegaconf, safetensors, rich and numpy
  against the window the installed ``circuitkit`` distribution declares (status ``ok``,
  ``outside the window`` or ``not installed``);
* ``system``: Python, platform, CPU count, torch threads;
* ``devices``: the CPU (total / available memory), each CUDA device (name, total, free) or why
  CUDA is unavailable, and MPS (or why not);
* ``determinism``: deterministic algorithms, cuDNN flags, CUBLAS_WORKSPACE_CONFIG, PYTHONHASHSEED,
  thread environment variables and where the pipeline's seed comes from;
* ``backends``: CUDA, MPS, CPU, bf16 (it computes correctly), bf16 native (the device computes it
  natively, so `model.precision=auto` runs in bfloat16; how that was decided and, timed, the
  measured slowdown), SDPA, flash attention, safetensors mmap, each
  ``{"available": bool, "reason": str, "detail": str}`` with a non-empty reason when unavailable;
* ``self_tests``: projection round trip, dtype round-trip error and per-example gradient batch
  invariance on a tiny random GPT-2, each with ``passed`` and the measured ``value``.

Nothing is downloaded: the self-test model is built in memory from a config. Every probe is
guarded, so a broken backend shows up as a reason in the report instead of a crash. The heavy
imports (torch, transformers) happen inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as ilm
import json
import os
import platform
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from circuitkit.core import DISTRIBUTION as PROJECT

PACKAGES = ("torch", "transformers", "hydra-core", "omegaconf", "safetensors", "rich", "numpy")
SEED_NOTE = "seed: from config key `seed` (default 0); projection matrices from `grads.projection_seed` (default 0)"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
STATUS_OK, STATUS_OUTSIDE, STATUS_MISSING = "ok", "outside the window", "not installed"

# Self-test tolerances. Round-to-nearest has relative error <= 2^-p (p = significand bits incl.
# the implicit one: 11 for float16, 8 for bfloat16); the relative error is measured against
# max(|x|, smallest normal float16) so float16 subnormals do not inflate it.
_FP16_BOUND = 2.0**-11 * 1.001
_BF16_BOUND = 2.0**-8 * 1.001
_PROJECTION_TOL = 1e-5
_BATCH_TOL = 1e-4


# -- helpers ------------------------------------------------------------------------------------
def _error_text(err: BaseException) -> str:
    """One line for a report: exception type and message (first line)."""
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")


def _gib(n_bytes: int | None) -> str:
    """Bytes as GiB with two decimals ("-" for unknown)."""
    return "-" if n_bytes is None else f"{n_bytes / 2**30:.2f} GiB"


def _guarded(probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a backend probe; an exception becomes {available: False, reason: the error}."""
    try:
        return probe()
    except Exception as err:  # noqa: BLE001 - a doctor reports, it does not crash
        return {"available": False, "reason": _error_text(err), "detail": ""}


def _backend(available: bool, reason: str = "", detail: str = "") -> dict[str, Any]:
    """A backend entry; an unavailable one always carries a reason."""
    if not available and not reason:
        reason = "unavailable (no reason reported)"
    return {"available": bool(available), "reason": "" if available else reason, "detail": detail}


# -- versions -----------------------------------------------------------------------------------
def _project_requirements() -> tuple[dict[str, str], str]:
    """Canonical package name -> specifier string, from the installed project's metadata.

    Returns (windows, error); error is non-empty when the metadata cannot be read.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        requires = ilm.requires(PROJECT) or []
    except ilm.PackageNotFoundError:
        return {}, f"{PROJECT} is not installed (no metadata): install it with `pip install -e .`"
    windows: dict[str, str] = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # optional extras ("test") and other environments
        windows[canonicalize_name(req.name)] = str(req.specifier)
    return windows, ""


def check_versions(packages: tuple[str, ...] = PACKAGES) -> list[dict[str, str]]:
    """Installed version of each package and whether it is inside the declared window."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    windows, meta_error = _project_requirements()
    rows = []
    for name in packages:
        window = windows.get(canonicalize_name(name), "")
        try:
            installed = ilm.version(name)
        except ilm.PackageNotFoundError:
            rows.append({"package": name, "installed": "", "window": window or "-", "status": STATUS_MISSING,
                         "note": f"required by {PROJECT}" if window else ""})
            continue
        status, note = STATUS_OK, ""
        if meta_error:
            status, note = "unknown", meta_error
        elif window:
            try:
                inside = SpecifierSet(window).contains(Version(installed), prereleases=True)
            except InvalidVersion:
                inside, note = False, f"unparsable version {installed!r}"
            if not inside:
                status = STATUS_OUTSIDE
                note = note or f"{PROJECT} supports {name}{window}"
        else:
            note = f"no window declared by {PROJECT}"
        rows.append({"package": name, "installed": installed, "window": window or "-", "status": status,
                     "note": note})
    return rows


# -- system, devices, determinism ---------------------------------------------------------------
def system_info() -> dict[str, Any]:
    """Python, platform, CPU count and torch's thread settings."""
    import torch

    return {
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda or "none (CPU-only build)",
    }


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used ("" when it can)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not compiled with CUDA (torch.version.cuda is None)"
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return "CUDA_VISIBLE_DEVICES is set to empty (forces the CPU)"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return ""
    except Exception as err:  # noqa: BLE001
        return f"CUDA initialisation failed: {_error_text(err)}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    suffix = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return f"no CUDA device visible: no GPU or driver found for CUDA {torch.version.cuda}{suffix}"


def mps_unavailable_reason() -> str:
    """Why Apple MPS cannot be used ("" when it can)."""
    import torch

    if sys.platform != "darwin":
        return f"not macOS (platform {sys.platform})"
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return "torch is not built with MPS"
    if not mps.is_available():
        return "MPS is built but not available (needs macOS 12.3+ and a Metal device)"
    return ""


def devices_info() -> list[dict[str, Any]]:
    """The CPU, each CUDA device (or why none) and MPS (or why not), with memory where known."""
    import torch

    from circuitkit.core.device import free_memory_bytes, total_memory_bytes

    cpu = torch.device("cpu")
    rows: list[dict[str, Any]] = [{
        "device": "cpu", "available": True, "name": platform.processor() or platform.machine(),
        "total_bytes": total_memory_bytes(cpu), "free_bytes": free_memory_bytes(cpu), "reason": ""}]
    reason = cuda_unavailable_reason()
    if reason:
        rows.append({"device": "cuda", "available": False, "name": "", "total_bytes": None, "free_bytes": None,
                     "reason": reason})
    else:
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            try:
                free, total = torch.cuda.mem_get_info(dev)
                props = torch.cuda.get_device_properties(dev)
                rows.append({"device": f"cuda:{i}", "available": True,
                             "name": f"{props.name} (sm_{props.major}{props.minor})",
                             "total_bytes": int(total), "free_bytes": int(free), "reason": ""})
            except Exception as err:  # noqa: BLE001
                rows.append({"device": f"cuda:{i}", "available": False, "name": "", "total_bytes": None,
                             "free_bytes": None, "reason": _error_text(err)})
    reason = mps_unavailable_reason()
    if reason:
        rows.append({"device": "mps", "available": False, "name": "", "total_bytes": None, "free_bytes": None,
                     "reason": reason})
    else:
        mps = torch.device("mps")
        rows.append({"device": "mps", "available": True, "name": "Apple MPS",
                     "total_bytes": total_memory_bytes(mps), "free_bytes": free_memory_bytes(mps), "reason": ""})
    return rows


def determinism_info() -> dict[str, Any]:
    """Settings that decide whether two runs give bit-identical results."""
    import torch

    info: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "unset"),
    }
    for var in THREAD_ENV:
        info[var] = os.environ.get(var, "unset")
    info["seed"] = SEED_NOTE
    return info


# -- backends -----------------------------------------------------------------------------------
def _probe_bf16() -> dict[str, Any]:
    import torch

    if not cuda_unavailable_reason():
        ok = torch.cuda.is_bf16_supported()
        return _backend(ok, "" if ok else "this CUDA device does not support bfloat16 (needs sm_80+)",
                        "cuda: torch.cuda.is_bf16_supported()")
    a = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16
    out = (a.bfloat16() @ a.bfloat16()).float()
    err = (out - a @ a).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and err < 0.05
    return _backend(ok, f"CPU bfloat16 matmul is wrong (max abs error {err:.3g})",
                    f"cpu: 4x4 bfloat16 matmul ran, max abs error {err:.2g}")


def _probe_bf16_native() -> dict[str, Any]:
    from circuitkit.core.device import bf16_support

    s = bf16_support()
    if s.native:
        return _backend(True, detail=f"{s.device}: {s.how}; model.precision=auto runs in bfloat16")
    return _backend(False, f"{s.device}: {s.how}; bf16 is {s.slowdown_text()}, so model.precision=auto runs in"
                    " float32 (model.precision=bfloat16 forces bf16)")


def _probe_sdpa() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if sdpa is None:
        return _backend(False, f"torch {torch.__version__} has no scaled_dot_product_attention")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    out = sdpa(q, k, v, is_causal=True)
    ref = torch.softmax((q @ k.transpose(-1, -2)) / 8**0.5 + torch.full((4, 4), float("-inf")).triu(1), -1) @ v
    err = (out - ref).abs().max().item()
    return _backend(err < 1e-4, f"SDPA disagrees with eager attention (max abs error {err:.3g})",
                    f"cpu: causal (1, 2, 4, 8) ran, max abs error vs eager {err:.2g}")


def _probe_flash() -> dict[str, Any]:
    import torch

    if cuda_unavailable_reason():
        return _backend(False, "no CUDA device (flash attention is CUDA-only)")
    if not torch.backends.cuda.flash_sdp_enabled():
        return _backend(False, "disabled: torch.backends.cuda.flash_sdp_enabled() is False")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return _backend(False, f"GPU compute capability sm_{major}{minor} is below sm_80 (Ampere) required")
    return _backend(True, detail=f"flash_sdp_enabled, sm_{major}{minor}")


def _probe_safetensors() -> dict[str, Any]:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with tempfile.TemporaryDirectory(prefix="gradian-doctor-") as tmp:
        path = Path(tmp) / "probe.safetensors"
        save_file({"probe": tensor}, str(path))
        with safe_open(str(path), framework="pt") as fh:
            back = fh.get_tensor("probe")
    ok = torch.equal(back, tensor)
    return _backend(ok, "tensor read back through safe_open differs from what was written",
                    "wrote and memory-mapped a (3, 4) float32 tensor")


def backends_info() -> dict[str, dict[str, Any]]:
    """Each backend: {available, reason (non-empty when unavailable), detail}."""
    import torch

    cuda_reason = cuda_unavailable_reason()
    cuda_detail = "" if cuda_reason else f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}"
    return {
        "CUDA": _backend(not cuda_reason, cuda_reason, cuda_detail),
        "MPS": _guarded(lambda: _backend(not mps_unavailable_reason(), mps_unavailable_reason())),
        "CPU": _backend(True, detail=f"{torch.get_num_threads()} torch threads"),
        "bf16": _guarded(_probe_bf16),
        "bf16 native": _guarded(_probe_bf16_native),
        "SDPA": _guarded(_probe_sdpa),
        "flash attention": _guarded(_probe_flash),
        "safetensors mmap": _guarded(_probe_safetensors),
    }


# -- self-tests ---------------------------------------------------------------------------------
def _test_projection() -> dict[str, Any]:
    """Same seed -> same Kronecker matrices; project(x, δ) == project_gradient(Σ_t δ_t x_tᵀ); with the
    default projection kind (grads.projection)."""
    import torch

    from gradian.projection.projector import Projector
    from gradian.settings.grads import GradsConfig

    shapes, kind = {"probe": (12, 10)}, GradsConfig().projection
    p1, p2 = Projector(shapes, kind, 16, seed=0), Projector(shapes, kind, 16, seed=0)
    same = all(torch.equal(a, b) for a, b in zip(p1.kronecker_matrices("probe"), p2.kronecker_matrices("probe"),
                                                  strict=True))
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(2, 5, 10, generator=g), torch.randn(2, 5, 12, generator=g)
    grad = torch.einsum("bto,bti->boi", delta, x)
    a, b = p1.project("probe", x, delta), p1.project_gradient("probe", grad)
    rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    return {"passed": bool(same and rel < _PROJECTION_TOL), "value": rel,
            "detail": f"{kind} dim 16 on (12, 10): matrices identical across constructions: {same};"
                      f" max relative error project vs project_gradient {rel:.2e} (tol {_PROJECTION_TOL:g})"}


def _test_dtype() -> dict[str, Any]:
    """Max relative error of float32 -> float16 / bfloat16 -> float32 on random normals."""
    import torch

    x = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    denom = x.abs().clamp_min(torch.finfo(torch.float16).tiny)
    fp16 = ((x.half().float() - x).abs() / denom).max().item()
    bf16 = ((x.bfloat16().float() - x).abs() / denom).max().item()
    return {"passed": bool(fp16 <= _FP16_BOUND and bf16 <= _BF16_BOUND), "value": {"float16": fp16, "bfloat16": bf16},
            "detail": f"float16 {fp16:.2e} (bound {2.0**-11:.2e}), bfloat16 {bf16:.2e} (bound {2.0**-8:.2e})"}


def _test_batch_invariance() -> dict[str, Any]:
    """An example's gradient row alone equals its row inside a right-padded batch of 3."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from circuitkit.models.adapters import get_adapter
    from circuitkit.models.linear_modules import module_shapes
    from gradian.capture.gradients import per_example_gradients
    from gradian.projection.projector import Projector
    from gradian.settings.grads import GradsConfig

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval().requires_grad_(False)
    adapter = get_adapter(model)
    mlp_out = adapter.mlp_output_linear(0)
    modules = [(name, m) for name, m in model.named_modules() if m is mlp_out]
    defaults = GradsConfig()  # the default projection kind and loss
    projector = Projector(module_shapes(modules), defaults.projection, 16, seed=0)

    g = torch.Generator().manual_seed(1)
    lengths, probe, width = [8, 5, 3], 1, 8
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, 100, (n,), generator=g)
        mask[b, :n] = 1
    supervised = mask.bool() & (torch.arange(width) > 0)
    batch = {"input_ids": ids, "attention_mask": mask, "supervised": supervised}
    n = lengths[probe]
    alone = {"input_ids": ids[probe:probe + 1, :n], "attention_mask": mask[probe:probe + 1, :n],
             "supervised": supervised[probe:probe + 1, :n]}
    row_batch = per_example_gradients(model, adapter, modules, projector, batch, loss=defaults.loss).row()[probe]
    row_alone = per_example_gradients(model, adapter, modules, projector, alone, loss=defaults.loss).row()[0]
    rel = ((row_batch - row_alone).abs().max() / row_alone.abs().max().clamp_min(1e-30)).item()
    return {"passed": bool(rel < _BATCH_TOL), "value": rel,
            "detail": f"random 1-layer GPT-2 (d=32), its MLP output linear, {defaults.projection} 16, loss"
                      f" {defaults.loss}: example of {n} tokens alone vs"
                      f" row {probe} of a batch padded to {width}; max relative difference {rel:.2e}"
                      f" (tol {_BATCH_TOL:g})"}


def self_tests() -> dict[str, dict[str, Any]]:
    """Run the quick self-tests; each {passed, value, detail} (a crash is a failure with its error)."""
    results = {}
    for name, test in (("projection round trip", _test_projection), ("dtype round trip", _test_dtype),
                       ("batch invariance", _test_batch_invariance)):
        try:
            results[name] = test()
        except Exception as err:  # noqa: BLE001
            last = traceback.extract_tb(err.__traceback__)[-1]
            results[name] = {"passed": False, "value": None,
                             "detail": f"crashed: {_error_text(err)} ({Path(last.filename).name}:{last.lineno})"}
    return results


# -- optional dependencies -------------------------------------------------------------------------
# (distribution, import name, pyproject extra, what it enables): every optional package a command
# needs. Sentence embeddings are not among them: the clusters of `gradian attribute` are TF-IDF
# (scikit-learn).
OPTIONAL = (
    ("peft", "peft", "peft", "model.adapter (LoRA adapters) and gradian attribute --verify"),
    ("scikit-learn", "sklearn", "attribute", "gradian attribute's clusters of the accused rows (TF-IDF)"),
    ("datasets", "datasets", "data", "Parquet / Arrow / hub datasets as Gradian data (JSONL needs nothing)"),
    ("gguf", "gguf", "gguf", "GGUF files as model.name and circuitkit fetch"),
    ("accelerate", "accelerate", "accelerate", "model.device_map (a model split over devices or offloaded)"),
    ("ray", "ray", "ray", "hydra/launcher=ray (sweeps and sharded indexing on Ray)"),
    ("hydra-ray-launcher", "hydra_plugins.hydra_ray_launcher", "ray", "hydra/launcher=ray"),
    ("hydra-submitit-launcher", "hydra_plugins.hydra_submitit_launcher", "slurm", "hydra/launcher=slurm"),
    ("hydra-joblib-launcher", "hydra_plugins.hydra_joblib_launcher", "local", "hydra/launcher=local (joblib)"),
    ("playwright", "playwright", "browser", "the report's browser tests (make test-slow)"),
)


def optional_dependencies() -> list[dict[str, Any]]:
    """Each optional package: its installed version (None if not installed), whether it can be imported
    (found without importing it), what it enables and how to install it."""
    from importlib.util import find_spec

    rows = []
    for dist, module, extra, enables in OPTIONAL:
        try:
            installed: str | None = ilm.version(dist)
        except ilm.PackageNotFoundError:
            installed = None
        try:
            importable = find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing or broken
            importable = False
        state = "ok" if installed and importable else "not importable" if installed else STATUS_MISSING
        rows.append({"package": dist, "installed": installed, "importable": importable, "state": state,
                     "enables": enables, "install": f"pip install '{PROJECT}[{extra}]'"})
    return rows


# -- report -------------------------------------------------------------------------------------
def collect() -> dict[str, Any]:
    """The whole report as plain JSON-serialisable data (see the module docstring for the keys)."""
    return {
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "versions": check_versions(),
        "optional": optional_dependencies(),
        "system": system_info(),
        "devices": devices_info(),
        "determinism": determinism_info(),
        "backends": backends_info(),
        "self_tests": self_tests(),
    }


def _cell(value: Any) -> str:
    """A Markdown table cell: pipes escaped, newlines flattened, None as "-"."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        value = ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown, ready to paste into an issue."""
    out = [f"## Gradian doctor report ({report['generated']})", ""]
    versions = report["versions"]
    flagged = [v for v in versions if v["status"] != STATUS_OK]
    out += ["### Package versions", ""]
    out += _table(["package", "installed", "supported", "status", "note"],
                  [[v["package"], v["installed"], v["window"], v["status"] if v["status"] == STATUS_OK
                    else f"**{v['status']}**", v["note"]] for v in versions])
    out += ["", f"{len(flagged)} package(s) need attention." if flagged else "All packages inside the window.", ""]
    out += ["### Optional packages", ""]
    out += _table(["package", "installed", "state", "enables", "install"],
                  [[o["package"], o["installed"], o["state"] if o["state"] == "ok" else f"**{o['state']}**",
                    o["enables"], o["install"] if o["state"] != "ok" else ""] for o in report["optional"]])
    out += ["", "### System", ""]
    out += _table(["key", "value"], [[k, v] for k, v in report["system"].items()])
    out += ["", "### Devices", ""]
    out += _table(["device", "available", "name", "total memory", "free memory", "reason"],
                  [[d["device"], "yes" if d["available"] else "no", d["name"], _gib(d["total_bytes"]),
                    _gib(d["free_bytes"]), d["reason"]] for d in report["devices"]])
    out += ["", "### Determinism", ""]
    out += _table(["setting", "value"], [[k, v] for k, v in report["determinism"].items()])
    out += ["", "### Backends", ""]
    out += _table(["backend", "available", "reason / detail"],
                  [[name, "yes" if b["available"] else "no", b["detail"] if b["available"] else b["reason"]]
                   for name, b in report["backends"].items()])
    out += ["", "### Self-tests", ""]
    out += _table(["test", "result", "value", "detail"],
                  [[name, "pass" if t["passed"] else "**FAIL**", t["value"], t["detail"]]
                   for name, t in report["self_tests"].items()])
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`gradian doctor [--json]`: print the report; exit 1 when a self-test fails, else 0."""
    parser = argparse.ArgumentParser(prog="gradian doctor",
                                     description="Environment report: versions, devices, determinism,"
                                                 " backends and quick self-tests (paste it into an issue).")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render_markdown(report).rstrip("\n"))
    return 0 if all(t["passed"] for t in report["self_tests"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
