"""Export to and import from the EAP-IG reference implementation's JSON graph format.

That format (hannamw/EAP-IG, `Graph.to_json` / `Graph.from_json`; what MIB's circuit track
evaluates) is one JSON object:

    {"cfg":   {"n_layers": L, "n_heads": H, "parallel_attn_mlp": bool, "d_model": d, ...},
     "nodes": {"input": {"in_graph": true, "score": s}, "a0.h0": {...}, ..., "m0": {...}, "logits": {"in_graph": true}},
     "edges": {"input->a0.h0<q>": {"score": s, "in_graph": b}, ..., "a0.h3->m0": {...}, "m1->logits": {...}}}

Mapping to CircuitKit's attribution graph (`circuitkit.discovery.attribution.graph`):

    ours (upstream)        EAP-IG node      | ours (downstream)     EAP-IG edge child
    input                  input            | a{l}.h{h}<q>          a{l}.h{h}<q>
    a{l}.h{h}              a{l}.h{h}        | a{l}.g{g}<k>, <v>     a{l}.h{h}<k>, <v> for every query head h
    m{l}                   m{l}             |                       of KV group g (GQA: h // (H / KV) == g)
                           logits           | m{l}<in>              m{l}
                                            | logits                logits

EAP-IG (on TransformerLens) gives every query head its own K and V input; CircuitKit keeps
one per KV head (GQA native). On export a KV group's edge score is split evenly over its
query heads (so the per-head scores sum back to it) and each gets the group's in_graph; on
import the per-head scores of a group are summed and the group edge is kept when any is.
Without GQA both are one-to-one. `cfg` also carries `n_key_value_heads` (TransformerLens's
name), which import reads (default: no GQA). Node-level circuits have no edge scores: their
edges are written with score 0.0, and the node scores carry the information.

What is in the graph: an edge-scope circuit's kept edges; for a head-scope circuit the kept
heads, every MLP (head pruning keeps them), input and logits, and every edge between nodes
that are in the graph (EAP-IG's node-level `apply_topn` + `prune` gives the same). A
scores.safetensors exports the full graph (everything in_graph) with its scores.

Import writes a circuit.pt (edge scope; usable for `grads.circuit`, `circuitkit show`,
`apply_circuit`) or a scores.safetensors (put it in a run directory and run
`stages=[data,pruning]` to prune and measure it here).
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
from circuitkit.core.io import atomic_write_bytes, check_writable, sha256_file
from circuitkit.discovery.attribution import AttributionScores, load_scores, save_scores
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import Circuit, kept_components, load_circuit, save_circuit
from circuitkit.discovery.circuit_graph import graph_shape
from circuitkit.models.config import ModelConfig
from circuitkit.preflight.memory import shape_for

FORMATS = ("eap-ig-json",)
_EDGE = re.compile(r"^(?P<parent>input|a\d+\.h\d+|m\d+)->(?P<child>a\d+\.h\d+|m\d+|logits)(?:<(?P<letter>[qkv])>)?$")


class InteropError(ValueError):
    """A file that cannot be converted; the message names what is wrong."""


class InteropArgumentError(UserError, InteropError):
    """A command-line value of export/import that is not allowed (exit 2: nothing was read or written)."""

    exit_code = 2


def _children(g: Graph) -> list[list[tuple[str, str]]]:
    """Per downstream column of our graph: the EAP-IG (child node, q|k|v|"") it stands for."""
    group = g.n_heads // g.n_kv_heads
    out: list[list[tuple[str, str]]] = []
    for layer in range(g.n_layers):
        out += [[(f"a{layer}.h{h}", "q")] for h in range(g.n_heads)]
        for letter in "kv":
            out += [[(f"a{layer}.h{h}", letter) for h in range(k * group, (k + 1) * group)]
                    for k in range(g.n_kv_heads)]
        out.append([(f"m{layer}", "")])
    return out + [[("logits", "")]]


def _number(value: float) -> float | None:
    """A score for JSON: NaN (unknown) becomes null, which JSON can hold."""
    value = float(value)
    return value if math.isfinite(value) else None


def _edge_name(parent: str, child: str, letter: str) -> str:
    return f"{parent}->{child}" + (f"<{letter}>" if letter else "")


def to_eap_ig(graph: Graph, d_model: int, head_scores: torch.Tensor, mlp_scores: torch.Tensor, embed_score: float,
              edge_scores: torch.Tensor | None, node_in_graph: dict[str, bool], edge_in_graph: torch.Tensor,
              extra_cfg: dict[str, Any] | None = None, node_scores: bool = True) -> dict[str, Any]:
    """The EAP-IG JSON object for our graph.

    head_scores (L, H), mlp_scores (L,), edge_scores (n_up, n_down) in our layout or None (then
    every edge score is 0.0), node_in_graph {our upstream node name: bool}, edge_in_graph
    (n_up, n_down) bool. `node_scores=False` leaves the nodes' "score" out: the reference's own
    `Graph.to_json` fails on a graph whose nodes carry scores, so a file meant to be loaded and
    saved again there must have none.
    """
    cfg = {"n_layers": graph.n_layers, "n_heads": graph.n_heads, "parallel_attn_mlp": graph.parallel_residual,
           "d_model": int(d_model), "n_key_value_heads": graph.n_kv_heads, **(extra_cfg or {})}

    def node(name: str, score: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"in_graph": bool(node_in_graph[name])}
        if node_scores:
            out["score"] = _number(score)
        return out

    nodes: dict[str, dict[str, Any]] = {"input": node("input", embed_score)}
    for layer in range(graph.n_layers):
        for h in range(graph.n_heads):
            nodes[f"a{layer}.h{h}"] = node(f"a{layer}.h{h}", head_scores[layer, h])
        nodes[f"m{layer}"] = node(f"m{layer}", mlp_scores[layer])
    nodes["logits"] = {"in_graph": True}
    exists = graph.edge_mask()
    edges: dict[str, dict[str, Any]] = {}
    upstream, children = graph.upstream, _children(graph)
    for u, parent in enumerate(upstream):
        for v in exists[u].nonzero().flatten().tolist():
            share = 0.0 if edge_scores is None else float(edge_scores[u, v]) / len(children[v])
            for child, letter in children[v]:
                edges[_edge_name(parent, child, letter)] = {"score": share, "in_graph": bool(edge_in_graph[u, v])}
    return {"cfg": cfg, "nodes": nodes, "edges": edges}


def _d_model(explicit: int | None, stored: Any, model_name: str | None) -> int:
    if explicit is not None:
        return int(explicit)
    if stored is not None:
        return int(stored)
    if model_name:
        try:
            return int(shape_for(ModelConfig(name=model_name))["d_model"])
        except Exception as err:  # noqa: BLE001 - any failure to read the config means: ask the user
            raise InteropError(f"d_model of {model_name!r} is needed for the EAP-IG cfg and could not be read"
                               f" from its config ({err}); pass --d-model.") from err
    raise InteropError("d_model is needed for the EAP-IG cfg; pass --d-model.")


def _bool_or_none(value: Any, what: str) -> bool | None:
    """A boolean as JSON should hold it; the strings "true"/"false" (written by earlier versions'
    scores.safetensors metadata) are read as what they say, never as a non-empty string."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InteropError(f"{what} is {value!r}; it must be true, false or null.")


