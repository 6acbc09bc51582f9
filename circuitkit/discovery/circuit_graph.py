"""The circuit as a picture: kept nodes as a layered DAG from the input embedding to the logits.

    input                       (top row)
    a0.h0  a0.h2  ...   m0      layer 0: kept heads at their head index, the MLP at the right
    ...
    logits                      (bottom row)

Edges are the strongest N (by |score|, none under 0.5 % of the strongest) among kept nodes: for an edge-scope circuit its kept
edges, for a head-scope circuit the edges between kept heads, MLPs (head pruning keeps them all),
the input and the logits. Width grows with |score|, colour gives the sign (blue: carries the
clean behaviour, red: works against it), line style the input read (q solid, k dashed,
v dotted; MLP and logits inputs solid). Nodes are filled by their own score. Node names are
EAP-IG's (`a{layer}.h{head}`, `m{layer}`), so the picture and `circuitkit export` agree.

Only layers with something drawn get a row: on a 30-layer model a circuit of a few heads is a
few rows, not a page of empty layers; a thin rule with "N layers" between two rows says how
many layers without a kept node were skipped. Labels are dark on light fills and white on dark
ones.

Graphviz draws it when its `dot` binary is installed (`backend="auto"`); otherwise, and with
`backend="matplotlib"`, a pure matplotlib layout does. Without edge scores (node-level
attribution) only the nodes are drawn and the title says so.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import UserError
from circuitkit.core.io import _atomic
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.circuit import kept_components, load_circuit

BACKENDS = ("auto", "matplotlib", "graphviz")
MIN_RELATIVE = 0.005  # edges weaker than this fraction of the strongest are not drawn
_DOWN = re.compile(r"^a(?P<layer>\d+)\.(?P<kind>[hg])(?P<idx>\d+)<(?P<letter>[qkv])>$")
_LAYER = re.compile(r"^[am](?P<layer>\d+)")
_STYLE = {"q": "-", "k": "--", "v": ":", "": "-"}
_DOT_STYLE = {"q": "solid", "k": "dashed", "v": "dotted", "": "solid"}


@dataclass
class CircuitPicture:
    """What is drawn: nodes with their row/column and score, the top edges with score and letter."""

    n_layers: int
    n_heads: int
    nodes: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # name -> (x, row, score)
    layers: list[int] = field(default_factory=list)  # the layers that have a row, top to bottom (row i + 1)
    edges: list[tuple[str, str, str, float]] = field(default_factory=list)  # (parent, child, q|k|v|"", score)
    title: str = ""
    note: str = ""


def graph_shape(circuit: dict[str, Any]) -> Graph:
    """The attribution graph the circuit's edge scores are laid out in."""
    if circuit.get("graph"):
        return Graph(**circuit["graph"])
    n_layers, n_heads = circuit["head_mask"].shape
    n_kv = n_heads
    edges = circuit.get("edge_scores")
    if edges is not None:  # n_down = L (H + 2 KV + 1) + 1
        n_kv = ((edges.shape[1] - 1) // n_layers - n_heads - 1) // 2
    return Graph(int(n_layers), int(n_heads), int(n_kv), False)


def edge_children(name: str, g: Graph) -> list[tuple[str, str]]:
    """Downstream input name -> [(node, letter)]: a KV group's input feeds every head of the group."""
    if name == "logits":
        return [("logits", "")]
    if name.endswith("<in>"):
        return [(name[:-4], "")]
    m = _DOWN.match(name)
    layer, idx, letter = int(m["layer"]), int(m["idx"]), m["letter"]
    if m["kind"] == "h":
        return [(f"a{layer}.h{idx}", letter)]
    group = g.n_heads // g.n_kv_heads
    return [(f"a{layer}.h{h}", letter) for h in range(idx * group, (idx + 1) * group)]


def kept_node_names(circuit: dict[str, Any]) -> set[str]:
    """The circuit's kept nodes by EAP-IG name: input, logits, kept heads (`a3.h1`) and MLPs (`m3`)."""
    heads, mlps = kept_components(circuit)
    return ({"input", "logits"} | {f"a{layer}.h{h}" for layer, h in heads.nonzero().tolist()}
            | {f"m{layer}" for layer in mlps.nonzero().flatten().tolist()})


def ranked_edges(circuit: dict[str, Any], limit: int) -> tuple[list[tuple[int, int, float]], int]:
    """The `limit` strongest candidate edges as (upstream index, downstream index, score), by |score|,
    and how many candidates there were.

    Candidates: an edge-scope circuit's kept edges; otherwise the edges between kept nodes (a
    downstream input counts when any node it feeds is kept). Edges under MIN_RELATIVE of the
    strongest are left out: invisible at any width, they would put untouched parts (an
    attention-only model's zero MLPs) on the picture. Empty without edge scores.
    """
    scores = circuit.get("edge_scores")
    if scores is None:
        return [], 0
    g = graph_shape(circuit)
    scores = scores.float()
    if circuit.get("scope") == "edges" and circuit.get("edge_mask") is not None:
        candidates = circuit["edge_mask"].bool()
    else:
        kept = kept_node_names(circuit)
        up_kept = torch.tensor([u in kept for u in g.upstream])
        down_kept = torch.tensor([any(c in kept for c, _ in edge_children(v, g)) for v in g.downstream])
        candidates = g.edge_mask() & up_kept[:, None] & down_kept[None, :]
    flat = torch.where(candidates, scores.abs(), torch.full_like(scores, -1.0)).flatten()
    floor = MIN_RELATIVE * float(flat.max().clamp_min(0))
    n_candidates = int((flat > floor).sum())
    order = flat.argsort(descending=True)[:min(limit, n_candidates)].tolist()
    return [(*divmod(i, scores.shape[1]), float(scores.flatten()[i])) for i in order], n_candidates


def build_picture(circuit: dict[str, Any], top_edges: int = 40) -> CircuitPicture:
    """Nodes and the `top_edges` strongest edges among the circuit's kept nodes."""
    g = graph_shape(circuit)
    heads, _ = kept_components(circuit)
    head_scores = circuit.get("head_scores")
    mlp_scores = circuit.get("mlp_scores")
    kept_nodes = kept_node_names(circuit)
    pic = CircuitPicture(g.n_layers, g.n_heads)
    if circuit.get("edge_scores") is not None:
        edge_scope = circuit.get("scope") == "edges" and circuit.get("edge_mask") is not None
        ranked, _ = ranked_edges(circuit, top_edges)
        for u, v, score in ranked:
            for child, letter in edge_children(g.downstream[v], g):
                if edge_scope or child in kept_nodes:
                    pic.edges.append((g.upstream[u], child, letter, score))
    else:
        pic.note = "node-level scores: no edges (set discovery.level=edge to draw them)"
    shown = {"input", "logits"} | {n for n in kept_nodes if n.startswith("a")} \
        | {n for e in pic.edges for n in e[:2]}
    pic.layers = sorted({layer_of(n) for n in shown} - {None})
    row = {layer: i + 1.0 for i, layer in enumerate(pic.layers)}
    for name in shown:
        if name == "input":
            pic.nodes[name] = ((g.n_heads - 1) / 2, 0.0, float(circuit.get("embed_score", float("nan"))))
        elif name == "logits":
            pic.nodes[name] = ((g.n_heads - 1) / 2, len(pic.layers) + 1.0, float("nan"))
        elif name.startswith("m"):
            layer = int(name[1:])
            score = float(mlp_scores[layer]) if mlp_scores is not None else float("nan")
            pic.nodes[name] = (float(g.n_heads), row[layer] + 0.45, score)
        else:
            layer, h = (int(x) for x in name[1:].split(".h"))
            score = float(head_scores[layer, h]) if head_scores is not None else float("nan")
            pic.nodes[name] = (float(h), row[layer], score)
    metrics = circuit.get("metrics") or {}
    faith = metrics.get("faithfulness")
    pic.title = (f"{circuit.get('model_name', '?')}: {int(heads.sum())} of {heads.numel()} heads kept"
                 f" ({circuit.get('scope', 'heads')} scope)"
                 + (f", faithfulness {faith:.3f}" if isinstance(faith, float) and math.isfinite(faith) else "")
                 + f"; top {len(pic.edges)} edges")
    return pic


def layer_of(name: str) -> int | None:
    """The layer of a node (`a3.h1`, `m3`) or of an input it reads (`a3.g0<k>`, `m3<in>`); None for
    the input embedding and the logits."""
    found = _LAYER.match(name)
    return int(found["layer"]) if found else None


def _text_colour(fill) -> str:
    """Black on light fills, white on dark ones (relative luminance of the fill)."""
    import matplotlib.colors as mcolors

    r, g, b = mcolors.to_rgb(fill)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _node_colour(score: float, limit: float):
    import matplotlib

    if not math.isfinite(score):
        return "#eeeeee"
    return matplotlib.colormaps["RdBu"](0.5 + 0.4 * max(-1.0, min(1.0, score / limit)))


def _on_arc(ax, start: tuple[float, float], end: tuple[float, float], rad: float, t: float) -> tuple[float, float]:
    """The point at parameter t of matplotlib's arc3 connection (a quadratic Bézier in display space)."""
    import numpy as np

    to_display, to_data = ax.transData, ax.transData.inverted()
    (x1, y1), (x2, y2) = to_display.transform([start, end])
    control = ((x1 + x2) / 2 + rad * (y2 - y1), (y1 + y2) / 2 - rad * (x2 - x1))
    point = (1 - t) ** 2 * np.array([x1, y1]) + 2 * (1 - t) * t * np.array(control) + t ** 2 * np.array([x2, y2])
    x, y = to_data.transform(point)
    return float(x), float(y)


def draw_matplotlib(pic: CircuitPicture, paths: list[Path]) -> list[Path]:
    """The picture with matplotlib (headless), one file per path (format from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch

    n_rows = len(pic.layers)
    width = max(7.0, 0.95 * (pic.n_heads + 1) + 2.5)
    height = max(4.5, 0.85 * (n_rows + 2) + 1.5)
    fig, ax = plt.subplots(figsize=(width, height))
    node_limit = max([abs(s) for _, _, s in pic.nodes.values() if math.isfinite(s)] + [1e-12])
    edge_limit = max([abs(e[3]) for e in pic.edges] + [1e-12])
    ax.set_xlim(-0.9, pic.n_heads + 0.9)
    ax.set_ylim(n_rows + 1.6, -0.6)  # input at the top, logits at the bottom
    ax.set_yticks(range(n_rows + 2), ["embed", *(f"layer {layer}" for layer in pic.layers), "logits"], fontsize=8)
    ax.set_xticks(range(pic.n_heads + 1), [*(f"h{h}" for h in range(pic.n_heads)), "MLP"], fontsize=8)
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    for y in range(1, n_rows + 1):
        ax.axhline(y, color="#f0f0f0", lw=6, zorder=0)
    # Layers without a drawn node have no row; say how many were skipped between two rows.
    bounds = [-1, *pic.layers, pic.n_layers]
    for i in range(len(bounds) - 1):
        skipped = bounds[i + 1] - bounds[i] - 1
        if skipped > 0:
            y = i + 0.5 + (0.25 if i > 0 else 0.0)  # below an MLP node of the row above
            ax.axhline(y, color="#bbbbbb", lw=0.6, ls=(0, (2, 3)), zorder=0)
            ax.text(pic.n_heads + 0.85, y, f"{skipped} layer{'s' if skipped > 1 else ''}", fontsize=6,
                    color="#888888", ha="right", va="bottom")
    legend = [Line2D([], [], color="#2166ac", lw=3, label="positive score"),
              Line2D([], [], color="#b2182b", lw=3, label="negative score"),
              Line2D([], [], color="grey", lw=1.5, ls="-", label="q input / MLP / logits"),
              Line2D([], [], color="grey", lw=1.5, ls="--", label="k input"),
              Line2D([], [], color="grey", lw=1.5, ls=":", label="v input"),
              Line2D([], [], color="white", label="node fill: node score")]
    if pic.edges:
        legend.insert(5, Line2D([], [], color="white", label=f"width ∝ |score| (max {edge_limit:.3g})"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(pic.title + (f"\n{pic.note}" if pic.note else ""), fontsize=9)
    # Lay out the frame first: the letters' places on the arcs depend on the final axes box.
    fig.tight_layout()
    for parent, child, letter, score in sorted(pic.edges, key=lambda e: abs(e[3])):
        (x0, y0, _), (x1, y1, _) = pic.nodes[parent], pic.nodes[child]
        strength = abs(score) / edge_limit
        # Bend edges that would run along a row or through nodes of the same column.
        rad = 0.25 if abs(x1 - x0) < 0.5 or abs(y1 - y0) < 0.6 else 0.08
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={rad}",
                                     arrowstyle="-|>", mutation_scale=8 + 6 * strength, shrinkA=11, shrinkB=11,
                                     lw=0.6 + 4.4 * strength, linestyle=_STYLE[letter],
                                     color="#2166ac" if score >= 0 else "#b2182b", alpha=0.35 + 0.6 * strength,
                                     zorder=1 + strength))
        if letter:  # name the input read next to the arrow head (line styles alone blur at large widths)
            ax.text(*_on_arc(ax, (x0, y0), (x1, y1), rad, 0.72), letter, fontsize=7, color="#444444",
                    ha="center", va="center", zorder=4,
                    bbox={"boxstyle": "circle,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    for name, (x, y, score) in pic.nodes.items():
        fill = _node_colour(score, node_limit)
        ax.text(x, y, name, ha="center", va="center", fontsize=8 if len(name) < 7 else 7, zorder=5,
                color=_text_colour(fill), bbox={"boxstyle": "round,pad=0.3", "fc": fill, "ec": "black", "lw": 0.7})
    for path in paths:
        fmt = Path(path).suffix.lstrip(".").lower() or "png"
        _atomic(Path(path), lambda tmp, fmt=fmt: fig.savefig(tmp, format=fmt, dpi=120))
    plt.close(fig)
    return [Path(p) for p in paths]


def to_dot(pic: CircuitPicture) -> str:
    """Graphviz DOT source: one rank per row, same colours and styles as the matplotlib layout."""
    lines = ["digraph circuit {", '  rankdir=TB; node [shape=box, style="rounded,filled", fontname=Helvetica,'
             ' fontsize=10]; labelloc=t;', f'  label="{pic.title}";']
    node_limit = max([abs(s) for _, _, s in pic.nodes.values() if math.isfinite(s)] + [1e-12])
    rows: dict[float, list[str]] = {}
    import matplotlib.colors as mcolors

    for name, (_, row, score) in pic.nodes.items():
        colour = _node_colour(score, node_limit)
        hex_colour = colour if isinstance(colour, str) else mcolors.to_hex(colour)
        lines.append(f'  "{name}" [fillcolor="{hex_colour}", fontcolor="{_text_colour(hex_colour)}"];')
        rows.setdefault(row, []).append(f'"{name}"')
    for members in rows.values():
        lines.append(f"  {{rank=same; {'; '.join(members)};}}")
    edge_limit = max([abs(e[3]) for e in pic.edges] + [1e-12])
    for parent, child, letter, score in pic.edges:
        width = 0.6 + 4.4 * abs(score) / edge_limit
        colour = "#2166ac" if score >= 0 else "#b2182b"
        lines.append(f'  "{parent}" -> "{child}" [penwidth={width:.2f}, color="{colour}",'
                     f' style={_DOT_STYLE[letter]}, tooltip="{score:+.4g}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _draw_graphviz(pic: CircuitPicture, paths: list[Path]) -> list[Path]:
    source = to_dot(pic).encode()
    for path in paths:
        fmt = Path(path).suffix.lstrip(".").lower() or "png"
        out = subprocess.run(["dot", f"-T{fmt}"], input=source, capture_output=True, check=True).stdout
        _atomic(Path(path), lambda tmp, out=out: Path(tmp).write_bytes(out))
    return [Path(p) for p in paths]


def write_circuit_graph(circuit: dict[str, Any], path: Path, top_edges: int = 40, backend: str = "auto",
                        svg: bool = True) -> list[Path]:
    """Draw the circuit to `path` (.png or .svg) and, with `svg`, the .svg next to a .png.

    backend: "auto" (Graphviz when `dot` is on PATH, else matplotlib), "matplotlib", "graphviz".
    Returns the files written.
    """
    if backend not in BACKENDS:
        raise ValueError(f"graph backend {backend!r}; valid: {', '.join(BACKENDS)}.")
    if backend == "graphviz" and shutil.which("dot") is None:
        raise ValueError("pruning.graph_backend=graphviz but Graphviz's `dot` is not installed; install"
                         " graphviz or use pruning.graph_backend=matplotlib (or auto).")
    path = Path(path)
    paths = [path]
    if svg and path.suffix.lower() == ".png":
        paths.append(path.with_suffix(".svg"))
    pic = build_picture(circuit, top_edges)
    use_dot = backend == "graphviz" or (backend == "auto" and shutil.which("dot") is not None)
    return _draw_graphviz(pic, paths) if use_dot else draw_matplotlib(pic, paths)


def graph_file(circuit_path: Path, out: Path, top_edges: int = 40, backend: str = "auto") -> list[Path]:
    """`circuitkit show CIRCUIT --graph OUT`: draw a saved circuit to OUT (.png or .svg only)."""
    if Path(out).suffix.lower() not in (".png", ".svg"):
        raise UserError(f"--graph {out}: the picture is written as .png or .svg; name the file accordingly.",
                        exit_code=2)
    return write_circuit_graph(load_circuit(Path(circuit_path)), Path(out), top_edges, backend, svg=False)
