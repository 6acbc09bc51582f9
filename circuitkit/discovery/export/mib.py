"""MIB (the Mechanistic Interpretability Benchmark) circuit-localization track: export and check.

MIB's metrics, as its evaluation code defines them (`evaluate_area_under_curve` of
hannamw/MIB-circuit-track and of the leaderboard's driver mttk/MIB-circuit-track-autoeval): at
each share x of MIB's grid (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100 % of the edges) keep the
int(x · n_edges) top-ranked edges, patch every other edge with the corrupted run's value
(counterfactual ablation), and measure

    f(x) = (m(circuit) - m(empty)) / (m(model) - m(empty))     m: the task metric (IOI: logit difference)
    CPR  = Σ_i (x_{i+1} - x_i) (f_i + f_{i+1}) / 2             area under f, higher is better
    CMD  = Σ_i (x_{i+1} - x_i) (|1 - f_i| + |1 - f_{i+1}|) / 2  area between f and 1, lower is better

on a linear axis over x in [0.001, 1] (so f = 1 everywhere gives CPR 0.999, CMD 0). The
leaderboard evaluates an importances file twice (autoeval `eval_submissions.py`, `for absolute
in (True, False)`): the curve with edges ranked by **signed** score (`apply_topn(absolute=False)`)
gives its **CPR**, the one ranked by **|score|** (`absolute=True`) its **CMD**.

CircuitKit's pruning stage computes that pair at `pruning.scope=edges pruning.ablation=corrupted
pruning.selection=top_k` (either `rank_by`): circuit.pt's `mib` holds CPR from the signed
ranking's curve and CMD from the |score| one, both curves, and `curve_definition` states them
(`circuitkit.discovery.pruning.heads.mib_pair`). Its `cpr`/`cmd` are both areas of the run's own
`rank_by` curve. The head-level curve (`pruning.scope=heads`) uses the same grid and formulas over
heads instead of edges: it is not MIB's number, and says so.

`circuitkit export SRC OUT --format mib` writes the folder MIB's leaderboard takes, named as
MIB's own `run_attribution.py` names it, f"{task.replace('_', '-')}_{model}":

    OUT/<task>_<model>/importances.json          (--mib-mode importances, default): every edge with
                                                  its score (EAP-IG's Graph JSON, all in_graph);
                                                  MIB ranks it itself, both ways
    OUT/<task>_<model>/<share>.json               (--mib-mode circuits): one Graph JSON per share of
                                                  MIB's grid below 100 %, the top int(share · n)
                                                  edges by |score| in_graph, n counted in EAP-IG's
                                                  edges (a GQA key/value edge is one per query head);
                                                  MIB scores these 9 circuits for CPR and CMD alike

The nodes carry no `score`, as in MIB's own edge-level importances (its `run_attribution.py`
builds the graph with `node_scores=(level == 'node')`): MIB ranks edges, and the reference's
`Graph.to_json` can then save the file again. `cfg` records the analysed model's name (never a
local path) and its weights' sha256 (`interop.model_provenance`).

Node and edge names are EAP-IG's (`circuitkit.discovery.export.interop`: GQA key/value edges are
split evenly over a KV group's query heads). `circuitkit export --check-mib OUT` validates a
folder before upload, as MIB's code reads it: each folder name through MIB's matcher (`mib_match`,
the autoeval's), the (task, model) pair among the 12 it scores, the result name its aggregation
can split, the file count (1 file = importances, 2 or more = circuits), JSON structure, edge
names over the graph `cfg` describes, finite scores, and in circuit files at most int(share · n)
edges in_graph.
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
from circuitkit.core.flags import MAX_COUNT, bounded, check_numeric_flags
from circuitkit.core.io import atomic_write_bytes, check_writable
from circuitkit.discovery.attribution import load_scores
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import load_circuit
from circuitkit.discovery.pruning.heads import CURVE_PERCENTS, curve_count

MIB_SHARES = tuple(p / 100 for p in CURVE_PERCENTS)  # 0.001 .. 1

# MIB's names as its code spells them. Tasks: the keys of TASKS_TO_HF_NAMES and the README's TASKS
# (hannamw/MIB-circuit-track MIB_circuit_track/utils.py); models: the keys of MODEL_NAME_TO_FULLNAME
# (same file, and the leaderboard's copy, mttk/MIB-circuit-track-autoeval MIB_circuit_track/utils.py).
MIB_TASKS = ("ioi", "mcqa", "arithmetic_addition", "arithmetic_subtraction", "arc_easy", "arc_challenge")
MIB_MODELS = ("gpt2", "qwen2.5", "gemma2", "llama3")
# hannamw's scripts also run `interpbench` (a special case of run_attribution.py); the leaderboard does
# not score it: its run_evaluation.py compares an interpbench graph with the reference graph
# mib-bench/interpbench interpbench_graph.json (evaluate_area_under_roc: TPR/FPR/precision/recall).
MIB_UNSCORED_MODELS = ("interpbench",)
# The (task, model) pairs MIB scores: the keys of COL_MAPPING (hannamw MIB_circuit_track/utils.py; the
# autoeval's run_evaluation returns None for any other pair).
MIB_SCORED = ("ioi_gpt2", "ioi_qwen2.5", "ioi_gemma2", "ioi_llama3", "mcqa_qwen2.5", "mcqa_gemma2", "mcqa_llama3",
              "arithmetic-addition_llama3", "arithmetic-subtraction_llama3", "arc-easy_gemma2", "arc-easy_llama3",
              "arc-challenge_llama3")
# The autoeval matcher's task keys (its TASKS_TO_HF_NAMES, in order): both spellings.
_MATCH_TASKS = ("ioi", "mcqa", "arithmetic_addition", "arithmetic-addition", "arithmetic_subtraction",
                "arithmetic-subtraction", "arc_easy", "arc-easy", "arc_challenge", "arc-challenge")
_EDGE = re.compile(r"^(input|a\d+\.h\d+|m\d+)->(a\d+\.h\d+<[qkv]>|m\d+|logits)$")
_PT_KEYS = {"cfg", "src_nodes", "dst_nodes", "edges_scores", "edges_in_graph", "nodes_in_graph"}
NODE_SCORES_NOTE = ("omitted: MIB ranks edges, and its own edge-level importances carry no node scores"
                    " (run_attribution.py: node_scores only at level node)")


class MIBError(UserError, ValueError):
    """A MIB folder or export request that cannot be honoured (the message says what to change)."""


def mib_task(name: str) -> str:
    """MIB's task for `name` in either spelling (arithmetic_addition or arithmetic-addition), underscored."""
    task = name.strip().lower().replace("-", "_")
    if task not in MIB_TASKS:
        raise MIBError(f"--task {name!r} is not a MIB task; use one of"
                       f" {', '.join(t.replace('_', '-') for t in MIB_TASKS)} (or the same with _).", exit_code=2)
    return task


