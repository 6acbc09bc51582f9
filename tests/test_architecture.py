"""The import graph of `circuitkit/`, `gradian/` and `circuitkit_app/` forms the stack of docs/architecture.md.

Parsed with `ast` (nothing is imported), every import counts, at module top or inside a
function: a function-level import is still a dependency, only a later one. Layers, bottom up:

    core     runner core: config, pipeline, manifest, fingerprints, device, io, errors
    models   loading, adapters, hooks, fixtures, model shapes; HF module names only in models/families/
    circuit  circuit discovery and pruning: tasks, attribution, pruning, circuit.pt, its stages
    gradian  gradient indexing and ranking, its stage and memory estimate
    entry    the list of stages, run.py, cli.py, api.py, smart.py, merge.py (circuitkit_app/), gradian/cli.py

Rules: no cycles; imports point down only (the two domains are one level, and may not import
each other; circuit.pt's format, `circuitkit.core.circuit_file`, sits in the core, below both).
The top-level folders stack the same way, bottom up: circuitkit/ (core, models, circuit),
gradian/ (builds on circuitkit's core and models), circuitkit_app/ (knows both). A module imports only
from its own folder and the folders below; the one exception is the names users type
(`python -m circuitkit.run`, `python -m circuitkit.cli`, `circuitkit.discover_circuit`), shims
in circuitkit/ that hand over to circuitkit_app/ and hold nothing else.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("circuitkit", "gradian", "circuitkit_app")

CORE, MODELS, CIRCUIT, GRADIAN, ENTRY = "core", "models", "circuit", "gradian", "entry"
RANK = {CORE: 0, MODELS: 1, CIRCUIT: 2, GRADIAN: 2, ENTRY: 3}

# Every module, placed. A new module gets a line here (the test below fails until it does).
LAYERS: dict[str, str] = {
    # runner core
    "circuitkit.core": CORE,
    "circuitkit.core.config": CORE,  # the config machinery: field metadata, validation, Hydra's compose, schema flags
    "circuitkit.core.errors": CORE,
    "circuitkit.core.hub": CORE,  # is the Hugging Face hub reachable (asked once; offline mode on when not)
    "circuitkit.core.io": CORE,
    "circuitkit.core.device": CORE,
    "circuitkit.core.syncs": CORE,  # counts the calls that would make the host wait for an accelerator
    "circuitkit.core.progress": CORE,  # a bar on a terminal, a plain line every few seconds in a log
    "circuitkit.core.provenance": CORE,  # which CircuitKit made an artifact: version, git commit
    "circuitkit.core.flags": CORE,  # numeric CLI options with their ranges, checked after parsing
    "circuitkit.core.fingerprint": CORE,
    "circuitkit.core.batching": CORE,  # length-aware batch plans, for the index and for attribution
    "circuitkit.core.pipeline": CORE,
    "circuitkit.core.sweep": CORE,
    "circuitkit.core.circuit_file": CORE,
    "circuitkit.core.recorded": CORE,  # a directory's recorded files: confined to it, read through their sha256  # circuit.pt: the Circuit type, its writer and reader (both domains read it)
    # models: loading, adapters, hooks, fixtures, the model's shape and memory terms
    "circuitkit.models": MODELS,
    "circuitkit.models.config": MODELS,  # the model group's schema (model.*), its placement rule
    "circuitkit.models.adapters": MODELS,
    # one module per architecture family (the only code with HF module names) and their registry
    "circuitkit.models.families": MODELS,
    "circuitkit.models.families.base": MODELS,
    "circuitkit.models.families.gpt2": MODELS,
    "circuitkit.models.families.gpt_neox": MODELS,
    "circuitkit.models.families.llama": MODELS,
    "circuitkit.models.families.gemma3": MODELS,
    "circuitkit.models.families.qwen3": MODELS,
    "circuitkit.models.families.qwen3_moe": MODELS,
    "circuitkit.models.hooks": MODELS,
    "circuitkit.models.loading": MODELS,
    "circuitkit.models.placement": MODELS,  # model.device_map: input device, offloaded weights made resident
    "circuitkit.models.device_shares": MODELS,  # model.device_map: each device's share of an estimate
    "circuitkit.fixtures": MODELS,
    "circuitkit.fixtures.cache": MODELS,
    "circuitkit.fixtures.models": MODELS,
    "circuitkit.fixtures.induction": MODELS,
    "circuitkit.fixtures.gguf": MODELS,  # tiny GGUF files written from a fixture
    "circuitkit.models.gguf": MODELS,  # GGUF files as a model source (header, provenance, conversion)
    "circuitkit.models.fetch": MODELS,  # `circuitkit fetch`: real models shipped in PyPI wheels
    "circuitkit.models.linear_modules": MODELS,
    "circuitkit.models.lora": MODELS,  # model.adapter: PEFT LoRA adapters (the one module that imports peft)
    "circuitkit.models.recompute": MODELS,  # activations recomputed in the backward (exact)
    "circuitkit.preflight": MODELS,  # the preflight room: model shapes, memory terms, the stage
    "circuitkit.preflight.config": MODELS,  # the preflight group's schema
    "circuitkit.preflight.memory": MODELS,  # reads model shapes (HF config.json); the generic memory terms
    "circuitkit.preflight.stage": MODELS,  # sums the estimates the stages declare; imports no domain
    # circuit discovery and pruning
    "circuitkit.discovery": CIRCUIT,
    "circuitkit.discovery.config": CIRCUIT,  # discovery's schemas (discovery, data_params, pruning, export), their rules
    "circuitkit.discovery.pruning": CIRCUIT,
    "circuitkit.discovery.export": CIRCUIT,
    "circuitkit.discovery.tasks": CIRCUIT,
    "circuitkit.discovery.attribution.checks": CIRCUIT,  # artifacts checked against the model and graph they are used with
    "circuitkit.discovery.tasks.base": CIRCUIT,
    "circuitkit.discovery.tasks.corruption_sets": CIRCUIT,  # one task's pairs under several corruptions
    "circuitkit.discovery.tasks.greater_than": CIRCUIT,
    "circuitkit.discovery.tasks.induction": CIRCUIT,
    "circuitkit.discovery.tasks.ioi": CIRCUIT,
    "circuitkit.discovery.tasks.jsonl": CIRCUIT,
    "circuitkit.discovery.tasks.mmlu": CIRCUIT,
    "circuitkit.discovery.tasks.text": CIRCUIT,
    "circuitkit.discovery.tasks.sva": CIRCUIT,  # subject-verb agreement across an attractor
    "circuitkit.discovery.pruning.pillars": CIRCUIT,  # the verdict: baselines, necessity, robustness, ...
    "circuitkit.discovery.pruning.verdict": CIRCUIT,  # the pillars measured on the pruning stage's circuit
    "circuitkit.discovery.tasks.corruptions": CIRCUIT,  # corrupted prompts generated for a jsonl task
    "circuitkit.discovery.tasks.capitals": CIRCUIT,  # factual recall: capital cities
    "circuitkit.discovery.attribution": CIRCUIT,
    "circuitkit.discovery.attribution.eap": CIRCUIT,
    "circuitkit.discovery.attribution.exact": CIRCUIT,
    "circuitkit.discovery.attribution.graph": CIRCUIT,
    "circuitkit.discovery.attribution.metrics": CIRCUIT,
    "circuitkit.discovery.attribution.accumulators": CIRCUIT,
    "circuitkit.discovery.attribution.corruptions": CIRCUIT,  # several corruptions: their scores combined
    "circuitkit.discovery.attribution.norms": CIRCUIT,
    "circuitkit.discovery.attribution.quadrature": CIRCUIT,
    "circuitkit.discovery.attribution.tradeoffs": CIRCUIT,
    "circuitkit.discovery.attribution.memory": CIRCUIT,
    "circuitkit.discovery.attribution.shards": CIRCUIT,  # sharded attribution: partial sums, the merge
    "circuitkit.discovery.pruning.heads": CIRCUIT,
    "circuitkit.discovery.pruning.circuit_forward": CIRCUIT,
    "circuitkit.discovery.pruning.corruptions": CIRCUIT,  # several corruptions: faithfulness folded over them
    "circuitkit.discovery.pruning.evaluator": CIRCUIT,  # head circuits measured, faithfulness and the curve
    "circuitkit.discovery.pruning.edges": CIRCUIT,
    "circuitkit.discovery.pruning.selection": CIRCUIT,  # keep_top, bootstrapped selection, the greedy oracle
    "circuitkit.discovery.pruning.selection_ip": CIRCUIT,  # pruning.selection=ip: a connected edge set by integer programming
    "circuitkit.discovery.pruning.memory": CIRCUIT,  # the pruning stage's memory estimate (the curve, edge records, edge_pruning)
    "circuitkit.discovery.pruning.optimize": CIRCUIT,  # selection=edge_pruning: a mask warm-started from the scores
    "circuitkit.discovery.pruning.stability": CIRCUIT,  # Jaccard of the kept set over resamples of the examples
    "circuitkit.discovery.export.mib": CIRCUIT,  # MIB's metrics, export and folder check
    "circuitkit.discovery.attribution.eap_activations": CIRCUIT,
    "circuitkit.discovery.attribution.eap_gp": CIRCUIT,  # EAP-IG along a gradient-guided path (GradPath)
    "circuitkit.discovery.attribution.acdc": CIRCUIT,  # ACDC: iterative edge removal by patching
    "circuitkit.discovery.circuit": CIRCUIT,
    "circuitkit.discovery.circuit_graph": CIRCUIT,
    "circuitkit.discovery.plots": CIRCUIT,
    "circuitkit.discovery.export.interop": CIRCUIT,
    "circuitkit.discovery.export.hf": CIRCUIT,  # the pruned Hugging Face checkpoint
    "circuitkit.discovery.export.hf_stage": CIRCUIT,  # the export stage
    "circuitkit.discovery.stages": CIRCUIT,
    "circuitkit.discovery.data_lengths": CIRCUIT,  # the stages' estimates at the tokenized prompts (the preflight)
    # gradian: its rooms, bottom up (GRADIAN_ROOMS below orders them)
    "gradian": GRADIAN,
    "gradian.stage": GRADIAN,  # the grads stage (a loose module: the index built from the pipeline)
    "gradian.doctor": GRADIAN,  # `gradian doctor`: installed extras, a batch-invariance self-test
    # settings: the schemas every room reads (grads.*, attribute.*)
    "gradian.settings": GRADIAN,
    "gradian.settings.grads": GRADIAN,  # the grads group's schema and its rules
    "gradian.settings.attribute": GRADIAN,  # the attribute stage's schema: the one list of query losses and engines
    # data: where rows come from, their tokens and supervised mask, the corpus
    "gradian.data": GRADIAN,
    "gradian.data.sources": GRADIAN,
    "gradian.data.encode": GRADIAN,  # one row's tokens and supervised mask (prompt/completion, chat), truncation
    "gradian.data.rows": GRADIAN,  # rows read under the token policy, the data report
    "gradian.data.batch": GRADIAN,  # rows collated with their supervision (host, collate time), sent to the device
    "gradian.data.corpus": GRADIAN,
    # projection: the random (and stored) projections of each module's gradient
    "gradian.projection": GRADIAN,
    "gradian.projection.projector": GRADIAN,
    # capture: per-example gradients on the supervised tokens, the loss, circuit sites
    "gradian.capture": GRADIAN,
    "gradian.capture.gradients": GRADIAN,
    "gradian.capture.hooks": GRADIAN,  # one hook per module: its projected (input, output-gradient) pair, handed on
    "gradian.capture.consumers": GRADIAN,  # what takes the pairs: the rows, the sampled-label rows
    "gradian.capture.sites": GRADIAN,  # circuit-restricted indexing: the weights a circuit's components write through
    # curvature: factor sums, module second moments, whitening, width allocation
    "gradian.curvature": GRADIAN,
    "gradian.curvature.factors": GRADIAN,  # K-FAC factor sums and their shard checks
    "gradian.curvature.consumers": GRADIAN,  # the capture's consumer that feeds the K-FAC factor sums
    "gradian.curvature.moments": GRADIAN,  # grads.preconditioner=module: per-module second moments
    "gradian.curvature.whitening": GRADIAN,  # the whitened projection's factor pass and its stored matrices
    "gradian.curvature.allocation": GRADIAN,  # grads.width_allocation=spectrum: per-module widths
    # index: the header, the shard store (writer, reader, verify), the row formats, the curvature file
    "gradian.index": GRADIAN,
    "gradian.index.header": GRADIAN,  # the typed index header (IndexHeader), its writer and reader
    "gradian.index.manifest": GRADIAN,  # manifest.json read and checked, the format version, shard names
    "gradian.index.writer": GRADIAN,  # shards written atomically with their sha256, the manifest under a lock
    "gradian.index.reader": GRADIAN,  # shards read and checked, streamed; verify
    "gradian.index.curvature": GRADIAN,  # curvature.safetensors from the shards, checked; the K-FAC preconditioner
    "gradian.index.formats": GRADIAN,  # the row formats' registry: format_of(manifest), format_for(grads)
    "gradian.index.formats.base": GRADIAN,  # the row-format interface (RowFormat): pack, norms, scorer, refusals
    "gradian.index.formats.dense": GRADIAN,  # grads.row_format=dense: each module's block as it is
    "gradian.index.formats.factored": GRADIAN,  # grads.row_format=factored: rank-c factors of each block
    "gradian.index.formats.signs": GRADIAN,  # grads.row_format=signs: one bit per coordinate, Hamming scores
    # build: the index loop, its checks, its memory estimate, the width table
    "gradian.build": GRADIAN,
    "gradian.build.indexer": GRADIAN,  # the index loop: batches, consumers, shards, resume
    "gradian.build.checks": GRADIAN,  # before the loop: the data source, the settings, one shard's host memory
    "gradian.build.shard_rows": GRADIAN,  # rows leave the device in their stored form; a writer thread owns the disk
    "gradian.build.device_batch": GRADIAN,  # batches sized to the accelerator's free memory (grads.device_batch)
    "gradian.build.memory": GRADIAN,
    "gradian.build.width_table": GRADIAN,  # the preflight's width line: disk per width and what each measured
    # rank: scores, compatibility checks, queries, results
    "gradian.rank": GRADIAN,
    "gradian.rank.ranking": GRADIAN,  # `gradian rank`: the steps in order
    "gradian.rank.scores": GRADIAN,  # the scores streamed over the shards, the running top-k
    "gradian.rank.checks": GRADIAN,  # a query against an index: weights, tokenizer, adapter, projection, policy, circuit
    "gradian.rank.queries": GRADIAN,  # the query rows' gradients, computed as the index's rows were
    "gradian.rank.results": GRADIAN,  # the ranked rows' lines and previews
    "gradian.rank.tokens": GRADIAN,  # `gradian inspect --row`: one indexed row's tokens and supervised mask
    "gradian.rank.checksum_flag": GRADIAN,  # --skip-checksums (once --no-verify) of rank and attribute
    # `gradian diagnose`: checks of a fine-tuning set, its trainer settings and logs (tokenizer only)
    "gradian.diagnose": GRADIAN,
    "gradian.diagnose.finding": GRADIAN,
    "gradian.diagnose.rows": GRADIAN,
    "gradian.diagnose.similar": GRADIAN,
    "gradian.diagnose.checks_data": GRADIAN,
    "gradian.diagnose.checks_config": GRADIAN,
    "gradian.diagnose.checks_log": GRADIAN,
    # `gradian attribute`: which training rows broke a behaviour (evaluation, queries, engines, clusters)
    "gradian.attribute": GRADIAN,
    "gradian.attribute.evaluate": GRADIAN,
    "gradian.attribute.regression": GRADIAN,
    "gradian.attribute.precision": GRADIAN,  # --precision: the eval's dtype, near-ties of the flipped items
    "gradian.attribute.queries": GRADIAN,
    "gradian.attribute.datainf": GRADIAN,  # DataInf: each module's swapped-average inverse, a query transform
    "gradian.attribute.engines": GRADIAN,
    "gradian.attribute.rows": GRADIAN,
    "gradian.attribute.templates": GRADIAN,  # what a row teaches: chat markers stripped, entities masked
    "gradian.attribute.embeddings": GRADIAN,  # sentence embeddings + HDBSCAN when installed, else TF-IDF, said
    "gradian.attribute.clusters": GRADIAN,
    "gradian.attribute.lessons": GRADIAN,  # clusters grouped by the template they teach; its rows not accused
    "gradian.attribute.result": GRADIAN,
    "gradian.attribute.spans": GRADIAN,  # one gradient per sentence of a long accused row
    "gradian.attribute.retrain": GRADIAN,  # the plain trainer --verify (and the planted fixture) fine-tune with
    "gradian.attribute.verify": GRADIAN,  # --verify: retrained without the accused rows, and a random control
    "gradian.attribute.checkpoints": GRADIAN,  # tracin: the run's checkpoints, one index each, their summed scores
    "gradian.attribute.run": GRADIAN,
    "gradian.attribute.command": GRADIAN,  # its arguments and tables; gradian.cli hands it the command
    "gradian.attribute.stage": GRADIAN,  # the pipeline's attribute stage, after grads
    # entry points: circuitkit_app/ (above both domains) and gradian's own command
    "circuitkit_app": ENTRY,
    "circuitkit_app.config": ENTRY,  # AppConfig: every owner's section, the cross-section rules, validate and compose
    "circuitkit_app.stage_list": ENTRY,  # the one list of stages: circuit discovery's and gradian's
    "circuitkit_app.run": ENTRY,
    "circuitkit_app.cli": ENTRY,
    "circuitkit_app.api": ENTRY,
    "circuitkit_app.smart": ENTRY,
    "circuitkit_app.merge": ENTRY,  # `circuitkit merge RUN_DIRS`: merge attribution shards, then prune
    "gradian.cli": ENTRY,
    "circuitkit_app.gradian_cli": ENTRY,  # the installed `gradian`: gradian.cli plus the report's pages
    # report.html: reads both domains' artifacts through their readers; no stage imports it
    "circuitkit_app.report": ENTRY,
    "circuitkit_app.report.config": ENTRY,  # the report group's schema
    "circuitkit_app.report.collect": ENTRY,
    "circuitkit_app.report.ranked": ENTRY,
    "circuitkit_app.report.accused": ENTRY,  # the attribute stage's section
    "circuitkit_app.report.markup": ENTRY,  # escaped text and tables, for page.py and the sections
    "circuitkit_app.report.sweep": ENTRY,
    "circuitkit_app.report.page": ENTRY,
    # the names users type, kept in circuitkit/ as shims that hand over to circuitkit_app/ (SHIMS below)
    "circuitkit": ENTRY,
    "circuitkit.run": ENTRY,
    "circuitkit.cli": ENTRY,
}

# What gradian may import of circuit discovery: nothing (circuit.pt's reader is in the core).
GRADIAN_MAY_READ: set[str] = set()


# Gradian's rooms, bottom up: a module imports from its own room and the rooms below, never above.
# `gradian.stage` and `gradian.doctor` are loose modules above rank (attribute's stage builds on the
# grads stage); `gradian.cli` is the entry layer's.
GRADIAN_ROOMS = ("settings", "data", "projection", "capture", "curvature", "index", "build", "rank", "diagnose", "stage",
                 "doctor", "attribute", "cli")


def gradian_room(module: str) -> str | None:
    """The room of a gradian module ('gradian' itself has none)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gradian" and len(parts) > 1 else None


