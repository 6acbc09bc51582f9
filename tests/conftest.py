"""Shared test setup: offline Hugging Face, a per-checkout fixture cache, tiny model factories."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Built once per checkout (and per CI run), then reused; set CIRCUITKIT_CACHE to share them.
os.environ.setdefault("CIRCUITKIT_CACHE", str(REPO / ".cache" / "test-fixtures"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The verdict's random circuits (pruning.random_baselines, conf/pruning/heads.yaml reads this): off for
# the many small pipeline runs; the verdict's own tests (test_verdict.py) set the key.
os.environ.setdefault("CIRCUITKIT_RANDOM_BASELINES", "0")


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Path]:
    """Factory: fixture name (e.g. 'tiny-gpt2') -> its directory, built on first use."""
    from circuitkit.fixtures.models import ensure_fixture

    return ensure_fixture


@pytest.fixture(scope="session")
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Path:
    """A tiny random model's directory: 'tiny-gpt2', or the name given by indirect
    parametrization (`@pytest.mark.parametrize("tiny_model_dir", ["tiny-llama"], indirect=True)`)."""
    return tiny_model(getattr(request, "param", "tiny-gpt2"))


@pytest.fixture(scope="session")
def induction_model_dir() -> Path:
    """The trained induction model's directory (fixture_info.json names its known heads)."""
    from circuitkit.fixtures.models import ensure_fixture

    return ensure_fixture("induction")


@pytest.fixture(autouse=True)
def _no_logging_handlers_left_behind():
    """A test that runs an entry point in-process (Hydra configures logging) must not leave a
    handler bound to its captured stream, which is closed once the test ends: a later test's log
    record would print a 'Logging error' traceback into that test's captured stderr."""
    import logging

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    before = {id(lg): list(lg.handlers) for lg in loggers}
    yield
    for lg in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        kept = before.get(id(lg), [])
        for handler in [h for h in lg.handlers if h not in kept]:
            lg.removeHandler(handler)


@pytest.fixture
def no_load(monkeypatch):
    """Refusals that must come before the model loads (a damaged adapter, a bad numeric flag): loading fails the test."""
    import circuitkit.models.loading
    import gradian.build.indexer

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the adapter was checked")
    for module in (circuitkit.models.loading, gradian.build.indexer):
        monkeypatch.setattr(module, "load_model", refuse)
