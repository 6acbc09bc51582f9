"""The entry layer: the commands, the Python API and the one list of stages, above both domains.

    circuitkit_app/stage_list.py   the pipeline's stages (preflight, data, attribution, pruning, grads)
    circuitkit_app/run.py          `python -m circuitkit.run`: Hydra composes, the pipeline runs
    circuitkit_app/cli.py          the `circuitkit` command (run, config, show, export, import, merge, ...)
    circuitkit_app/api.py          `discover_circuit(dict)` (also `from circuitkit import discover_circuit`)
    circuitkit_app/smart.py        `circuitkit discover-smart`
    circuitkit_app/merge.py        `circuitkit merge`: attribution shards merged by hand

Only this package knows both `circuitkit` (core, models, circuit discovery) and `gradian`;
neither of them imports it. The names users type stay: `python -m circuitkit.run` and
`python -m circuitkit.cli` are two-line shims that call the `main` here, and
`circuitkit.discover_circuit` calls `circuitkit_app.api` (docs/architecture.md).
"""

import importlib.util as _util
import sys as _sys


def _check_own_circuitkit() -> None:
    """Stop in one line when the `circuitkit` Python would import is not this project's.

    PyPI's `circuitkit` (Lexsi Labs' CircuitKIT) also imports as `circuitkit`; installed into the
    same environment, one overwrites the other's files and every command would fail on an import
    deep inside. Read as text (not imported), so the other package's code never runs here.
    """
    spec = _util.find_spec("circuitkit")
    origin = getattr(spec, "origin", None) if spec is not None else None
    try:
        ours = origin is not None and 'DISTRIBUTION = "circuitkit-gradian"' in open(origin, encoding="utf-8").read()
    except OSError:
        ours = False
    if not ours:
        where = origin or "nowhere: no module named circuitkit"
        print(f"error: the `circuitkit` Python imports ({where}) is not CircuitKit + Gradian's (distribution"
              " circuitkit-gradian; PyPI's `circuitkit` is Lexsi Labs' CircuitKIT, which imports under the same"
              " name): install ours in a virtual environment of its own (pip install -e . there)", file=_sys.stderr)
        raise SystemExit(2)


_check_own_circuitkit()
