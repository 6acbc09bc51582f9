"""Factored rows against dense rows at equal bytes per row (issue 44, item 3), for bench_yardsticks.py.

A Kronecker block of a (d_out, d_in) module at projection width W is k_o x k_i = W numbers when
stored dense (`gradian.projection.kronecker_factors` picks k_o, k_i), and c (k_o' + k_i') numbers
when stored factored at rank c (`gradian.factored`). The factored index's projection width W' is
the one whose factorisation k_o' x k_i' has c (k_o' + k_i') = W on every module, so both indexes
store the same bytes per row. E.g. dense 32 x 32 = 1024 <-> factored 64 x 64 at c = 8:
8 (64 + 64) = 1024.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradian.projection import kronecker_factors


def parse_row_formats(text: str) -> list[tuple[str, int | None]]:
    """``"dense,factored:8"`` -> [("dense", None), ("factored", 8)]; SystemExit on anything else."""
    out: list[tuple[str, int | None]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        fmt, _, rank = item.partition(":")
        if fmt == "dense" and not rank:
            out.append(("dense", None))
        elif fmt == "factored" and rank.isdigit() and int(rank) >= 1:
            out.append(("factored", int(rank)))
        else:
            raise SystemExit(f"--row-formats: {item!r} is not dense or factored:C (C >= 1, the rank); e.g."
                             " --row-formats dense,factored:8")
    return out


def equal_bytes_width(dense_width: int, rank: int, shapes: Mapping[str, tuple[int, int]]) -> int:
    """The projection width W' whose factored rows at `rank` store `dense_width` numbers per module.

    shapes: module name -> (d_out, d_in). Every module must factor W' as k_o' x k_i' with
    rank (k_o' + k_i') == dense_width (the dense block stores k_o k_i = dense_width); of the widths
    that do, the most balanced (largest) one. ValueError when none does, with what would.
    """
    if dense_width % rank:
        raise ValueError(f"dense width {dense_width} is not a multiple of the rank {rank}: no factored width"
                         f" stores exactly {dense_width} numbers per module. Pick a rank dividing it.")
    side_sum = dense_width // rank  # k_o' + k_i'
    limit = min(d_out * d_in for d_out, d_in in shapes.values())
    # widths a * b with a + b == side_sum, largest (most balanced) first
    for width in sorted({a * (side_sum - a) for a in range(1, side_sum)}, reverse=True):
        if width > limit:
            continue
        try:
            if all(sum(kronecker_factors(width, d_out, d_in)) == side_sum for d_out, d_in in shapes.values()):
                return width
        except ValueError:
            continue
    raise ValueError(f"no projection width stores {dense_width} numbers per module as rank-{rank} factors on"
                     f" modules of (d_out, d_in) {sorted(set(shapes.values()))}: k_o' + k_i' would have to be"
                     f" {side_sum}. Try another rank (--row-formats factored:C) or dense width.")


def row_format_label(fmt: str, rank: int | None, width: int | None = None) -> str:
    """The suffix of a row's setup label: '' for dense rows, ', factored c=8 @4096' for factored ones."""
    return "" if fmt == "dense" else f", factored c={rank} @{width}"


def _cell(entry: Mapping[str, Any], key: str) -> str:
    return f"{entry[key]:.3f} ± {entry[f'{key}_sd']:.3f}"


def comparison_markdown(summary: list[dict[str, Any]], n_docs: Mapping[str, int]) -> str:
    """Markdown: per (yardstick, style, loss, dense width, score), the dense row and every factored
    row of equal bytes beside it: recall@10 (or LDS) mean ± sample sd over seeds, bytes per row
    (rows + norms on disk / documents), and the factored `stream_topk` seconds over the dense ones."""
    lines = ["| yardstick | loss | width | score | rows | metric | mean ± sd (seeds) | bytes / row | rank time ratio |",
             "|---|---|---:|---|---|---|---:|---:|---:|"]
    dense = {(s["yardstick"], s["style"], s["loss"], s["width"], s["score"]): s for s in summary
             if "factored" not in s.get("setup", "") and s["width"] not in ("raw", "full")}
    for s in summary:
        setup = s.get("setup", "")
        key = (s["yardstick"], s["style"], s["loss"], s["width"], s["score"])
        base = dense.get(key)
        if "factored" not in setup or base is None:
            continue
        metric = "lds" if "lds" in s else "r10"
        name = "LDS" if metric == "lds" else "recall@10"
        where = f"{s['yardstick']} {s['style']}"
        docs = n_docs[s["yardstick"]]
        lines.append(f"| {where} | {s['loss']} | {s['width']} | {s['score']} | dense | {name} | {_cell(base, metric)} |"
                     f" {base['bytes']['rows'] / docs:.0f} | 1.00 |")
        lines.append(f"| {where} | {s['loss']} | {s['width']} | {s['score']} | {setup.rsplit(', ', 1)[-1]} | {name} |"
                     f" {_cell(s, metric)} | {s['bytes']['rows'] / docs:.0f} | {s['stream_s'] / base['stream_s']:.2f} |")
    return "\n".join(lines)

