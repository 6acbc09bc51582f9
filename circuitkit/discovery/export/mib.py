"""MIB (the Mechanistic Interpretability Benchmark) circuit-localization track: export and check.

MIB's metrics, as its evaluation code defines them (`evaluate_area_under_curve` of
hannamw/MIB-circuit-track): at each share x of MIB's grid (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50,
100 % of the edges) keep the int(x · n_edges) edges of highest |score|, patch every other edge
with the corrupted run's value (counterfactual ablation), and measure

    f(x) = (m(circuit) - m(empty)) / (m(model) - m(empty))     m: the task metric (IOI: logit difference)
    CPR  = Σ_i (x_{i+1} - x_i) (f_i + f_{i+1}) / 2             area under f, higher is better
    CMD  = Σ_i (x_{i+1} - x_i) (|1 - f_i| + |1 - f_{i+1}|) / 2  area between f and 1, lower is better

on a linear axis over x in [0.001, 1] (so f = 1 everywhere gives CPR 0.999, CMD 0).
CircuitKit computes the same with `pruning.scope=edges pruning.ablation=corrupted
pruning.rank_by=abs pruning.selection=top_k` (`circuitkit.discovery.pruning.heads.curve_areas`; the circuit
records `curve_definition`). The head-level curve (`pruning.scope=heads`) uses the same grid and
formulas over heads instead of edges: it is not MIB's number, and says so.

`circuitkit export SRC OUT --format mib` writes the folder MIB's leaderboard takes:

    OUT/<task>_<model>/importances.json          (--mib-mode importances, default): every edge with
                                                  its score (EAP-IG's Graph JSON, all in_graph);
                                                  MIB thresholds it itself at each share
    OUT/<task>_<model>/<share>.json               (--mib-mode circuits): one Graph JSON per share of
                                                  MIB's grid below 100 %, the top int(share · n)
                                                  edges by |score| in_graph, n counted in EAP-IG's
                                                  edges (a GQA key/value edge is one per query head)

Node and edge names are EAP-IG's (`circuitkit.discovery.export.interop`: GQA key/value edges are split evenly
over a KV group's query heads). `circuitkit export --check-mib OUT` validates a folder before
upload: folder names, JSON structure, every edge name well formed and over the graph its cfg
describes, finite scores, and in circuit files at most int(share · n) edges in_graph.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_write_bytes, check_writable
from circuitkit.discovery.attribution import load_scores
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import load_circuit
from circuitkit.discovery.pruning.heads import CURVE_PERCENTS, curve_count

MIB_SHARES = tuple(p / 100 for p in CURVE_PERCENTS)  # 0.001 .. 1
MIB_TASKS = ("ioi", "mcqa", "arithmetic_addition", "arithmetic_subtraction", "arc_easy", "arc_challenge")
MIB_MODELS = ("gpt2", "qwen2_5", "gemma2", "llama3", "interpbench")
_EDGE = re.compile(r"^(input|a\d+\.h\d+|m\d+)->(a\d+\.h\d+<[qkv]>|m\d+|logits)$")
_FOLDER = re.compile(r"^(?P<task>[a-z_]+?)_(?P<model>gpt2|qwen2_5|gemma2|llama3|interpbench|[a-z0-9_.-]+)$")


class MIBError(UserError, ValueError):
    """A MIB folder or export request that cannot be honoured (the message says what to change)."""


def share_name(share: float) -> str:
    """File stem of a circuit at `share` (0.001 -> '0.001')."""
    return f"{share:g}"


def _scores_and_graph(src: Path) -> tuple[torch.Tensor, Graph, dict[str, Any]]:
    """Edge scores (n_up, n_down), the graph and d_model/model from a scores.safetensors or an edge circuit.pt."""
    if src.suffix == ".safetensors":
        s = load_scores(src)
        if s.edges is None:
            raise MIBError(f"{src} holds node scores only; MIB ranks edges: run attribution with discovery.level=edge.")
        from safetensors import safe_open
        with safe_open(str(src), framework="pt") as fh:
            meta = fh.metadata() or {}
        return s.edges, s.graph, {"model_name": meta.get("model"), "d_model": None}
    c = load_circuit(src)
    if c.get("edge_scores") is None:
        raise MIBError(f"{src} has no edge scores; MIB ranks edges: prune a run with discovery.level=edge.")
    from circuitkit.discovery.circuit_graph import graph_shape
    return c["edge_scores"], graph_shape(c), {"model_name": c.get("model_name"), "d_model": c.get("d_model")}


def export_mib(src: Path, out_dir: Path, task: str, model: str, mode: str = "importances",
               d_model: int | None = None) -> list[Path]:
    """Write MIB's submission folder for one task/model from edge scores (see the module docstring)."""
    from circuitkit.discovery.export.interop import _d_model, to_eap_ig

    scores, g, info = _scores_and_graph(Path(src))
    d = _d_model(d_model, info["d_model"], info["model_name"])
    folder = Path(out_dir) / f"{task}_{model}"
    valid = g.edge_mask()
    in_graph = {n: True for n in g.upstream}
    zeros_h, zeros_m = torch.zeros(g.n_layers, g.n_heads), torch.zeros(g.n_layers)
    extra = {"model_name": info["model_name"], "source": "circuitkit export --format mib"}
    written = []
    obj = to_eap_ig(g, d, zeros_h, zeros_m, 0.0, scores, in_graph, valid, extra)
    if mode == "importances":
        written.append(atomic_write_bytes(folder / "importances.json", json.dumps(obj, allow_nan=False).encode()))
        return written
    # circuits: MIB counts EAP-IG's edges (a GQA key/value edge is one per query head), so the top
    # int(share * n) are taken among those, by |score| (MIB's apply_topn with absolute=True)
    names = list(obj["edges"])
    key = torch.tensor([abs(obj["edges"][k]["score"]) for k in names])
    order = key.argsort(descending=True, stable=True).tolist()
    for share in MIB_SHARES[:-1]:
        top = set(order[:curve_count(share * 100, len(names))])
        for i, k in enumerate(names):
            obj["edges"][k]["in_graph"] = i in top
        written.append(atomic_write_bytes(folder / f"{share_name(share)}.json",
                                          json.dumps(obj, allow_nan=False).encode()))
    return written