_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def _weight_files(name: str, model_cfg: dict[str, Any]) -> list[Path]:
    """The weight files of the analysed model on this machine ([] when they are not here)."""
    from circuitkit.models.loading import is_local_path, pretrained_args

    cfg = ModelConfig(name=name, gguf_file=model_cfg.get("gguf_file"), revision=model_cfg.get("revision"))
    try:
        directory, kwargs = pretrained_args(cfg)
    except UserError:  # a local path that moved, a GGUF that is gone: nothing to hash
        return []
    if not is_local_path(directory) and not name.startswith(("builtin:", "fetched:")):
        try:  # a hub id: the local Hugging Face cache only, never the network
            from huggingface_hub import snapshot_download
            directory = snapshot_download(directory, revision=cfg.revision, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the cache (or no hub client): nothing to hash
            return []
    root = Path(directory)
    if kwargs.get("gguf_file"):
        return [root / kwargs["gguf_file"]] if (root / kwargs["gguf_file"]).is_file() else []
    if not root.is_dir():
        return []
    files = sorted(f for f in root.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    return files or sorted(f for f in root.iterdir() if f.is_file() and f.name.startswith("pytorch_model")
                           and f.suffix == ".bin")


def model_provenance(name: str | None, model_cfg: dict[str, Any] | None = None,
                     run_dir: Path | None = None) -> dict[str, Any]:
    """What an export records about the model: its name (`model.name` when that is a hub id, a
    builtin: or fetched: name; for a local directory or GGUF file, the hub id its config.json
    names, else the directory's or file's name: never an absolute local path) and `weights_sha256`
    (the sha256 of its weight file; of `sha256sum`'s listing "<sha256>  <file>" per line when the
    weights are several files; left out when the files are not on this machine). Hashes recorded in
    `run_dir`'s manifest.json for files whose size and mtime did not change are reused."""
    from circuitkit.core.fingerprint import Fingerprinter
    from circuitkit.models.loading import is_local_path

    model_cfg = dict(model_cfg or {})
    if model_cfg.get("name") not in (None, name):  # the run's config is of another model: not this one's
        model_cfg = {}
    if not name:
        return {"model_name": None}
    shown = name
    if not name.startswith(("builtin:", "fetched:")) and is_local_path(name):
        path = Path(name).expanduser()
        shown = path.name
        try:
            hub = json.loads((path / "config.json").read_text()).get("_name_or_path") if path.is_dir() else None
        except (OSError, ValueError):
            hub = None
        if isinstance(hub, str) and hub and not is_local_path(hub):
            shown = hub
    known: list[dict[str, Any]] = []
    manifest = Path(run_dir) / "manifest.json" if run_dir is not None else None
    if manifest is not None and manifest.is_file():
        try:
            stages = json.loads(manifest.read_text()).get("stages", {})
            known = [r for e in stages.values() for r in (e.get("inputs") or {}).values() if isinstance(r, dict)]
        except (OSError, ValueError, AttributeError):
            known = []
    files = _weight_files(name, model_cfg)
    prints = Fingerprinter(known)
    digests = [(prints.file(f)["sha256"], f.name) for f in files]
    if not digests:
        weights = None
    elif len(digests) == 1:
        weights = digests[0][0]
    else:
        import hashlib
        weights = hashlib.sha256("".join(f"{d}  {n}\n" for d, n in digests).encode()).hexdigest()
    out: dict[str, Any] = {"model_name": shown}
    if weights is not None:
        out["weights_sha256"] = weights
    if model_cfg.get("revision"):
        out["model_revision"] = model_cfg["revision"]
    return out


def _run_model_cfg(run_dir: Path) -> dict[str, Any]:
    """config.model of the run in `run_dir` (its manifest.json), {} when there is none."""
    try:
        model = json.loads((Path(run_dir) / "manifest.json").read_text()).get("config", {}).get("model", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return model if isinstance(model, dict) else {}


def export_circuit(circuit: dict[str, Any], d_model: int | None = None, node_scores: bool = True,
                   run_dir: Path | None = None) -> dict[str, Any]:
    """circuit.pt contents -> EAP-IG JSON object (see the module docstring for what is in_graph).
    `run_dir`: where the circuit's run is (its manifest's file hashes are reused, `model_provenance`)."""
    g = graph_shape(circuit)
    heads, mlps = kept_components(circuit)
    in_graph = {"input": True}
    for layer in range(g.n_layers):
        for h in range(g.n_heads):
            in_graph[f"a{layer}.h{h}"] = bool(heads[layer, h])
        in_graph[f"m{layer}"] = bool(mlps[layer])
    if circuit.get("scope") == "edges" and circuit.get("edge_mask") is not None:
        edge_in = circuit["edge_mask"].bool()
    else:
        up = torch.tensor([in_graph[n] for n in g.upstream])
        down = torch.tensor([any(in_graph.get(c, True) for c, _ in cs) for cs in _children(g)])
        edge_in = g.edge_mask() & up[:, None] & down[None, :]
    d = _d_model(d_model, circuit.get("d_model"), circuit.get("model_name"))
    model_cfg = (circuit.get("config") or {}).get("model") or {}
    if not model_cfg.get("revision") and circuit.get("model_revision"):
        model_cfg = {**model_cfg, "revision": circuit.get("model_revision")}
    extra = {**model_provenance(circuit.get("model_name"), model_cfg, run_dir),
             "prepend_bos": _bool_or_none(circuit.get("prepend_bos"), "the circuit's prepend_bos"),
             "source": "circuitkit circuit.pt"}
    return to_eap_ig(g, d, circuit["head_scores"], circuit["mlp_scores"], float(circuit.get("embed_score", 0.0)),
                     circuit.get("edge_scores"), in_graph, edge_in, extra, node_scores)


def export_scores(path: Path, d_model: int | None = None, node_scores: bool = True) -> dict[str, Any]:
    """scores.safetensors -> EAP-IG JSON object with every node and edge in the graph."""
    from safetensors import safe_open

    scores = load_scores(path)
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    g = scores.graph
    in_graph = {n: True for n in g.upstream}
    d = _d_model(d_model, None, meta.get("model"))
    extra = {**model_provenance(meta.get("model"), _run_model_cfg(Path(path).parent), Path(path).parent),
             "prepend_bos": _bool_or_none(meta.get("prepend_bos"), f"{path}'s prepend_bos"),  # a JSON boolean
             "source": "circuitkit scores.safetensors"}
    return to_eap_ig(g, d, scores.head, scores.mlp, float(scores.embed), scores.edges, in_graph, g.edge_mask(), extra,
                     node_scores)


def _count(cfg: dict[str, Any], key: str, required: bool = True) -> int | None:
    value = cfg.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InteropError(f"the EAP-IG cfg's {key} is {value!r}; it must be a whole number >= 1.")
    return value


def _score(value: Any, where: str) -> float:
    """A finite float from a JSON score; InteropError naming `where` for strings, NaN, inf, ..."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InteropError(f"{where} has score {value!r}; a score must be a number (or null).")
    if not math.isfinite(value):
        raise InteropError(f"{where} has score {value}; scores must be finite (NaN and infinity are refused).")
    return float(value)


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InteropError(f"{where} has in_graph {value!r}; it must be true or false.")
    return value


def from_eap_ig(obj: Any, n_kv_heads: int | None = None) -> dict[str, Any]:
    """EAP-IG JSON object -> our layout: graph, head/mlp/embed scores, edge scores and masks.

    Node scores come from the file when it has them, else (as our attribution guarantees) a
    node's score is the sum of its outgoing edge scores (also for a node whose score is null).
    Every value is checked: a wrong structure, a non-numeric or non-finite score, a count that
    is not a positive integer raise InteropError naming it.
    """
    if not isinstance(obj, dict):
        raise InteropError(f"not an EAP-IG graph: the file holds a JSON {type(obj).__name__}, not an object with"
                           " cfg, nodes and edges.")
    missing = [k for k in ("cfg", "nodes", "edges") if k not in obj]
    if missing:
        raise InteropError(f"not an EAP-IG graph: missing key(s) {', '.join(missing)} (expected cfg, nodes, edges).")
    for key in ("cfg", "nodes", "edges"):
        if not isinstance(obj[key], dict):
            raise InteropError(f"not an EAP-IG graph: '{key}' is a JSON {type(obj[key]).__name__}, not an object.")
    cfg = obj["cfg"]
    n_layers, n_heads = _count(cfg, "n_layers"), _count(cfg, "n_heads")
    n_kv = n_kv_heads or _count(cfg, "n_key_value_heads", required=False) or n_heads
    if n_heads % n_kv:
        raise InteropError(f"n_heads={n_heads} is not a multiple of n_key_value_heads={n_kv}.")
    if "d_model" in cfg and cfg["d_model"] is not None:
        _count(cfg, "d_model")
    g = Graph(n_layers, n_heads, n_kv, _bool_or_none(cfg.get("parallel_attn_mlp", False), "cfg.parallel_attn_mlp")
              or False)
    up_index = {n: i for i, n in enumerate(g.upstream)}
    down_index: dict[tuple[str, str], int] = {}
    for v, cs in enumerate(_children(g)):
        for child, letter in cs:
            down_index[(child, letter)] = v
    exists = g.edge_mask()
    scores = torch.zeros(exists.shape, dtype=torch.float32)
    kept = torch.zeros(exists.shape, dtype=torch.bool)
    for name, info in obj["edges"].items():
        m = _EDGE.match(name)
        key = None if m is None else (m["child"], m["letter"] or "")
        if m is None or m["parent"] not in up_index or key not in down_index:
            raise InteropError(f"edge {name!r} does not exist in a {n_layers}-layer, {n_heads}-head graph"
                               " (names: input, a{layer}.h{head}, m{layer}, logits; attention inputs <q>, <k>, <v>).")
        if not isinstance(info, dict):
            raise InteropError(f"edge {name!r} is {info!r}; each edge must be an object with score and in_graph.")
        u, v = up_index[m["parent"]], down_index[key]
        if not exists[u, v]:
            raise InteropError(f"edge {name!r} goes backwards (its child runs before its parent).")
        score = info.get("score")
        scores[u, v] += 0.0 if score is None else _score(score, f"edge {name!r}")
        kept[u, v] |= _flag(info.get("in_graph", False), f"edge {name!r}")
    nodes = obj["nodes"]
    for name, info in nodes.items():
        if not isinstance(info, dict):
            raise InteropError(f"node {name!r} is {info!r}; each node must be an object with in_graph (and score).")
    node_score_given = any("score" in nodes.get(n, {}) for n in g.upstream)
    summed = scores.sum(dim=1)

    def node_score(name: str) -> float:
        value = nodes.get(name, {}).get("score") if node_score_given else None
        return float(summed[up_index[name]]) if value is None else _score(value, f"node {name!r}")

    def node_in(name: str) -> bool:
        return _flag(nodes.get(name, {}).get("in_graph", False), f"node {name!r}")

    head_scores = torch.tensor([[node_score(f"a{layer}.h{h}") for h in range(n_heads)] for layer in range(n_layers)])
    mlp_scores = torch.tensor([node_score(f"m{layer}") for layer in range(n_layers)])
    head_mask = torch.tensor([[node_in(f"a{layer}.h{h}") for h in range(n_heads)] for layer in range(n_layers)])
    mlp_mask = torch.tensor([node_in(f"m{layer}") for layer in range(n_layers)], dtype=torch.bool)
    return {"graph": g, "cfg": cfg, "head_scores": head_scores.float(), "mlp_scores": mlp_scores.float(),
            "embed_score": torch.tensor(node_score("input")), "edge_scores": scores, "edge_mask": kept & exists,
            "head_mask": head_mask, "mlp_mask": mlp_mask}


def read_json(path: Path) -> Any:
    """The JSON value in `path`; InteropError naming the file for non-UTF-8 bytes or invalid JSON."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InteropError(f"{path} is not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start}); save the"
                           " JSON as UTF-8.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InteropError(f"{path} is not JSON ({err}).") from None


def _check_sign_scale(sign: float, scale: float) -> None:
    if sign not in (1, -1):
        raise InteropArgumentError(f"--sign {sign}: it must be 1 or -1.")
    if not (math.isfinite(scale) and scale > 0):
        raise InteropArgumentError(f"--scale {scale}: it must be a finite number > 0 (e.g. --scale 1, or the"
                                   " batch size B of a batch-mean metric).")


def import_eap_ig(json_path: Path, out_path: Path, model_name: str | None = None,
                  n_kv_heads: int | None = None, sign: int = 1, scale: float = 1.0) -> Path:
    """Convert an EAP-IG JSON graph into a circuit.pt (suffix .pt) or a scores.safetensors.

    Every score of the file is multiplied by `sign` x `scale` (docs/interop.md: the reference's
    score with `loss=False` is -1 x CircuitKit's, so `sign=-1`; a batch-mean metric is 1/B of
    it, so `scale=B`); both are recorded in what is written.
    """
    json_path, out_path = Path(json_path), Path(out_path)
    _check_sign_scale(sign, scale)
    if not json_path.is_file():
        raise FileNotFoundError(f"{json_path} {'is a directory' if json_path.is_dir() else 'does not exist'}.")
    if out_path.suffix not in (".pt", ".safetensors"):
        raise InteropError(f"output {out_path} must end in .pt (a circuit) or .safetensors (scores).")
    check_writable(out_path, "the output")
    parsed = from_eap_ig(read_json(json_path), n_kv_heads)
    factor = float(sign) * float(scale)
    for key in ("head_scores", "mlp_scores", "embed_score", "edge_scores"):
        parsed[key] = parsed[key] * factor
    g: Graph = parsed["graph"]
    model_name = model_name or parsed["cfg"].get("model_name") or "unknown"
    conversion = {"sign": int(sign), "scale": float(scale)}
    source = {"format": "eap-ig-json", "path": str(json_path.resolve()), "sha256": sha256_file(json_path),
              **conversion}
    prepend_bos = _bool_or_none(parsed["cfg"].get("prepend_bos"), f"{json_path}'s cfg.prepend_bos")
    if out_path.suffix == ".safetensors":
        scores = AttributionScores(parsed["head_scores"], parsed["mlp_scores"], parsed["embed_score"], g,
                                   parsed["edge_scores"], info={"imported_from": source})
        meta = {"model": model_name, "task": "imported", "source_sha256": source["sha256"],
                "import_sign": str(int(sign)), "import_scale": repr(float(scale))}
        if prepend_bos is not None:
            meta["prepend_bos"] = str(prepend_bos).lower()
        return save_scores(out_path, scores, meta)

    n_total = int(g.edge_mask().sum())
    n_kept = int(parsed["edge_mask"].sum())
    removed = (n_total - n_kept) / n_total
    nan = float("nan")
    save_circuit(out_path, Circuit(**{
        "model_name": model_name, "model_revision": None, "scope": "edges",
        "head_mask": parsed["head_mask"], "mlp_mask": parsed["mlp_mask"], "head_scores": parsed["head_scores"],
        "mlp_scores": parsed["mlp_scores"], "embed_score": parsed["embed_score"],
        "edge_scores": parsed["edge_scores"], "edge_mask": parsed["edge_mask"], "mean_z": None,
        "upstream_nodes": g.upstream, "downstream_nodes": g.downstream,
        "graph": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                  "parallel_residual": g.parallel_residual},
        "d_model": parsed["cfg"].get("d_model"), "prepend_bos": prepend_bos,
        # The reference defines a circuit under activation patching: removed edges carry the
        # corrupted run's values (CircuitKit's `corrupted` ablation), not zeros.
        "ablation": "corrupted", "rank_by": "abs", "target_sparsity": removed, "achieved_sparsity": removed,
        "n_removed": n_total - n_kept, "n_heads_removed": int((~parsed["head_mask"]).sum()),
        "metrics": {"full": nan, "empty": nan, "circuit": nan, "faithfulness": nan}, "cpr": nan, "cmd": nan,
        "imported_from": source,
    }))
    return out_path