def mib_folder_name(task: str, model: str) -> str:
    """The folder MIB's run_attribution.py writes for (task, model): f"{task.replace('_', '-')}_{model}"."""
    return f"{mib_task(task).replace('_', '-')}_{model}"


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def suggest_model(model: str) -> str | None:
    """MIB's spelling of a near miss (qwen2_5, Qwen2.5, llama-3 -> qwen2.5, qwen2.5, llama3), else None."""
    return next((m for m in (*MIB_MODELS, *MIB_UNSCORED_MODELS) if _plain(m) == _plain(model) and m != model), None)


def mib_match(name: str) -> tuple[str | None, str | None]:
    """(task key, model key) the leaderboard's folder matcher finds in a folder name (autoeval
    eval_submissions.py: a key matches when the name starts with it or contains "_" + key; the last
    matching key wins). None where nothing matches (MIB then skips the folder)."""
    task = model = None
    for key in _MATCH_TASKS:
        if name.startswith(key) or f"_{key}" in name:
            task = key
    for key in MIB_MODELS:
        if name.startswith(key) or f"_{key}" in name:
            model = key
    return task, model


def share_name(share: float) -> str:
    """File stem of a circuit at `share` (0.001 -> '0.001')."""
    return f"{share:g}"


def _scores_and_graph(src: Path) -> tuple[torch.Tensor, Graph, dict[str, Any]]:
    """Edge scores (n_up, n_down), the graph and what `cfg` records from a scores.safetensors or an edge circuit.pt."""
    from circuitkit.discovery.export.interop import _run_model_cfg, model_provenance

    if src.suffix == ".safetensors":
        s = load_scores(src)
        if s.edges is None:
            raise MIBError(f"{src} holds node scores only; MIB ranks edges: run attribution with discovery.level=edge.")
        from safetensors import safe_open
        with safe_open(str(src), framework="pt") as fh:
            meta = fh.metadata() or {}
        name = meta.get("model")
        return s.edges, s.graph, {"model": name, "d_model": None,
                                  **model_provenance(name, _run_model_cfg(src.parent), src.parent)}
    c = load_circuit(src)
    if c.get("edge_scores") is None:
        raise MIBError(f"{src} has no edge scores; MIB ranks edges: prune a run with discovery.level=edge.")
    from circuitkit.discovery.circuit_graph import graph_shape
    model_cfg = (c.get("config") or {}).get("model") or {}
    if not model_cfg.get("revision") and c.get("model_revision"):
        model_cfg = {**model_cfg, "revision": c.get("model_revision")}
    return c["edge_scores"], graph_shape(c), {"model": c.get("model_name"), "d_model": c.get("d_model"),
                                              **model_provenance(c.get("model_name"), model_cfg, src.parent)}


