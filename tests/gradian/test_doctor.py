"""`gradian doctor`: JSON and Markdown reports, reasons for unavailable backends, version window, speed."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from gradian import doctor

SECTIONS = {"generated", "versions", "system", "devices", "determinism", "backends", "self_tests"}
BACKENDS = ("CUDA", "MPS", "CPU", "bf16", "bf16 native", "SDPA", "flash attention", "safetensors mmap")
CPU_ONLY = not torch.cuda.is_available() and not (torch.backends.mps.is_built() and torch.backends.mps.is_available())


@pytest.fixture(scope="module")
def report() -> dict:
    return doctor.collect()


def test_json_main_has_all_sections(capsys: pytest.CaptureFixture[str]) -> None:
    rc = doctor.main(["--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert SECTIONS <= set(data)
    assert {v["package"] for v in data["versions"]} == set(doctor.PACKAGES)
    assert all(v["status"] == doctor.STATUS_OK for v in data["versions"]), data["versions"]
    assert set(data["backends"]) == set(BACKENDS)
    for name, backend in data["backends"].items():
        assert backend["available"] or backend["reason"], name
    assert data["devices"][0]["device"] == "cpu" and data["devices"][0]["total_bytes"] > 0
    assert {"projection round trip", "dtype round trip", "batch invariance"} == set(data["self_tests"])
    assert all(t["passed"] for t in data["self_tests"].values()), data["self_tests"]
    assert data["determinism"]["seed"].startswith("seed: from config key `seed` (default 0)")


def test_markdown_names_every_backend_with_reasons(report: dict) -> None:
    md = doctor.render_markdown(report)
    assert md.startswith("## Gradian doctor report (")
    for section in ("Package versions", "System", "Devices", "Determinism", "Backends", "Self-tests"):
        assert f"### {section}" in md
    backends_table = md.split("### Backends", 1)[1].split("###", 1)[0]
    lines = {line.split("|")[1].strip(): line for line in backends_table.splitlines() if line.startswith("| ")}
    for name in BACKENDS:
        assert name in lines, name
        backend = report["backends"][name]
        if not backend["available"]:
            assert backend["reason"] and backend["reason"].replace("|", "\\|") in lines[name]


@pytest.mark.skipif(not CPU_ONLY, reason="checks the reasons given on a CPU-only machine")
def test_cpu_machine_reports_why_cuda_mps_flash_are_unavailable(report: dict) -> None:
    backends = report["backends"]
    for name in ("CUDA", "MPS", "flash attention"):
        assert backends[name]["available"] is False
        assert backends[name]["reason"].strip(), name
    assert backends["CPU"]["available"] and backends["safetensors mmap"]["available"]
    devices = {d["device"]: d for d in report["devices"]}
    assert devices["cuda"]["reason"] and devices["mps"]["reason"]


def test_cuda_visible_devices_empty_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES" in doctor.cuda_unavailable_reason()


def test_old_torch_is_flagged_outside_the_window(monkeypatch: pytest.MonkeyPatch, report: dict) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0.1" if name == "torch" else real(name))
    rows = {r["package"]: r for r in doctor.check_versions()}
    assert rows["torch"]["installed"] == "2.0.1"
    assert rows["torch"]["status"] == doctor.STATUS_OUTSIDE
    assert ">=2.4" in rows["torch"]["window"] and "torch" in rows["torch"]["note"]
    assert rows["numpy"]["status"] == doctor.STATUS_OK
    md = doctor.render_markdown({**report, "versions": list(rows.values())})
    assert "**outside the window**" in md and "1 package(s) need attention." in md


def test_missing_package_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version

    def fake(name: str) -> str:
        if name == "rich":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)
    rows = {r["package"]: r for r in doctor.check_versions()}
    assert rows["rich"]["status"] == doctor.STATUS_MISSING
