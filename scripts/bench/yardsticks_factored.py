"""Factored rows against dense rows at equal bytes per row, for bench_yardsticks.py.

A Kronecker block of a (d_out, d_in) module at projection width W is k_o x k_i = W numbers when
stored dense (`gradian.projection.projector.kronecker_factors` picks k_o, k_i), and c (k_o' + k_i') numbers
when stored factored at rank c (`gradian.index.formats.factored`). The factored index's projection width W' is
the one whose factorisation k_o' x k_i' has c (k_o' + k_i') = W on every module, so both indexes
store the same bytes per row. E.g. dense 32 x 32 = 1024 <-> factored 64 x 64 at c = 8:
8 (64 + 64) = 1024.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradian.projection.projector import kronecker_factors

SIGN_PROJECTIONS = ("eigen", "whitened", "kronecker_orthogonal", "kronecker")
# Sign rows are compared with the product's default row: float16, 2 bytes = 16 bits per value.
SIGN_BITS_PER_VALUE = 16


def parse_row_formats(text: str) -> list[tuple[str, int | str | None]]:
    """``"dense,factored:8,signs:whitened"`` -> [("dense", None), ("factored", 8), ("signs", "whitened")];
    SystemExit on anything else."""
    out: list[tuple[str, int | str | None]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        fmt, _, arg = item.partition(":")
        if fmt == "dense" and not arg:
            out.append(("dense", None))
        elif fmt == "factored" and arg.isdigit() and int(arg) >= 1:
            out.append(("factored", int(arg)))
        elif fmt == "signs" and arg in SIGN_PROJECTIONS:
            out.append(("signs", arg))
        else:
            raise SystemExit(f"--row-formats: {item!r} is not dense, factored:C (C >= 1, the rank) or signs:P (P, the"
                             f" sign index's projection: {', '.join(SIGN_PROJECTIONS)}); e.g."
                             " --row-formats dense,factored:8,signs:whitened")
    return out


def sign_width(dense_width: int, shapes: Mapping[str, tuple[int, int]]) -> int:
    """The projection width whose sign rows take the bytes of a float16 dense row of `dense_width`
    (16 bits per value); ValueError when a module has fewer weights than that."""
    width = SIGN_BITS_PER_VALUE * dense_width
    small = {n: s for n, s in shapes.items() if s[0] * s[1] < width}
    if small:
        raise ValueError(f"sign rows at the bytes of dense width {dense_width} need {width} coordinates per module;"
                         f" {small} have fewer weights. Use a smaller width.")
    return width


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


def row_format_label(fmt: str, rank: int | str | None, width: int | None = None) -> str:
    """The suffix of a row's setup label: '' for dense rows, ', factored c=8 @4096' for factored ones,
    ', signs whitened @16384' for sign rows (`rank`: their projection)."""
    if fmt == "signs":
        return f", signs {rank} @{width}"
    return "" if fmt == "dense" else f", factored c={rank} @{width}"


def compact(entry: Mapping[str, Any]) -> bool:
    """Whether a summary row is of factored or sign rows (its setup label says so)."""
    return ", factored" in entry.get("setup", "") or ", signs" in entry.get("setup", "")


def _cell(entry: Mapping[str, Any], key: str) -> str:
    return f"{entry[key]:.3f} ± {entry[f'{key}_sd']:.3f}"


def comparison_markdown(summary: list[dict[str, Any]], n_docs: Mapping[str, int]) -> str:
    """Markdown: per (yardstick, style, loss, dense width, score), the dense row and every factored
    row of equal bytes beside it: recall@10 (or LDS) mean ± sample sd over seeds, bytes per row
    (rows + norms on disk / documents), and the factored `stream_topk` seconds over the dense ones."""
    lines = ["| yardstick | loss | width | score | rows | metric | mean ± sd (seeds) | bytes / row | rank time ratio |",
             "|---|---|---:|---|---|---|---:|---:|---:|"]
    dense = {(s["yardstick"], s["style"], s["loss"], s["width"], s["score"]): s for s in summary
             if not compact(s) and s["width"] not in ("raw", "full")}
    for s in summary:
        setup = s.get("setup", "")
        key = (s["yardstick"], s["style"], s["loss"], s["width"], s["score"])
        # sign rows (cosine only) stand beside the dense row's every score
        bases = ([b for k, b in dense.items() if k[:4] == key[:4]] if ", signs" in setup
                 else [dense[key]] if key in dense else [])
        if not compact(s) or not bases:
            continue
        metric = "lds" if "lds" in s else "r10"
        name = "LDS" if metric == "lds" else "recall@10"
        where = f"{s['yardstick']} {s['style']}"
        docs = n_docs[s["yardstick"]]
        base = bases[0]
        for b in bases:
            lines.append(f"| {where} | {s['loss']} | {s['width']} | {b['score']} | dense | {name} | {_cell(b, metric)} |"
                         f" {b['bytes']['rows'] / docs:.0f} | 1.00 |")
        lines.append(f"| {where} | {s['loss']} | {s['width']} | {s['score']} | {setup.rsplit(', ', 1)[-1]} | {name} |"
                     f" {_cell(s, metric)} | {s['bytes']['rows'] / docs:.0f} | {s['stream_s'] / base['stream_s']:.2f} |")
    return "\n".join(lines)

