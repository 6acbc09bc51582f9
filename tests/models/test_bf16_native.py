"""bfloat16 only where the device computes it: the detector, `model.precision=auto`
resolved both ways, the preflight line, the manifest record, an explicit bfloat16 kept, the
estimates following the dtype used, and the per-machine cache of the timed check."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from circuitkit.core import device
from circuitkit.core.device import Bf16Support, resolve_precision
from circuitkit.models.config import ModelConfig
from circuitkit_app.config import compose

NATIVE = Bf16Support(True, "cpu", "cpu flags amx_bf16, avx512_bf16 (torch cpu capability AVX512)")
EMULATED = Bf16Support(False, "cpu", "torch cpu capability AVX2, no avx512_bf16 / amx_bf16 flag")
TIMED_SLOW = Bf16Support(False, "cpu", "timed linear 256x768: bf16 4.00x float32's time", 4.0)
DEFAULT_NOTE = "bfloat16 requested by default, float32 used: no native bf16 on cpu"


@pytest.fixture
def bf16(monkeypatch):
    """Set what the detector answers: bf16(EMULATED) makes every reader see a CPU without bf16."""
    def set_support(support: Bf16Support) -> None:
        monkeypatch.setattr(device, "bf16_support", lambda dev=None: support)
    return set_support


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """The CPU detector with mocked flags, capability and timer (counting its calls), caching in tmp_path."""
    monkeypatch.setenv("CIRCUITKIT_CACHE", str(tmp_path))
    calls = []

    def configure(flags, capability, slowdown=None):
        monkeypatch.setattr(device, "_cpu_flags", lambda: flags)
        monkeypatch.setattr(device, "_cpu_capability", lambda: capability)

        def timer():
            if slowdown is None:
                raise AssertionError("the detector timed a CPU its flags already decide")
            calls.append(slowdown)
            return slowdown
        monkeypatch.setattr(device, "_time_bf16_linear", timer)
        return calls
    return configure


# -- the detector ---------------------------------------------------------------------------------
def test_cpu_flags_decide_native_without_timing(cpu):
    cpu({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX512")
    s = device._cpu_support()
    assert s.native and s.slowdown is None and "amx_bf16, avx512_bf16" in s.how


def test_avx2_without_flag_is_not_native_without_timing(cpu):
    cpu({"avx2", "fma"}, "AVX2")
    s = device._cpu_support()
    assert not s.native and s.slowdown is None and "AVX2" in s.how
    assert "expected about 25x" in s.slowdown_text()


def test_undecided_cpu_is_timed_once_and_the_cache_read_back(cpu, tmp_path):
    calls = cpu({"avx2", "avx512f"}, "AVX512", slowdown=4.0)  # AVX-512 without bf16: undecided
    first = device._cpu_support()
    assert not first.native and first.slowdown == 4.0 and calls == [4.0]
    files = list((tmp_path / "device").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # written whole: no temporary left beside it
    assert json.loads(files[0].read_text())["slowdown"] == 4.0
    again = device._cpu_support()
    assert again == first and calls == [4.0]  # read back, not timed again
    assert "measured 4.0x slower" in again.slowdown_text()


def test_fast_timed_bf16_is_native(cpu):
    calls = cpu(None, "SVE256", slowdown=0.4)  # no /proc/cpuinfo: timed
    s = device._cpu_support()
    assert s.native and s.slowdown == 0.4 and calls == [0.4]


def test_unreadable_cache_is_timed_again(cpu, tmp_path):
    calls = cpu({"avx512f"}, "AVX512", slowdown=3.0)
    device._cpu_support()
    next((tmp_path / "device").iterdir()).write_text("{not json")
    assert device._cpu_support().slowdown == 3.0 and calls == [3.0, 3.0]


@pytest.mark.parametrize("capability,native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_needs_compute_capability_8(monkeypatch, capability, native):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    s = device._cuda_support(torch.device("cuda", 0))
    assert s.native is native and s.device == "cuda" and f"{capability[0]}.{capability[1]}" in s.how


# -- what a run uses ------------------------------------------------------------------------------
def test_default_resolves_to_float32_without_native_bf16_and_keeps_explicit_bfloat16(bf16):
    bf16(EMULATED)
    auto = resolve_precision("auto")
    assert auto.dtype == torch.float32 and auto.note == DEFAULT_NOTE
    explicit = resolve_precision("bfloat16")
    assert explicit.dtype == torch.bfloat16
    assert explicit.note == "bfloat16 requested explicitly, bfloat16 used: no native bf16 on cpu"
    assert resolve_precision("float32").dtype == torch.float32 and resolve_precision("float16").dtype == torch.float16
    assert resolve_precision("float32").advice() is None
    bf16(NATIVE)
    assert resolve_precision("auto").dtype == torch.bfloat16
    assert resolve_precision("auto").note == "bfloat16 requested by default, bfloat16 used: native bf16 on cpu"
    assert resolve_precision("auto").advice() is None and resolve_precision("bfloat16").advice() is None


def test_the_loader_uses_the_resolved_dtype(bf16):
    from circuitkit.models.loading import load_model

    bf16(EMULATED)
    assert next(load_model(ModelConfig(name="builtin:tiny-gpt2")).model.parameters()).dtype == torch.float32
    assert next(load_model(ModelConfig(name="builtin:tiny-gpt2", precision="bfloat16")).model.parameters()).dtype \
        == torch.bfloat16
    bf16(NATIVE)
    assert next(load_model(ModelConfig(name="builtin:tiny-gpt2")).model.parameters()).dtype == torch.bfloat16


def test_estimates_follow_the_dtype_used(bf16):
    from circuitkit.discovery.attribution.memory import attribution_estimate
    from circuitkit.discovery.pruning.memory import pruning_estimate
    from gradian.build.memory import grads_estimate

    def weights(overrides):
        cfg = compose(["model=gpt2", *overrides])[1]
        return [f(cfg).terms["weights"] for f in (attribution_estimate, pruning_estimate, grads_estimate)]

    bf16(EMULATED)
    assert weights([]) == weights(["model.precision=float32"])
    assert weights(["model.precision=bfloat16"]) == [w // 2 for w in weights(["model.precision=float32"])]
    bf16(NATIVE)
    assert weights([]) == weights(["model.precision=bfloat16"])


# -- the preflight line and the manifest ----------------------------------------------------------
def _preflight_lines(overrides):
    from circuitkit.preflight.stage import check
    from circuitkit_app.stage_list import PIPELINE

    cfg = compose(["stages=[preflight,attribution]", *overrides])[1]
    out = io.StringIO()
    check(cfg, PIPELINE.selected(cfg), Console(file=out, width=400))
    return [line for line in out.getvalue().splitlines() if line.startswith("precision:")]


def test_preflight_says_it_in_one_line_with_the_slowdown_and_the_key(bf16):
    bf16(EMULATED)
    [line] = _preflight_lines([])
    assert "no native bf16 on cpu" in line and "expected about 25x slower" in line
    assert "uses float32" in line and "model.precision=float32" in line
    [line] = _preflight_lines(["model.precision=bfloat16"])
    assert "model.precision=bfloat16 on cpu without native bf16" in line and "model.precision=float32" in line
    bf16(TIMED_SLOW)
    [line] = _preflight_lines([])
    assert "measured 4.0x slower than float32" in line
    assert _preflight_lines(["model.precision=float32"]) == []
    bf16(NATIVE)
    assert _preflight_lines([]) == []


def test_manifest_records_requested_used_and_why(bf16, tmp_path):
    from circuitkit.core.pipeline import stage_hashes
    from circuitkit_app.stage_list import PIPELINE, run_pipeline

    small = ["stages=[preflight,data]", "discovery.data_params.num_examples=4",
             "discovery.data_params.eval_examples=2", "discovery.data_params.seq_len=16", "report.enabled=false"]
    cfg = compose(small)[1]
    bf16(EMULATED)
    manifest = run_pipeline(cfg, tmp_path / "emulated")
    assert manifest["precision"]["requested"] == "auto" and manifest["precision"]["used"] == "float32"
    assert manifest["precision"]["note"] == DEFAULT_NOTE
    assert manifest["precision"]["bf16"]["native"] is False
    on_disk = json.loads((tmp_path / "emulated" / "manifest.json").read_text())
    assert on_disk["precision"]["note"] == DEFAULT_NOTE
    emulated_hashes = stage_hashes(cfg, PIPELINE.selected(cfg))
    explicit = compose([*small, "model.precision=bfloat16"])[1]
    assert run_pipeline(explicit, tmp_path / "explicit")["precision"]["used"] == "bfloat16"
    # auto is hashed as the dtype it means here: float32 where bf16 is emulated, bfloat16 where native
    float32 = compose([*small, "model.precision=float32"])[1]
    assert emulated_hashes == stage_hashes(float32, PIPELINE.selected(float32))
    bf16(NATIVE)
    assert stage_hashes(cfg, PIPELINE.selected(cfg)) == stage_hashes(explicit, PIPELINE.selected(explicit))
    assert run_pipeline(cfg, tmp_path / "native")["precision"]["used"] == "bfloat16"


def test_doctor_says_whether_bf16_is_native(bf16):
    from gradian.doctor import _probe_bf16_native

    bf16(EMULATED)
    entry = _probe_bf16_native()
    assert entry["available"] is False and "AVX2" in entry["reason"] and "float32" in entry["reason"]
    bf16(NATIVE)
    entry = _probe_bf16_native()
    assert entry["available"] is True and "amx_bf16" in entry["detail"]