def export_mib(src: Path, out_dir: Path, task: str, model: str, mode: str = "importances",
               d_model: int | None = None) -> list[Path]:
    """Write MIB's submission folder for one task/model from edge scores (see the module docstring)."""
    from circuitkit.discovery.export.interop import _d_model, to_eap_ig

    scores, g, info = _scores_and_graph(Path(src))
    d = _d_model(d_model, info.pop("d_model"), info.pop("model"))
    folder = Path(out_dir) / mib_folder_name(task, model)
    valid = g.edge_mask()
    in_graph = {n: True for n in g.upstream}
    zeros_h, zeros_m = torch.zeros(g.n_layers, g.n_heads), torch.zeros(g.n_layers)
    extra = {**info, "mib_task": mib_task(task), "mib_model": model, "node_scores": NODE_SCORES_NOTE,
             "source": "circuitkit export --format mib"}
    written = []
    obj = to_eap_ig(g, d, zeros_h, zeros_m, 0.0, scores, in_graph, valid, extra, node_scores=False)
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


def _check_graph(path: Path, obj: Any, problems: list[str], need_score: bool = True) -> tuple[int, int] | None:
    """Structure of one EAP-IG Graph JSON; returns (edges, edges in_graph) or None when unusable.
    `need_score`: EAP-IG's from_json (importances) needs every edge's score; MIB's loader of circuit
    files (autoeval circuit_loading.load_graph_from_json) reads a missing one as 0."""
    if not isinstance(obj, dict) or not {"cfg", "nodes", "edges"} <= set(obj):
        problems.append(f"{path}: not an EAP-IG graph (needs keys cfg, nodes, edges)")
        return None
    cfg = obj["cfg"]
    try:
        L, H = int(cfg["n_layers"]), int(cfg["n_heads"])
    except (KeyError, TypeError, ValueError):
        problems.append(f"{path}: cfg needs integer n_layers and n_heads")
        return None
    if "d_model" not in cfg:
        problems.append(f"{path}: cfg needs d_model (EAP-IG's Graph.from_json builds the graph from it)")
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
        if not isinstance(edge, dict) or "in_graph" not in edge or (need_score and "score" not in edge):
            problems.append(f"{path}: edge {name!r} needs score and in_graph (EAP-IG's from_json reads both)")
            return None
        score = edge.get("score", 0.0)
        if not (isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score)):
            problems.append(f"{path}: edge {name!r} has a score that is not a finite number ({score!r})")
            return None
        n_in += bool(edge["in_graph"])
    return len(obj["edges"]), n_in


