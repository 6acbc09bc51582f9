"""Every `gradian` command's --help works.
"""

from __future__ import annotations

import pytest

from circuitkit_app.gradian_cli import main


@pytest.mark.parametrize("argv", [["--help"], ["index", "--help"], ["rank", "--help"], ["inspect", "--help"],
                                  ["doctor", "--help"]])
def test_every_help_works(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    assert code == 0 and "usage: gradian" in out and "Traceback" not in err
