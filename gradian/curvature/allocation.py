"""Per-module widths from the curvature spectrum (`grads.width_allocation: spectrum`).

With ``uniform`` every module is projected to ``projection_dim`` columns. With ``spectrum`` the
same total, budget = n_modules x projection_dim, is split by each module's effective dimension
under the damped K-FAC curvature the index's default score (EK-FAC) applies:

    F_m ≈ S_m ⊗ A_m,   eigenvalues e_ij = s_i a_j   (s: of S_m = Σ δ δᵀ / n, a: of A_m = Σ x xᵀ / N)
    d_m = Σ_ij e_ij / (e_ij + λ_m),   λ_m = ALLOCATION_DAMPING · mean(e_ij)

the number of directions of module m that the damped inverse resolves. Why this measure: a
random projection to k_m columns estimates module m's part of a preconditioned inner product
with a variance that grows as ‖F_m^-½ g_q‖² ‖F_m^-½ g‖² / k_m ≈ d_m² / k_m; under Σ k_m = budget
the total variance Σ d_m² / k_m is smallest at k_m ∝ d_m. The factors come from the same factor
pass as the whitened projection (`gradian.curvature.whitening.factor_pass`, before any row is written).

Each module's share is clamped to [floor, cap] (floor: FLOOR_SHARE x projection_dim; cap: the
module's size, and K-FAC's side limit) with the excess redistributed (water filling), rounded
down to a width with a balanced Kronecker factorisation (k², 2k², projection_dim, or the whole
module), then topped up greedily, the module furthest below its share first, while the total
stays within the budget. Equal spectra give projection_dim each, so the uniform index's rows.

The widths go to ``allocation.json`` in the index directory (with the effective dimensions and
the settings that decided them), shared by every worker under the projection lock like the
whitened matrices (`gradian.curvature.whitening.shared_file`), and into the manifest: each module's
``width`` in the projection entry and an ``allocation`` record (kind, file, sha256, damping,
floor share, budget, total). Queries read the widths from the manifest.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.io import atomic_write_json
from circuitkit.core.recorded import REBUILD, IndexIntegrityError, read_recorded
from gradian.curvature.factors import CURVATURE_DAMPING, MAX_FACTOR_WIDTH, FactorSums
from gradian.curvature.whitening import shared_file
from gradian.projection.projector import _MAX_FACTOR_RATIO, Projector, balanced_width, kronecker_factors

ALLOCATION_FILE = "allocation.json"
# λ_m of the effective dimension: the EK-FAC score's default damping, the curvature being measured.
ALLOCATION_DAMPING = CURVATURE_DAMPING
# No module gets fewer than this share of projection_dim (a badly estimated spectrum must not
# starve a module of all its columns).
FLOOR_SHARE = 0.25
# Eigenvalue products are summed in blocks of this many of S's eigenvalues (bounded memory).
_BLOCK = 256


def factor_eigenvalues(factor_sum: torch.Tensor, count: int) -> torch.Tensor:
    """Eigenvalues (float64, clamped at 0) of factor_sum / count."""
    return torch.linalg.eigvalsh(factor_sum.double() / max(count, 1)).clamp_min(0)


def effective_dimension(s_eig: torch.Tensor, a_eig: torch.Tensor, damping: float = ALLOCATION_DAMPING) -> float:
    """Σ_ij e_ij / (e_ij + λ), e_ij = s_i a_j, λ = damping · mean(e): module m's d_m. 0 for a zero spectrum."""
    mean = float(s_eig.mean() * a_eig.mean())
    if mean <= 0:
        return 0.0
    lam = damping * mean
    total = 0.0
    for lo in range(0, s_eig.numel(), _BLOCK):
        e = torch.outer(s_eig[lo:lo + _BLOCK], a_eig)
        total += float((e / (e + lam)).sum())
    return total


@functools.lru_cache(maxsize=256)  # a model has a few module shapes, repeated in every block
def width_ladder(d_out: int, d_in: int, projection_dim: int, max_side: int | None = MAX_FACTOR_WIDTH,
                 max_width: int | None = None) -> tuple[int, ...]:
    """Widths a (d_out, d_in) module can be given, ascending, up to `max_width` (None: the module's
    size): k² and 2k², projection_dim itself and the whole module, each with a Kronecker factorisation
    `kronecker_factors` accepts unwarned (the whole module always: (d_out, d_in)) and sides of at most
    `max_side` (K-FAC's factor limit; None: any).

    k² (k, k) and 2k² (k, 2k) are checked on those pairs directly; only where they do not fit (k above
    the smaller side, or a side above max_side) is the factorisation searched, and never above
    16 x (smaller side)², where no balanced pair exists: the ladder of a large module costs about
    O(sqrt(max_width)), not O(max_width).
    """
    size = d_out * d_in
    cap = size if max_width is None else max(1, min(size, max_width))
    small, large = min(d_out, d_in), max(d_out, d_in)
    side_ok = (lambda a, b: True) if max_side is None else (lambda a, b: max(a, b) <= max_side)
    searchable = _MAX_FACTOR_RATIO * small * small

    def searched(n: int) -> bool:
        if n == size:  # its only factorisation within the module is (d_out, d_in)
            return max_side is None or large <= max_side
        return (n <= searchable and balanced_width(n, d_out, d_in)
                and (max_side is None or max(kronecker_factors(n, d_out, d_in)) <= max_side))

    out = {n for n in (size, projection_dim) if 1 <= n <= cap and searched(n)}
    for k in range(1, math.isqrt(cap) + 1):
        n = k * k  # (k, k)
        if (k <= small and side_ok(k, k)) or searched(n):
            out.add(n)
        n = 2 * k * k  # (k, 2k) with 2k along the larger side
        if n <= cap and ((k <= small and 2 * k <= large and side_ok(k, 2 * k)) or searched(n)):
            out.add(n)
    return tuple(sorted(out))


