"""Which CircuitKit made an artifact: the installed distribution's version and, when it runs from a
git checkout, the commit. Recorded in every run's manifest (`package_versions`), circuit.pt, the
index header, exports and the report.

    software() -> {"circuitkit-gradian": "0.1.0", "git_commit": "9151718…" or None}

The version is asked of the distribution by its name (`circuitkit.DISTRIBUTION`): PyPI's
`circuitkit` is another project, so the import name says nothing. A checkout is the directory above
the `circuitkit` package when it holds both `.git` and `pyproject.toml` (an installed wheel's
package lives in site-packages, which has neither, even inside a checkout's virtual environment).
"""

from __future__ import annotations

import functools
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# The `circuitkit` package, whose __init__ names the distribution; read as text: the package's
# __init__ is the entry layer, above this one.
_PACKAGE = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def _package_fields() -> dict[str, str]:
    text = (_PACKAGE / "__init__.py").read_text(encoding="utf-8")
    return dict(re.findall(r'^(DISTRIBUTION|__version__) = "([^"]+)"', text, flags=re.MULTILINE))


def distribution_name() -> str:
    """The distribution's name (`circuitkit.DISTRIBUTION`)."""
    return _package_fields()["DISTRIBUTION"]


def distribution_version() -> str:
    """`circuitkit-gradian`'s installed version, or the package's own `__version__` marked as not
    installed (a source tree on sys.path)."""
    try:
        return metadata.version(distribution_name())
    except metadata.PackageNotFoundError:
        return f"{_package_fields()['__version__']} (not installed: source tree)"


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the checkout the package runs from (with `+dirty` when tracked files changed), or
    None when it runs from an installed wheel or git cannot tell."""
    root = _PACKAGE.parent
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def software() -> dict[str, Any]:
    """{distribution name: version, "git_commit": commit or None}: what made an artifact."""
    return {distribution_name(): distribution_version(), "git_commit": git_commit()}
