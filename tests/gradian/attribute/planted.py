"""The planted LoRA fixture of `gradian attribute`'s tests (a tiny GPT-2, six planted rows), built in
tests/gradian/attribute/test_attribute.py, so that other tests build on the same models and rows."""

from __future__ import annotations

import importlib
from types import ModuleType


def planted_module() -> ModuleType:
    """The test module that builds the planted fine-tune (it defines `PLANTED_IDS` and `_build`)."""
    return importlib.import_module("tests.gradian.attribute.test_attribute")