def allocate_widths(shapes: Mapping[str, tuple[int, int]], dims: Mapping[str, float], projection_dim: int,
                    floor_share: float = FLOOR_SHARE, max_side: int | None = MAX_FACTOR_WIDTH) -> dict[str, int]:
    """Split budget = len(shapes) x projection_dim among the modules in proportion to `dims` (their
    effective dimensions), each in [floor, cap] and on its `width_ladder`, the total <= budget
    (unless the floors alone exceed it). ValueError when a module has no valid width."""
    names = list(shapes)
    budget = projection_dim * len(names)
    ladders = {n: width_ladder(*shapes[n], projection_dim, max_side, max_width=budget) for n in names}
    empty = [n for n in names if not ladders[n]]
    if empty:
        raise ValueError(f"grads.width_allocation=spectrum: module {empty[0]} {shapes[empty[0]]} has no width with a"
                         " Kronecker factorisation within K-FAC's limits.")
    floor_target = floor_share * projection_dim
    floors = {n: next((w for w in ladders[n] if w >= floor_target), ladders[n][-1]) for n in names}
    caps = {n: ladders[n][-1] for n in names}
    # Water filling: shares of what is left among the modules not yet clamped to their floor or cap.
    targets: dict[str, float] = {}
    free, remaining = list(names), float(budget)
    while free:
        total = sum(max(dims[n], 0.0) for n in free)
        share = {n: remaining * (max(dims[n], 0.0) / total if total > 0 else 1 / len(free)) for n in free}
        clamped = {n: floors[n] for n in free if share[n] < floors[n]} | {
            n: caps[n] for n in free if share[n] > caps[n]}
        if not clamped:
            targets |= share
            break
        targets |= clamped
        remaining -= sum(clamped.values())
        free = [n for n in free if n not in clamped]
    widths = {}
    for n in names:  # the largest ladder width within the target, at least the floor
        below = ladders[n][:bisect.bisect_right(ladders[n], targets[n])]
        widths[n] = max(floors[n], below[-1] if below else floors[n])
    used = sum(widths.values())
    while True:  # top up: the module furthest below its target first, while the budget allows
        options = []
        for i, n in enumerate(names):
            nxt = bisect.bisect_right(ladders[n], widths[n])
            if nxt < len(ladders[n]) and used - widths[n] + ladders[n][nxt] <= budget:
                options.append((-targets[n] / widths[n], i, n, ladders[n][nxt]))
        if not options:
            return widths
        _, _, n, up = min(options)
        used += up - widths[n]
        widths[n] = up


def spectrum_widths(shapes: Mapping[str, tuple[int, int]], sums: FactorSums, n_rows: int,
                    projection_dim: int) -> tuple[dict[str, int], dict[str, float]]:
    """(widths, effective dimensions) of `shapes`' modules from the full factor sums of a factor pass."""
    sums.check_finite("grads.width_allocation=spectrum")
    dims = {n: effective_dimension(factor_eigenvalues(sums.s[n], n_rows), factor_eigenvalues(sums.a[n], sums.tokens))
            for n in shapes}
    return allocate_widths(shapes, dims, projection_dim), dims


def provisional_widths(shapes: Mapping[str, tuple[int, int]], projection_dim: int) -> dict[str, int]:
    """Widths for estimates made before the factor pass: each module's largest ladder width up to
    projection_dim (projection_dim itself where the module has it)."""
    out = {}
    for n, (d_out, d_in) in shapes.items():
        ladder = width_ladder(d_out, d_in, projection_dim)
        out[n] = max((w for w in ladder if w <= projection_dim), default=ladder[0] if ladder else 1)
    return out