def room_violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports inside gradian/ that climb a room."""
    level = {room: i for i, room in enumerate(GRADIAN_ROOMS)}
    bad = set()
    for src, targets in edges.items():
        s = gradian_room(src)
        for dst in targets:
            d = gradian_room(dst)
            if s is not None and d is not None and level[d] > level[s]:
                bad.add((src, dst))
    return bad


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a import b` counts a.b when b is a module)."""
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return {name: edges[name] for name in mods}


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's SCCs with more than one member (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports that climb a layer, cross between the domains, or close a circle."""
    bad = set()
    for src, targets in edges.items():
        for dst in targets:
            s, d = LAYERS[src], LAYERS[dst]
            if RANK[d] > RANK[s]:
                bad.add((src, dst))
            elif s == CIRCUIT and d == GRADIAN:
                bad.add((src, dst))
            elif s == GRADIAN and d == CIRCUIT and dst not in GRADIAN_MAY_READ:
                bad.add((src, dst))
    for circle in strongly_connected(edges):
        bad.update((src, dst) for src in circle for dst in edges[src] if dst in circle)
    return bad


def test_every_module_is_placed_in_a_layer():
    mods = set(_modules())
    assert sorted(mods - set(LAYERS)) == [], "place the new module(s) in LAYERS"
    assert sorted(set(LAYERS) - mods) == [], "LAYERS names module(s) that no longer exist"