def _check_graph(path: Path, obj: Any, problems: list[str]) -> tuple[int, int] | None:
    """Structure of one EAP-IG Graph JSON; returns (edges, edges in_graph) or None when unusable."""
    if not isinstance(obj, dict) or not {"cfg", "nodes", "edges"} <= set(obj):
        problems.append(f"{path}: not an EAP-IG graph (needs keys cfg, nodes, edges)")
        return None
    cfg = obj["cfg"]
    try:
        L, H = int(cfg["n_layers"]), int(cfg["n_heads"])
    except (KeyError, TypeError, ValueError):
        problems.append(f"{path}: cfg needs integer n_layers and n_heads")
        return None
    n_in = 0
    for name, edge in obj["edges"].items():
        if not _EDGE.match(name):
            problems.append(f"{path}: edge name {name!r} is not of the form parent->child (EAP-IG names)")
            return None
        layers = [int(x) for x in re.findall(r"[am](\d+)", name)]
        heads = [int(x) for x in re.findall(r"\.h(\d+)", name)]
        if any(x >= L for x in layers) or any(x >= H for x in heads):
            problems.append(f"{path}: edge {name!r} is outside the cfg's {L} layers x {H} heads")
            return None
        score = edge.get("score") if isinstance(edge, dict) else None
        if not isinstance(edge, dict) or "in_graph" not in edge:
            problems.append(f"{path}: edge {name!r} needs in_graph (and a score)")
            return None
        if score is not None and not (isinstance(score, int | float) and math.isfinite(score)):
            problems.append(f"{path}: edge {name!r} has a non-finite score {score!r}")
            return None
        n_in += bool(edge["in_graph"])
    return len(obj["edges"]), n_in