def check_name(name: str) -> list[str]:
    """Problems with one folder name as MIB's leaderboard reads it (empty = it is scored as named)."""
    if any(_plain(m) in _plain(name) for m in MIB_UNSCORED_MODELS):
        return [f"{name}: interpbench is not scored by the leaderboard (it matches no model there);"
                " hannamw/MIB-circuit-track's run_evaluation.py compares an interpbench graph with the reference"
                " graph mib-bench/interpbench interpbench_graph.json (ROC points), not CPR/CMD"]
    task, model = mib_match(name)
    if task is None or model is None:
        guess_task = tail = None
        for t in sorted(MIB_TASKS, key=len, reverse=True):  # either spelling, any case: IOI_gpt2, arc_easy_gemma2
            if name.lower().replace("-", "_").startswith(t + "_"):
                guess_task, tail = t.replace("_", "-"), name[len(t) + 1:]
                break
        guess_model = None if tail is None else tail if tail in MIB_MODELS else suggest_model(tail)
        hint = (f"; name it {guess_task}_{guess_model}" if guess_task and guess_model else "")
        missing = "task" if task is None else "model"
        allowed = (", ".join(t.replace("_", "-") for t in MIB_TASKS) if task is None else ", ".join(MIB_MODELS))
        return [f"{name}: MIB's folder matcher finds no {missing} in this name and skips the folder (folder"
                f" names are <task>_<model>, {missing} one of {allowed}){hint}"]
    problems = []
    if "_" in task:
        problems.append(f"{name}: MIB's aggregation splits its result name {task}_{model}_test_abs-True.pkl on '_'"
                        f" and fails on task {task}; name it {name.replace(task, task.replace('_', '-'), 1)}")
    lowered = mib_match(name.lower())
    others = [t for t in _MATCH_TASKS if (name.startswith(t) or f"_{t}" in name) and _plain(t) != _plain(task)]
    others += [m for m in MIB_MODELS if (name.startswith(m) or f"_{m}" in name) and m != model]
    if others or lowered != (task, model):
        problems.append(f"{name}: matches more than one MIB task or model ({', '.join([task, model, *others])});"
                        " MIB's matcher versions pick differently: name it <task>_<model> alone")
    pair = f"{task.replace('_', '-')}_{model}"
    if pair not in MIB_SCORED:
        problems.append(f"{name}: the leaderboard does not score {pair} (MIB's run_evaluation returns no result"
                        f" for it); it scores {', '.join(MIB_SCORED)}")
    return problems