def test_imports_point_down_only_and_form_no_circle():
    assert sorted(violations(import_graph())) == [], "import(s) against the layers"


def test_the_checker_sees_a_circle_and_a_climb():
    # The checker itself: a two-module circle and an import from core into a domain are caught.
    edges = {"circuitkit.core.io": {"circuitkit.core.errors", "gradian.index.manifest"}, "circuitkit.core.errors": {"circuitkit.core.io"},
             "gradian.index.manifest": set()}
    assert strongly_connected(edges) == [{"circuitkit.core.io", "circuitkit.core.errors"}]
    assert violations(edges) == {("circuitkit.core.io", "gradian.index.manifest"), ("circuitkit.core.io", "circuitkit.core.errors"),
                                 ("circuitkit.core.errors", "circuitkit.core.io")}


# The top-level folders, bottom up: a module imports from its own folder and the ones below.
FOLDERS = ("circuitkit", "gradian", "circuitkit_app")
# The names users type (`python -m circuitkit.run`, `python -m circuitkit.cli`,
# `from circuitkit import discover_circuit`) stay in circuitkit/ as shims: each imports the one
# entry module it hands over to, and nothing else of the project.
SHIMS = {"circuitkit.run": "circuitkit_app.run", "circuitkit.cli": "circuitkit_app.cli", "circuitkit": "circuitkit_app.api"}


