"""DataInf (Kwon et al., ICLR 2024): each module's damped inverse Hessian, with inverse and average swapped.

A stored row is the modules' gradients side by side, g = [g_1, ..., g_M] (module l's block of width
d_l: the index manifest's `projection.modules[l].width`). Per module, with G_l = (1/n) Σ_i g_il g_ilᵀ
over the n training rows, DataInf replaces the inverse of the average by the average of the inverses,
each a rank-one term that Sherman–Morrison inverts in closed form:

    (G_l + λ_l I)⁻¹ ≈ (1/n) Σ_i (g_il g_ilᵀ + λ_l I)⁻¹
                     = (1/(n λ_l)) Σ_i (I − g_il g_ilᵀ / (λ_l + ‖g_il‖²))

so, for the aggregate query v (`gradian.attribute.engines`), the score of row k is

    s(g_k) = Σ_l v_lᵀ (G_l + λ_l I)⁻¹ g_kl ≈ Σ_l (1/λ_l) (v_l − w_l)ᵀ g_kl
    w_l    = (1/n) Σ_i c_il g_il,    c_il = v_lᵀ g_il / (λ_l + ‖g_il‖²)

That is a transformed query u = [(v_l − w_l) / λ_l]_l scored against the rows as every other engine's
query is, in the shared streaming pass. The sign is the engines' (s < 0 accuses): s = −I, with I the
paper's influence (positive there for a row whose training raised the validation loss).

Damping, the paper's choice: λ_l = 0.1 · mean_i ‖g_il‖² / d_l, a tenth of G_l's mean eigenvalue
(tr G_l / d_l), so it follows the module's gradient scale. The swap is exact when n = 1 and its error
shrinks as λ_l grows relative to G_l's eigenvalues (both sides tend to I / λ_l).

Cost: two streaming passes over the shards before the shared scoring pass, each one shard in memory:
the sum of each module's squared norms (λ needs every row before any c_il), then w (one float64
vector of the row's width; the squared norms recomputed per shard rather than kept, n x M floats).
The passes read without checking sha256: the scoring pass checks every shard and stops the command
on one that differs.

What it is depends on the index: on rows projected to k per module (the default) this is DataInf in
the projected space, of the projected gradients P g_il, not of the LoRA gradients themselves; on an
index of raw gradients (`grads.projection_dim=null`, which for LoRA modules is r·d_in or d_out·r values
each) it is DataInf on the exact per-module gradients. `describe` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

DATAINF_DAMPING = 0.1  # λ_l = DATAINF_DAMPING · mean_i ‖g_il‖² / d_l (the paper's)


def module_widths(manifest: dict[str, Any]) -> list[int]:
    """Each module's block width d_l, in row order (the manifest's projection, as the rows were written)."""
    return [int(entry["width"]) for entry in manifest["projection"]["modules"].values()]


def _blocks(rows: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """(n, Σ d_l) -> [(n, d_l)] views, one per module."""
    return list(torch.split(rows, widths, dim=1))


def damping_of(sq_norm_sums: torch.Tensor, n_rows: int, widths: list[int],
               damping: float = DATAINF_DAMPING) -> torch.Tensor:
    """λ_l (M,) float64 from Σ_i ‖g_il‖² (M,): damping · mean squared norm / d_l."""
    d = torch.tensor(widths, dtype=torch.float64)
    return damping * sq_norm_sums.double() / max(n_rows, 1) / d


def datainf_query(v: torch.Tensor, shards: Callable[[], Iterable[torch.Tensor]], widths: list[int],
                  damping: float = DATAINF_DAMPING) -> tuple[torch.Tensor, torch.Tensor]:
    """(u (width,) float32, λ (M,) float64): the transformed query, so that s(g_k) = uᵀ g_k (module docstring).

    `v` (width,): the aggregate query. `shards()` yields every training row once per call, as (n, width)
    blocks of rows; it is called twice (the squared norms, then w). A module whose rows are all zero
    (λ_l = 0) scores nothing: its part of u is 0.
    """
    v = v.double()
    sq_sums = torch.zeros(len(widths), dtype=torch.float64)  # Σ_i ‖g_il‖², (M,)
    n = 0
    for rows in shards():
        sq_sums += torch.stack([(b.double() ** 2).sum() for b in _blocks(rows, widths)])
        n += len(rows)
    lam = damping_of(sq_sums, n, widths, damping)  # (M,)
    v_blocks = torch.split(v, widths)
    w = [torch.zeros(d, dtype=torch.float64) for d in widths]
    start = 0
    for rows in shards():
        rows = rows.double()
        for m, (g, vm) in enumerate(zip(_blocks(rows, widths), v_blocks, strict=True)):
            denom = (lam[m] + (g * g).sum(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)  # (n_shard,)
            w[m] += ((g @ vm) / denom) @ g
        start += len(rows)
    if start != n:
        raise ValueError(f"the shards gave {n} rows, then {start}: they changed between DataInf's two passes.")
    u = [torch.zeros(d, dtype=torch.float64) if lam[m] == 0 else (v_blocks[m] - w[m] / n) / lam[m]
         for m, d in enumerate(widths)]
    return torch.cat(u).float(), lam


def describe(manifest: dict[str, Any]) -> str:
    """One sentence: exact DataInf (raw per-module gradients) or DataInf in the projected space."""
    proj = manifest["projection"]
    modules = list(proj["modules"])
    lora = all("lora_" in name for name in modules)
    what = "LoRA" if lora else "per-module"
    if proj.get("kind") == "raw":
        return (f"exact DataInf: the index stores the raw {what} gradients (grads.projection_dim null), so the"
                f" swapped-average inverse is applied to the gradients themselves ({len(modules)} modules)")
    return (f"DataInf in the projected space: the index stores {what} gradients projected ({proj.get('kind')},"
            f" {proj.get('projection_dim')} per module), so the swapped-average inverse is that of the projected"
            " gradients; build the index with grads.projection_dim=null for exact DataInf")