def export_file(src: Path, out_path: Path, d_model: int | None = None, node_scores: bool = True) -> Path:
    """circuit.pt or scores.safetensors -> EAP-IG JSON file (written atomically)."""
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"{src} {'is a directory' if src.is_dir() else 'does not exist'}.")
    check_writable(Path(out_path), "the output")
    if src.suffix == ".safetensors":
        obj = export_scores(src, d_model, node_scores)
    else:
        obj = export_circuit(load_circuit(src), d_model, node_scores, src.parent)
    return atomic_write_bytes(Path(out_path), json.dumps(obj, allow_nan=False).encode())


def export_parser() -> argparse.ArgumentParser:
    """The arguments of `circuitkit export` (EAP-IG JSON; numeric ones with their ranges)."""
    parser = argparse.ArgumentParser(
        prog="circuitkit export", description="Export a circuit.pt or scores.safetensors to another tool's format:"
        " an EAP-IG JSON graph (default), or MIB's circuit-localization leaderboard folder (--format mib).",
        epilog="MIB: circuitkit export SRC OUT --format mib --model gpt2 --task ioi writes OUT/ioi_gpt2/"
               "importances.json; circuitkit export --check-mib OUT validates a folder (docs/interop.md).")
    parser.add_argument("src", help="circuit.pt (pruning stage) or scores.safetensors (attribution stage)")
    parser.add_argument("out", help="output file (.json); with --format mib, the submission folder")
    parser.add_argument("--format", choices=(*FORMATS, "mib"), default="eap-ig-json",
                        help="eap-ig-json: hannamw/EAP-IG Graph.to_json; mib: MIB's leaderboard folder"
                             " OUT/<task>_<model>/ (edge scores only)")
    bounded(parser.add_argument("--d-model", type=int, default=None, help="residual width, if the file cannot tell"),
            ge=1, le=MAX_COUNT)
    parser.add_argument("--no-node-scores", action="store_true",
                        help="write nodes without scores: the reference's Graph.to_json fails on a graph whose"
                             " nodes have scores, so use this for a file to be loaded and saved again there")
    mib = parser.add_argument_group("MIB's circuit-localization leaderboard (--format mib)")
    mib.add_argument("--model", default=None, metavar="M",
                     help="MIB's model name: gpt2, qwen2.5, gemma2, llama3 (the folder is <task>_<model>)")
    mib.add_argument("--task", default=None, metavar="T",
                     help="MIB's task (default ioi): ioi, mcqa, arithmetic-addition, arithmetic-subtraction, arc-easy,"
                          " arc-challenge (arithmetic_addition etc. are accepted too)")
    mib.add_argument("--mib-mode", choices=("importances", "circuits"), default=None,
                     help="importances (default): one importances.json with every edge's score, MIB ranks it"
                          " itself; circuits: one file per share 0.1%%..50%%, top edges by |score|")
    mib.add_argument("--check-mib", metavar="DIR", default=None,
                     help="only validate a MIB folder against MIB's own folder matcher and file readers")
    return parser