def folder_violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from a folder above the importer's (a shim's import of its entry module aside)."""
    level = {folder: i for i, folder in enumerate(FOLDERS)}
    bad = set()
    for src, targets in edges.items():
        for dst in targets:
            if SHIMS.get(src) == dst:
                continue
            if level[dst.split(".")[0]] > level[src.split(".")[0]]:
                bad.add((src, dst))
    return bad


def test_the_top_level_folders_stack():
    edges = import_graph()
    assert sorted(folder_violations(edges)) == [], "import(s) from a folder above (circuitkit < gradian < circuitkit_app)"
    # Below the entry layer, nothing in circuitkit/ knows gradian or the entry package.
    lower = {name: targets for name, targets in edges.items()
             if name.split(".")[0] == "circuitkit" and RANK[LAYERS[name]] < RANK[ENTRY]}
    assert lower and all(not any(t.split(".")[0] in ("gradian", "circuitkit_app") for t in targets)
                         for targets in lower.values())


def test_the_shims_only_hand_over_to_the_entry_package():
    edges = import_graph()
    mods = _modules()
    for shim, target in SHIMS.items():
        assert edges[shim] == {target}, f"{shim} imports {sorted(edges[shim])}; a shim imports only {target}"
        tree = ast.parse(mods[shim].read_text())
        defs = [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
        # circuitkit/__init__.py keeps discover_circuit, which calls circuitkit_app.api's; the others define nothing.
        assert defs == (["discover_circuit"] if shim == "circuitkit" else []), f"{shim} defines {defs}"
    # Only the shims (and the entry layer's own modules) sit in the entry layer inside circuitkit/.
    in_circuitkit = {name for name, layer in LAYERS.items() if layer == ENTRY and name.split(".")[0] == "circuitkit"}
    assert in_circuitkit == set(SHIMS)


def test_the_folder_checker_sees_a_stage_list_below_gradian():
    # A list of stages in circuitkit/ that imports gradian's stage: caught.
    edges = {"circuitkit.stage_list": {"gradian.stage", "circuitkit.core.pipeline"}, "gradian.stage": {"circuitkit.core.pipeline"},
             "circuitkit.core.pipeline": set(), "gradian.cli": {"circuitkit_app.run"}, "circuitkit_app.run": {"gradian.stage"},
             "circuitkit.run": {"circuitkit_app.run"}}
    assert folder_violations(edges) == {("circuitkit.stage_list", "gradian.stage"), ("gradian.cli", "circuitkit_app.run")}


# Hugging Face module and config names that only the family modules may write
# (circuitkit/models/families/): each family's facts live in its one file.
HF_NAMES = ("c_attn", "c_proj", "c_fc", "q_proj", "k_proj", "v_proj", "o_proj", "query_key_value",
            "dense_h_to_4h", "dense_4h_to_h", "gate_proj", "up_proj", "down_proj", "gate_up_proj", "self_attn",
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "final_layer_norm", "embed_tokens", "embed_in", "ln_1", "ln_2", "ln_f",
            "wte", "q_norm", "k_norm", "language_model", "final_logit_softcapping", "use_parallel_residual",
            "num_experts", "moe_intermediate_size", "n_embd", "n_inner")
FAMILY_DIR = REPO / "circuitkit" / "models" / "families"
# The fixtures build Hugging Face models of named classes, weight by weight for the induction model;
# `gradian doctor`'s batch-invariance self-test builds a one-block GPT-2 of its own the same way.
HF_NAMES_ALLOWED = (FAMILY_DIR, REPO / "circuitkit" / "fixtures", REPO / "gradian" / "doctor.py")
_HF_NAME = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(HF_NAMES) + r")(?![A-Za-z0-9_])")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def hf_names_in_code(source: str) -> list[str]:
    """HF names used by code (attribute names, identifiers and string constants; docstrings and
    comments are prose and may name them)."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.keyword) and node.arg:  # GPT2Config(n_embd=...)
            text = node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value
        else:
            continue
        found += [f"{m.group(1)} (line {node.lineno})" for m in _HF_NAME.finditer(text)]
    return found


