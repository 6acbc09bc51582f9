"""The planted LoRA fixture of `gradian attribute`'s tests (a tiny GPT-2, six planted rows), found
wherever its test file lives now, so that these tests build on the same models and rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[2]


def planted_module() -> ModuleType:
    """The test module that builds the planted fine-tune (it defines `PLANTED_IDS` and `_build`)."""
    for path in sorted(TESTS.rglob("test_*attribute*.py")):
        text = path.read_text(encoding="utf-8")
        if "PLANTED_IDS = " in text and "def _build(root" in text:
            name = "planted_attribute_fixture"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError(f"no test file under {TESTS} builds the planted attribute fixture")