def export_main(argv: list[str]) -> int:
    """`circuitkit export SRC OUT [--format eap-ig-json] [--d-model D] [--no-node-scores]`."""
    parser = export_parser()
    args = parser.parse_args(argv)
    check_numeric_flags(parser, args)
    if args.format == "mib" or args.check_mib:  # `circuitkit export` hands these to export.mib before here
        raise InteropArgumentError("--format mib and --check-mib are run by `circuitkit export` (the command"
                                   " line), or circuitkit.discovery.export.mib.export_main from Python.")
    given = [flag for flag, value in (("--model", args.model), ("--task", args.task), ("--mib-mode", args.mib_mode))
             if value is not None]
    if given:
        raise InteropArgumentError(f"{', '.join(given)} go(es) with --format mib; an EAP-IG JSON export takes"
                                   " neither (add --format mib for MIB's folder).")
    try:
        path = export_file(Path(args.src), Path(args.out), args.d_model, node_scores=not args.no_node_scores)
    except UserError:
        raise
    except FileNotFoundError as err:  # SRC names no file: the command is wrong
        raise UserError(str(err), exit_code=2) from err
    except (InteropError, ValueError) as err:  # the file's content is bad
        raise UserError(str(err)) from err
    obj = json.loads(Path(path).read_text())
    kept = sum(e["in_graph"] for e in obj["edges"].values())
    print(f"wrote {path}: {len(obj['nodes'])} nodes, {len(obj['edges'])} edges ({kept} in the graph)")
    return 0


