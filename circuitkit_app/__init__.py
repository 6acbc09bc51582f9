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
