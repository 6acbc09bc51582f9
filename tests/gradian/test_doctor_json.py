"""`gradian doctor --json` lists every optional dependency with its state.
"""

from __future__ import annotations

import json

from tests.helpers.refusals import (
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
)


def test_doctor_json_lists_every_optional_dependency_with_its_state(monkeypatch, capsys):
    import importlib.util

    from gradian import doctor

    real = importlib.util.find_spec

    def hidden(name, *args, **kwargs):  # peft and scikit-learn installed but not importable
        return None if name in ("peft", "sklearn") else real(name, *args, **kwargs)
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setattr(doctor, "self_tests", lambda: {})  # not what this test is about (seconds)
    assert doctor.main(["--json"]) == 0
    rows = {o["package"]: o for o in json.loads(capsys.readouterr().out)["optional"]}
    assert {"peft", "scikit-learn", "playwright", "ray", "datasets", "accelerate"} <= set(rows)
    for name in ("peft", "scikit-learn"):
        assert rows[name]["state"] in ("not importable", "not installed") and not rows[name]["importable"]
        assert "pip install 'circuitkit-gradian[" in rows[name]["install"]
    assert "model.adapter" in rows["peft"]["enables"] and "clusters" in rows["scikit-learn"]["enables"]
    assert all(o["enables"] and o["state"] in ("ok", "not importable", "not installed") for o in rows.values())
