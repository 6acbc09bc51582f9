"""`gradian attribute --seed -1` names the flag.
"""

from __future__ import annotations

from tests.helpers.refusals import (
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
)


def test_attribute_seed_minus_one_names_the_flag(capsys):
    from circuitkit_app.gradian_cli import main

    code = main(["attribute", "--index", "IDX", "--eval-dataset", "E.jsonl", "--seed", "-1"])
    line = _one_error(capsys.readouterr().err)
    assert code == 2 and line.startswith("error: --seed -1: it must be >= 0 and <= 4294967295"), (code, line)