def import_main(argv: list[str]) -> int:
    """`circuitkit import GRAPH.json OUT(.pt|.safetensors) [--model NAME] [--n-kv-heads K] [--sign S] [--scale C]`."""
    parser = argparse.ArgumentParser(prog="circuitkit import",
                                     description="Import an EAP-IG JSON graph as a circuit.pt or scores.safetensors.")
    parser.add_argument("src", help="EAP-IG JSON graph (Graph.to_json)")
    parser.add_argument("out", help="circuit.pt (for grads.circuit / show) or scores.safetensors (to prune here)")
    parser.add_argument("--format", choices=FORMATS, default="eap-ig-json")
    parser.add_argument("--model", default=None, help="model name recorded in the output")
    parser.add_argument("--n-kv-heads", type=int, default=None,
                        help="KV heads per layer (GQA), if the file's cfg has no n_key_value_heads")
    parser.add_argument("--sign", type=int, default=1, choices=(1, -1),
                        help="multiply the file's scores by this: -1 for the reference run with loss=False"
                             " (its scores are -1 x CircuitKit's), 1 (default) for loss=True or CircuitKit's own"
                             " exports; recorded in the output")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the file's scores by this (> 0): B for a metric that is a mean over a"
                             " batch of B (the notebooks'), 1 (default) for a per-example sum; recorded in the output")
    args = parser.parse_args(argv)
    try:
        path = import_eap_ig(Path(args.src), Path(args.out), args.model, args.n_kv_heads, args.sign, args.scale)
    except UserError:
        raise
    except FileNotFoundError as err:  # SRC names no file: the command is wrong
        raise UserError(str(err), exit_code=2) from err
    except (InteropError, ValueError) as err:  # the file's content is bad
        raise UserError(str(err)) from err
    print(f"wrote {path}" + (f" (scores x {args.sign * args.scale:g})" if args.sign * args.scale != 1 else ""))
    return 0
