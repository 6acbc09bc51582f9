"""The installed `gradian` command: gradian's own commands (`gradian.cli`) plus what needs the entry
layer: the pages the report draws (`gradian report RANK.jsonl`, `gradian rank ... --report`) and
`gradian index`, which composes the pipeline's config (AppConfig, `circuitkit_app.config`).

`gradian.cli` sits below the entry layer and cannot import the report or the config's root; this
shim composes the config for `index`, parses with its parser, runs its rank command and then writes
the page, and hands every other command over unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

from circuitkit.core.errors import UserError, run_entry
from gradian import cli as gradian_cli


def _check_page(page: Path, args) -> None:
    """`rank --report PAGE`, checked before the ranking runs: a file path that is neither --out (the
    rows the page is drawn from) nor anything the ranking reads, and writable."""
    from circuitkit.core.io import check_not_an_input, check_writable

    example = str(Path(args.out).with_suffix(".html")) if Path(args.out).suffix != ".html" else f"{args.out}.report.html"
    if page.is_dir():
        raise UserError(f"--report {str(page)!r} is a directory, but the page is one HTML file: give its file name,"
                        f" e.g. {page / Path(example).name}.", exit_code=2)
    check_not_an_input(page, "--report", [("--out", Path(args.out)), *gradian_cli.rank_inputs(args)], example)
    check_writable(page, "--report")


def _index(overrides: list[str]) -> int:
    """`gradian index [overrides]`: the config composed as `python -m circuitkit.run` would, then the
    grads stage on its own (gradian.cli.index_command)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from circuitkit.core.config import ConfigError
    from circuitkit_app.config import compose

    if any(arg in ("-h", "--help") for arg in overrides):
        print(gradian_cli.index_help())
        return 0
    try:
        _, cfg = compose(overrides)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise UserError(gradian_cli.bad_override(overrides) or " ".join(str(err).split()), exit_code=2) from err
    return gradian_cli.index_command(cfg)


def _main(argv: list[str]) -> int:
    from circuitkit_app.report import write_rank_report

    if argv and argv[0] == "index":
        return _index(argv[1:])

    if argv and argv[0] == "report":
        args = gradian_cli.parse(argv)
        path = write_rank_report(Path(args.rank), Path(args.index), Path(args.queries) if args.queries else None,
                                 Path(args.out) if args.out else None)
        print(f"report: {path}")
        return 0
    if argv and argv[0] == "rank" and any(a == "--report" or a.startswith("--report=") for a in argv):
        args = gradian_cli.parse(argv)
        if not args.out:
            raise UserError("--report needs --out RANK.jsonl: the page is drawn from the ranked rows written there.",
                            exit_code=2)
        page = Path(args.report) if args.report else Path(args.out).with_suffix(".html")
        _check_page(page, args)
        code = gradian_cli.rank_command(args)
        if code:
            return code
        path = write_rank_report(Path(args.out), Path(args.index), Path(args.queries), page)
        print(f"report: {path}")
        return 0
    return gradian_cli.main(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the installed `gradian` command; returns the exit status."""
    return run_entry(_main, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
