"""`circuitkit` command line.

    circuitkit run [overrides...]       same as `python -m circuitkit.run [overrides...]`
    circuitkit config [overrides...]    print the composed, validated config and exit
    circuitkit show CIRCUIT.pt [--graph FILE.png]   summary table and kept heads of a saved circuit
    circuitkit export SRC OUT.json [--format eap-ig-json]     circuit.pt / scores.safetensors -> EAP-IG JSON
    circuitkit import GRAPH.json OUT.pt|OUT.safetensors       EAP-IG JSON -> circuit.pt or scores
    circuitkit discover-smart --model M --algorithm A --task T [--check-memory] [overrides...]
                                        size the batch to the device (or only print the estimate)
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.syntax import Syntax

_console = Console(stderr=True)


def _cmd_config(overrides: list[str]) -> int:
    from omegaconf import OmegaConf

    from circuitkit.config import ConfigError, compose

    try:
        cfg, _typed = compose(overrides)
    except ConfigError as err:
        _console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    Console().print(Syntax(OmegaConf.to_yaml(cfg), "yaml"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="circuitkit", description="Circuit discovery on Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the pipeline (Hydra overrides follow)", add_help=False)
    sub.add_parser("config", help="print the composed config for the given overrides", add_help=False)
    sub.add_parser("discover-smart", help="pick the largest batch that fits, or --check-memory", add_help=False)
    show = sub.add_parser("show", help="summarize a circuit.pt")
    show.add_argument("path", help="circuit.pt written by the pruning stage")
    show.add_argument("--graph", default=None, help="also draw the circuit as a layered graph to this .png/.svg")
    show.add_argument("--top-edges", type=int, default=40, help="at most this many edges in --graph")
    sub.add_parser("export", help="circuit.pt / scores.safetensors -> EAP-IG JSON graph", add_help=False)
    sub.add_parser("import", help="EAP-IG JSON graph -> circuit.pt or scores.safetensors", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from circuitkit.run import main as run_main

        run_main(rest)
        return 0
    if command == "config":
        return _cmd_config(rest)
    if command == "discover-smart":
        from circuitkit.smart import main as smart_main

        return smart_main(rest)
    if command in ("export", "import"):
        from circuitkit import interop
        from circuitkit.errors import run_entry

        return run_entry(interop.export_main if command == "export" else interop.import_main, rest)
    if command == "show":
        from circuitkit.circuit import show_circuit

        args = parser.parse_args(argv)
        try:
            show_circuit(args.path)
            if args.graph:
                from circuitkit.circuit_graph import graph_file

                _console.print(f"wrote {', '.join(map(str, graph_file(args.path, args.graph, args.top_edges)))}")
        except (FileNotFoundError, ValueError) as err:
            _console.print(f"[bold red]error:[/bold red] {err}")
            return 2
        return 0
    parser.parse_args(argv)  # prints the usage error for unknown commands
    return 2


if __name__ == "__main__":
    sys.exit(main())