def test_hf_module_names_live_only_in_the_family_files():
    bad = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if any(path.is_relative_to(allowed) for allowed in HF_NAMES_ALLOWED):
                continue
            names = hf_names_in_code(path.read_text())
            if names:
                bad[str(path.relative_to(REPO))] = names
    assert bad == {}, "Hugging Face names outside circuitkit/models/families/ (ask the family instead)"


def test_the_name_checker_sees_names_in_code_not_in_prose():
    src = ('"""Docstring naming c_proj is prose."""\n'
           'def f(block):\n    """o_proj in a docstring too."""\n'
           '    x = block.attn.c_proj  # comment: down_proj\n    return ["mlp.down_proj", "upper_proj"]\n'
           'cfg = Config(n_embd=8, width=8)\n')
    assert sorted(hf_names_in_code(src)) == ["c_proj (line 4)", "down_proj (line 5)", "n_embd (line 6)"]


def test_gradian_rooms_stack():
    edges = import_graph()
    rooms = {gradian_room(name) for name in _modules()} - {None}
    assert rooms == set(GRADIAN_ROOMS), f"rooms not in GRADIAN_ROOMS: {sorted(rooms - set(GRADIAN_ROOMS))}"
    assert sorted(room_violations(edges)) == [], "import(s) that climb Gradian's rooms (GRADIAN_ROOMS)"
    loose = sorted(p.name for p in (REPO / "gradian").glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "doctor.py", "stage.py"], loose


def test_the_room_checker_sees_a_climb():
    edges = {"gradian.data.rows": {"gradian.index.manifest"}, "gradian.rank.ranking": {"gradian.index.manifest"},
             "gradian.index.manifest": set()}
    assert room_violations(edges) == {("gradian.data.rows", "gradian.index.manifest")}
