"""What each `grads.projection_dim` costs on disk for the configured corpus, and what it bought on
the yardsticks (the preflight's grads line, `gradian.build.memory.GRADS_MEMORY`'s note).

MEASURED holds figures measured with the defaults otherwise (kronecker_orthogonal, margin loss,
empirical Fisher, uniform widths, EK-FAC at damping 0.01), 3 projection seeds each, from
docs/benchmarks.md ("Gradian's default width"), by

    python scripts/bench/bench_yardsticks.py --yardsticks '' --smollm2 DIR --smollm2-widths W --smollm2-seeds 3 \\
        --losses margin --scores ekfac --dampings 0.01 --fisher empirical --projections kronecker_orthogonal
    python scripts/bench/bench_yardsticks.py --yardsticks LDS --widths W --seeds 3 --losses margin --scores ekfac \\
        --dampings 0.01 --no-raw --fisher empirical --projections kronecker_orthogonal

S: SmolLM2-135M-Instruct's fact set (4 down projections of 576 x 1536), `answer` queries,
recall@10; Kronfluence's unprojected EK-FAC scores 0.750 there. LDS: the tiny GPT-2's linear
datamodeling score on full sentences (its modules hold 16384 weights, so no figure above that);
Kronfluence 0.844, reached only with grads.fisher=sampled (0.852 at 4096), never with the empirical
Fisher. They are one small model's figures each, a guide and not a promise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from circuitkit.core.device import DTYPES

# width per module -> (S answer recall@10, LDS full) with the defaults; None: not measured / not possible.
MEASURED: dict[int, tuple[float | None, float | None]] = {
    1024: (0.478, 0.794),
    4096: (0.572, 0.835),
    16384: (0.650, 0.834),  # LDS: 16384 is the whole of its modules (64 x 256), a rotation of the raw rows
    32768: (0.678, None),
    65536: (0.756, None),
}
# Sign rows (grads=signs: eigen projection, one bit per coordinate, margin loss, cosine of the signs),
# coordinates per module -> (S answer recall@10, LDS full), 3 seeds, docs/benchmarks/gradian-indexing.md
# ("Sign rows, stored"): 16384 coordinates take the bytes of 1024 float16 values, 65536 those of 4096.
MEASURED_SIGNS: dict[int, tuple[float | None, float | None]] = {
    4096: (None, 0.840),
    16384: (0.622, 0.836),
    65536: (0.767, None),
}
PEER = "Kronfluence EK-FAC, unprojected: 0.750 / 0.844"
# Row counting reads the file; above this size the line gives bytes per 1,000 rows instead.
_COUNT_LIMIT_BYTES = 1 << 30


def corpus_rows(data_path: str | None) -> int | None:
    """Rows of a local JSONL data file (its non-empty lines), or None (other formats, too large, absent)."""
    if data_path is None:
        return None
    path = Path(data_path)
    if not path.is_file() or path.suffix not in (".jsonl", ".json") or path.stat().st_size > _COUNT_LIMIT_BYTES:
        return None
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def _size(n_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} B"


def _quality(figures: tuple[float | None, float | None] | None) -> str:
    if figures is None:
        return "not measured"
    s, lds = figures
    return ", ".join(x for x in (None if s is None else f"S {s:.3f}", None if lds is None else f"LDS {lds:.3f}")
                     if x) or "not measured"


def width_note(cfg: Any, grads_projector: Callable[[Any], Any]) -> str | None:
    """One line: the rows' disk at each measured width (and the configured one) for this config's modules
    and corpus, with the S / LDS figures each width measured, dense rows (grads.storage_dtype) and sign
    rows (one bit per coordinate, `gradian.index.formats.signs`). None when grads is off or raw.
    `grads_projector(cfg)`: the run's projector (`gradian.build.memory.grads_projector`, which prints this line)."""
    g = cfg.grads
    if not g.enabled or g.projection_dim is None:
        return None
    try:
        projector = grads_projector(cfg)
    except (ValueError, KeyError, OSError):
        return None
    n_modules = len(projector.shapes)
    raw_width = sum(o * i for o, i in projector.shapes.values())
    item = DTYPES[g.storage_dtype].itemsize
    rows = corpus_rows(g.data_path)
    per = rows if rows is not None else 1000
    where = f"{rows:,} rows" if rows is not None else "1,000 rows"
    smallest = min(o * i for o, i in projector.shapes.values())
    signs = g.row_format == "signs"
    parts = []
    for width in sorted({w for w in MEASURED if w < smallest} | ({g.projection_dim} if not signs else set())):
        mark = " (this run)" if width == g.projection_dim and not signs else ""
        parts.append(f"{width}{mark}: {_size(per * n_modules * width * item)}, {raw_width / (n_modules * width):.0f}x"
                     f" smaller than unprojected ({_quality(MEASURED.get(width))})")
    for width in sorted({w for w in MEASURED_SIGNS if w <= smallest} | ({g.projection_dim} if signs else set())):
        mark = " (this run)" if width == g.projection_dim and signs else ""
        parts.append(f"signs {width}{mark}: {_size(per * n_modules * width / 8)} ({_quality(MEASURED_SIGNS.get(width))})")
    parts.append(f"unprojected: {_size(per * raw_width * item)}")
    return (f"grads.projection_dim, rows on disk for {where} of {n_modules} modules in {g.storage_dtype}"
            f" (and measured S answer recall@10, LDS; {PEER}): " + "; ".join(parts))