def _check_files(sub: Path, problems: list[str]) -> None:
    """The files MIB reads in one folder (it downloads *.json and *.pt): 1 = importances, 2..9 = circuits."""
    files = sorted(f for f in sub.iterdir() if f.is_file() and f.suffix in (".json", ".pt"))
    if not files:
        problems.append(f"{sub.name}: no .json or .pt file (MIB reads importances.json, or one circuit per share)")
        return
    if len(files) > 1 and any(f.stem == "importances" for f in files):
        problems.append(f"{sub.name}: MIB reads a folder of 2 or more files as circuits (the first 9 it lists),"
                        " so importances.json would count as one circuit with every edge in_graph: keep"
                        " importances.json alone in its folder")
        return
    if len(files) > 1:
        names = {f.stem for f in files}
        missing = [share_name(s) for s in MIB_SHARES[:-1] if share_name(s) not in names]
        if missing:
            problems.append(f"{sub.name}: needs importances.json or one circuit per share; missing"
                            f" {', '.join(m + '.json' for m in missing)}")
            return
        if len(files) != len(MIB_SHARES) - 1:
            problems.append(f"{sub.name}: {len(files)} files; MIB reads at most 9 circuits (one per share"
                            " 0.1%..50%), taken in directory order")
    for f in files:
        if f.suffix == ".pt":
            try:
                obj = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - any failure to read it is the problem to report
                problems.append(f"{f}: not readable with torch.load(weights_only=True) ({type(err).__name__})")
                continue
            if not isinstance(obj, dict) or not _PT_KEYS <= set(obj):
                problems.append(f"{f}: not an EAP-IG Graph.to_pt file (needs keys {', '.join(sorted(_PT_KEYS))})")
            continue
        try:
            obj = json.loads(f.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{f}: not readable JSON ({err})")
            continue
        counts = _check_graph(f, obj, problems, need_score=len(files) == 1)
        if counts is None or len(files) == 1:
            continue
        n_edges, n_in = counts
        limit = int(float(f.stem) * n_edges + 1e-9)
        if n_in > limit:
            problems.append(f"{f}: {n_in} edges in_graph, more than int({f.stem} x {n_edges}) = {limit}")


def check_mib(folder: Path) -> list[str]:
    """Problems that would keep MIB's leaderboard from scoring `folder` (empty list = it looks valid)."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a directory"]
    subs = [p for p in sorted(folder.iterdir()) if p.is_dir()]
    if not subs:
        return [f"{folder} has no <task>_<model> folder (e.g. ioi_gpt2)"]
    problems: list[str] = []
    for sub in subs:
        named = check_name(sub.name)
        problems += named
        if not any("skips the folder" in p or "interpbench" in p for p in named):
            _check_files(sub, problems)
    return problems


def mib_notes(folder: Path) -> list[str]:
    """What MIB's README asks of a whole submission beyond each folder: at least 2 models and 2 tasks."""
    pairs = [mib_match(p.name) for p in sorted(Path(folder).iterdir()) if p.is_dir()] if Path(folder).is_dir() else []
    scored = [(t, m) for t, m in pairs if t and m and f"{t.replace('_', '-')}_{m}" in MIB_SCORED]
    tasks, models = {t.replace("_", "-") for t, _ in scored}, {m for _, m in scored}
    if len(tasks) >= 2 and len(models) >= 2:
        return []
    return [f"MIB's README asks a submission to cover at least 2 models and 2 tasks; this folder has"
            f" {len(models)} model(s) and {len(tasks)} task(s) it scores (fine for one part of a submission)"]


def export_parser() -> argparse.ArgumentParser:
    """The arguments of `circuitkit export --format mib` (numeric ones with their ranges)."""
    parser = argparse.ArgumentParser(prog="circuitkit export --format mib",
                                     description="Write (or check) a folder for MIB's circuit-localization leaderboard.")
    parser.add_argument("src", nargs="?", help="scores.safetensors (edge level) or an edge-scope circuit.pt")
    parser.add_argument("out", nargs="?", help="output folder")
    parser.add_argument("--format", choices=("mib",), default="mib")
    parser.add_argument("--task", default="ioi", help="MIB task name ("
                        + ", ".join(t.replace("_", "-") for t in MIB_TASKS) + "; _ is accepted for -)")
    parser.add_argument("--model", default=None, help=f"MIB model name ({', '.join(MIB_MODELS)})")
    parser.add_argument("--mib-mode", choices=("importances", "circuits"), default="importances",
                        help="importances: every edge's score, MIB ranks it both ways (CPR signed, CMD |score|);"
                             " circuits: 9 files of top edges by |score|, which MIB scores for CPR and CMD alike")
    bounded(parser.add_argument("--d-model", type=int, default=None, help="residual width, if the file cannot"
                                " tell"), ge=1, le=MAX_COUNT)
    parser.add_argument("--check-mib", metavar="DIR", default=None, help="only validate a folder")
    return parser


def export_main(argv: list[str]) -> int:
    """`circuitkit export SRC OUT --format mib --task T --model M` and `circuitkit export --check-mib DIR`."""
    parser = export_parser()
    args = parser.parse_args(argv)
    check_numeric_flags(parser, args)
    if args.check_mib:
        if not Path(args.check_mib).is_dir():
            what = "is a file" if Path(args.check_mib).exists() else "does not exist"
            raise MIBError(f"--check-mib {args.check_mib} {what}; give the submission folder (it holds"
                           " <task>_<model>/ folders).", exit_code=2)
        problems = check_mib(Path(args.check_mib))
        for p in problems:
            print(f"problem: {p}")
        for note in mib_notes(Path(args.check_mib)) if not problems else []:
            print(f"note: {note}")
        print(f"{args.check_mib}: " + ("ready for MIB" if not problems else
                                       f"not ready for MIB: {len(problems)} problem(s), listed above"))
        return 0 if not problems else 1
    # The command's arguments are checked before anything is read or written (exit 2).
    if not args.src or not args.out or not args.model:
        raise MIBError("circuitkit export --format mib needs SRC OUT --model NAME (e.g. --model gpt2), or"
                       " --check-mib DIR.", exit_code=2)
    folder_name = mib_folder_name(args.task, args.model)  # MIBError (exit 2) for a task MIB does not have
    near = suggest_model(args.model)
    if near is not None and args.model not in MIB_UNSCORED_MODELS:
        raise MIBError(f"--model {args.model!r}: MIB spells it {near!r} (its folder would be"
                       f" {mib_folder_name(args.task, near)}); use --model {near}.", exit_code=2)
    if args.model not in (*MIB_MODELS, *MIB_UNSCORED_MODELS):
        raise MIBError(f"--model {args.model!r} is not a MIB model name, and MIB's folder matcher would skip"
                       f" {folder_name}; use one of {', '.join(MIB_MODELS)}.", exit_code=2)
    if not Path(args.src).is_file():
        raise MIBError(f"{args.src} {'is a directory' if Path(args.src).is_dir() else 'does not exist'}; give a"
                       " scores.safetensors (edge level) or an edge circuit.pt.", exit_code=2)
    check_writable(Path(args.out) / folder_name, "the output folder", directory=True)
    written = export_mib(Path(args.src), Path(args.out), args.task, args.model, args.mib_mode, args.d_model)
    problems = check_name(folder_name)
    files: list[str] = []
    _check_files(Path(args.out) / folder_name, files)
    print(f"wrote {len(written)} file(s) under {Path(args.out) / folder_name}"
          + ("" if not problems + files else f"; check: {'; '.join(problems + files)}"))
    return 0