def allocated_projector(shapes: Mapping[str, tuple[int, int]], kind: str, projection_dim: int, seed: int,
                        index_dir: Path, settings: dict[str, Any], compute: Callable[[], tuple[FactorSums, int]],
                        recorded: Mapping | None = None) -> Projector:
    """The `kind` projector of `shapes` with the spectrum allocation's widths (budget len(shapes) x
    projection_dim): read from ``allocation.json`` in `index_dir` when it was made with `settings`
    (the facts that decide it), else computed (`compute()` -> the factor sums and the row count) and
    written there under the projection lock. A whitened kind gets its matrices afterwards
    (`gradian.curvature.whitening.whitened_projector`).

    recorded: the allocation record of an existing manifest's projection; a file that does not match
    it is refused (ValueError)."""
    knobs = {"damping": ALLOCATION_DAMPING, "floor_share": FLOOR_SHARE}
    described = {"kind": kind, "projection_dim": projection_dim, "seed": seed,
                 "shapes": {n: list(s) for n, s in shapes.items()}}
    settings_json = json.dumps({**settings, "projection": described, **knobs}, sort_keys=True)

    def read_settings(path: Path) -> str | None:
        try:
            return json.loads(path.read_text()).get("settings")
        except (OSError, ValueError, AttributeError):
            return None

    def write(path: Path) -> None:
        sums, n_rows = compute()
        widths, dims = spectrum_widths(shapes, sums, n_rows, projection_dim)
        atomic_write_json(path, {"settings": settings_json, "widths": widths,
                                 "effective_dimension": {n: round(d, 3) for n, d in dims.items()}, **knobs})

    record = shared_file(index_dir, ALLOCATION_FILE, settings_json, read_settings, write, recorded,
                         "width allocation")
    widths = read_allocation(index_dir, record, list(shapes))
    record = {"kind": "spectrum", **record, **knobs, "budget": len(shapes) * projection_dim,
              "total": sum(widths[n] for n in shapes)}
    return Projector(shapes, kind, projection_dim, seed, widths={n: widths[n] for n in shapes}, allocation=record)


def read_allocation(index_dir: Path, record: Mapping, names: list[str]) -> dict[str, int]:
    """name -> width of `names` from ``allocation.json`` in `index_dir`, read only through its record's
    sha256 (`circuitkit.core.recorded.read_recorded`: inside the index directory, unchanged since written).
    IndexIntegrityError (exit code 1) naming the file when it is missing, linked outside the index,
    changed, not JSON, or gives a module no width."""
    path = Path(index_dir) / ALLOCATION_FILE
    data = read_recorded(Path(index_dir), record, ALLOCATION_FILE, "the width allocation")
    try:
        stored = json.loads(data.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError is one
        raise IndexIntegrityError(f"{path} (the width allocation) is not JSON ({err}); {REBUILD}.") from None
    widths = stored.get("widths") if isinstance(stored, dict) else None
    widths = widths if isinstance(widths, dict) else {}
    missing = [n for n in names if not isinstance(widths.get(n), int) or isinstance(widths.get(n), bool)]
    if missing:
        raise IndexIntegrityError(f"{path} (the width allocation) gives no width for {missing[0]}; {REBUILD}.")
    return {n: widths[n] for n in names}


def check_allocation(index_dir: Path, proj: Mapping) -> None:
    """A projection entry's allocation, as a query or a resume needs it: nothing for a uniform
    projection; else a spectrum record whose ``allocation.json`` reads through its sha256 with a width
    for every module (`read_allocation`). IndexIntegrityError naming the file and the problem otherwise.
    (The widths used are the manifest's, which `projection_sha256` covers.)"""
    record = proj.get("allocation")
    if record is None:
        return
    if not isinstance(record, Mapping) or record.get("kind") != "spectrum":
        raise IndexIntegrityError(f"{Path(index_dir) / 'manifest.json'}: projection.allocation {str(record)[:60]!r}"
                                  f" is not a spectrum allocation record; {REBUILD}.")
    modules = proj.get("modules")
    read_allocation(index_dir, record, list(modules) if isinstance(modules, Mapping) else [])


def allocation_problems(index_dir: Path, proj: Mapping) -> list[str]:
    """What `gradian inspect --verify` reports of a projection's allocation record: its file missing,
    linked outside the index, changed, or not giving the manifest's widths (`check_allocation`), or
    widths that do not sum to the recorded total. [] for a uniform projection."""
    record = proj.get("allocation")
    if record is None:
        return []
    problems = []
    try:
        check_allocation(index_dir, proj)
    except IndexIntegrityError as err:
        problems.append(str(err).split(f"; {REBUILD}")[0])
    if not isinstance(record, Mapping) or record.get("kind") != "spectrum":
        return problems
    widths = [e.get("width") for e in (proj.get("modules") or {}).values() if isinstance(e, Mapping)]
    if sum(w for w in widths if isinstance(w, int)) != record.get("total"):
        problems.append(f"the modules' widths sum to {sum(w for w in widths if isinstance(w, int))}, the allocation"
                        f" records a total of {record.get('total')}")
    return problems
