"""The entry layer: the commands, the Python API and the one list of stages, above both domains.

    entry/stage_list.py   the pipeline's stages (preflight, data, attribution, pruning, grads)
    entry/run.py          `python -m circuitkit.run`: Hydra composes, the pipeline runs
    entry/cli.py          the `circuitkit` command (run, config, show, export, import, merge, ...)
    entry/api.py          `discover_circuit(dict)` (also `from circuitkit import discover_circuit`)
    entry/smart.py        `circuitkit discover-smart`
    entry/merge.py        `circuitkit merge`: attribution shards merged by hand

Only this package knows both `circuitkit` (core, models, circuit discovery) and `gradian`;
neither of them imports it. The names users type stay: `python -m circuitkit.run` and
`python -m circuitkit.cli` are two-line shims that call the `main` here, and
`circuitkit.discover_circuit` calls `entry.api` (docs/architecture.md).
"""