def check_mib(folder: Path) -> list[str]:
    """Problems that would keep MIB from reading `folder` (empty list = it looks valid)."""
    folder = Path(folder)
    problems: list[str] = []
    if not folder.is_dir():
        return [f"{folder} is not a directory"]
    subs = [p for p in sorted(folder.iterdir()) if p.is_dir()]
    if not subs:
        return [f"{folder} has no <task>_<model> folder (e.g. ioi_gpt2)"]
    for sub in subs:
        task = next((t for t in MIB_TASKS if sub.name.startswith(t + "_")), None)
        if task is None:
            problems.append(f"{sub.name}: folder name must be <task>_<model> with task in {', '.join(MIB_TASKS)}")
            continue
        model = sub.name[len(task) + 1:]
        if model not in MIB_MODELS:
            problems.append(f"{sub.name}: model {model!r} is not one of MIB's ({', '.join(MIB_MODELS)}); the"
                            " leaderboard will not score it")
        files = sorted(sub.glob("*.json"))
        names = {f.stem for f in files}
        if "importances" in names:
            files = [sub / "importances.json"]
        else:
            missing = [share_name(s) for s in MIB_SHARES[:-1] if share_name(s) not in names]
            if missing:
                problems.append(f"{sub.name}: needs importances.json or one circuit per share; missing"
                                f" {', '.join(m + '.json' for m in missing)}")
                continue
        for f in files:
            try:
                obj = json.loads(f.read_text())
            except (OSError, ValueError) as err:
                problems.append(f"{f}: not readable JSON ({err})")
                continue
            counts = _check_graph(f, obj, problems)
            if counts is None or f.stem == "importances":
                continue
            n_edges, n_in = counts
            limit = int(float(f.stem) * n_edges + 1e-9)
            if n_in > limit:
                problems.append(f"{f}: {n_in} edges in_graph, more than int({f.stem} x {n_edges}) = {limit}")
    return problems


def export_main(argv: list[str]) -> int:
    """`circuitkit export SRC OUT --format mib --task T --model M` and `circuitkit export --check-mib DIR`."""
    parser = argparse.ArgumentParser(prog="circuitkit export --format mib",
                                     description="Write (or check) a folder for MIB's circuit-localization leaderboard.")
    parser.add_argument("src", nargs="?", help="scores.safetensors (edge level) or an edge-scope circuit.pt")
    parser.add_argument("out", nargs="?", help="output folder")
    parser.add_argument("--format", choices=("mib",), default="mib")
    parser.add_argument("--task", default="ioi", help=f"MIB task name ({', '.join(MIB_TASKS)})")
    parser.add_argument("--model", default=None, help=f"MIB model name ({', '.join(MIB_MODELS)})")
    parser.add_argument("--mib-mode", choices=("importances", "circuits"), default="importances")
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--check-mib", metavar="DIR", default=None, help="only validate a folder")
    args = parser.parse_args(argv)
    if args.check_mib:
        problems = check_mib(Path(args.check_mib))
        for p in problems:
            print(f"problem: {p}")
        print(f"{args.check_mib}: " + ("ready for MIB" if not problems else f"{len(problems)} problem(s)"))
        return 0 if not problems else 1
    # The command's arguments are checked before anything is read or written (exit 2).
    if not args.src or not args.out or not args.model:
        raise MIBError("circuitkit export --format mib needs SRC OUT --model NAME (e.g. --model gpt2), or"
                       " --check-mib DIR.", exit_code=2)
    if args.task not in MIB_TASKS:
        raise MIBError(f"--task {args.task!r} is not a MIB task; use one of {', '.join(MIB_TASKS)}.", exit_code=2)
    if not Path(args.src).is_file():
        raise MIBError(f"{args.src} {'is a directory' if Path(args.src).is_dir() else 'does not exist'}; give a"
                       " scores.safetensors (edge level) or an edge circuit.pt.", exit_code=2)
    check_writable(Path(args.out) / f"{args.task}_{args.model}", "the output folder", directory=True)
    written = export_mib(Path(args.src), Path(args.out), args.task, args.model, args.mib_mode, args.d_model)
    problems = check_mib(Path(args.out))
    print(f"wrote {len(written)} file(s) under {Path(args.out) / f'{args.task}_{args.model}'}"
          + ("" if not problems else f"; check: {'; '.join(problems)}"))
    return 0
