"""Circuit-restricted indexing: which weights a circuit's kept components write through.

A kept attention head h of layer l writes to the residual stream only through its block of
the attention output projection, the d_head input columns that read its z_h:

    y = W_O z + b,   W_O (d_model, n_heads * d_head) in nn.Linear orientation,
    z = [z_0 | z_1 | ... ],  head h owns columns h*d_head .. (h+1)*d_head - 1  =: W_O[h]

so its per-example gradient is G_h = Σ_t δ_t z_{t,h}ᵀ (d_model, d_head): the slice of the
layer's W_O gradient G = Σ_t δ_t z_tᵀ. Each kept head is one block of the stored row
("site"), projected on its own (kronecker: P_out (k_o, d_model), P_in (k_i, d_head)). A kept
MLP is its output linear (`adapter.mlp_output_linear`), whole; a family whose MLPs have none
(fused mixture-of-experts weights) is refused with circuit_mlps=kept. The W_O bias belongs to
no head and is not indexed.

GQA changes nothing here: W_O (`adapter.z_input`) reads the query heads' outputs side by side
whatever the number of KV heads. A Conv1D stores W_O as (in, out); its input columns are the same.

Site names: ``{W_O module name}:head{h}`` for a head, the module name for an MLP output.
Which heads and MLPs a circuit keeps is `circuitkit.core.circuit_file.kept_components` (circuit.pt's
reader sits below both domains: Gradian imports nothing of circuit discovery).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from circuitkit.core.circuit_file import circuit_sha256, kept_components, load_circuit
from circuitkit.core.config import choices
from circuitkit.core.errors import UserError
from circuitkit.models.linear_modules import module_shape, modules_by_name
from circuitkit.models.lora import canonical_name, unwrap_linear
from gradian.settings.grads import GradsConfig

log = logging.getLogger(__name__)
_HEAD_SUFFIX = re.compile(r"^(?P<module>.+):head(?P<head>\d+)$")
CIRCUIT_MLPS = choices(GradsConfig, "circuit_mlps")


class Site(NamedTuple):
    """One block of a stored row: a linear module, or the input columns of one head in it."""

    name: str
    module: nn.Module
    columns: slice | None  # input columns this block reads; None = the whole module


def site_shape(site: Site) -> tuple[int, int]:
    """(d_out, d_in) of the block in nn.Linear orientation (d_in = d_head for a head)."""
    d_out, d_in = module_shape(site.module)
    if site.columns is None:
        return d_out, d_in
    return d_out, site.columns.stop - site.columns.start


def site_shapes(sites: list[Site]) -> dict[str, tuple[int, int]]:
    """name -> (d_out, d_in) in row order (what `Projector` takes)."""
    return {s.name: site_shape(s) for s in sites}


def _module_names(model: nn.Module) -> dict[int, str]:
    """id -> canonical name (a kept LoRA adapter's base linear by its target's name)."""
    return {id(m): canonical_name(n) for n, m in model.named_modules()}


def _mlp_out(adapter, layer: int) -> nn.Module:
    """The MLP's output linear (the family's `mlp_output_linear`); one clear error when the
    family's MLP has none (mixture-of-experts weights fused in 3-D tensors)."""
    out = adapter.mlp_output_linear(layer)
    if out is not None:
        return unwrap_linear(out)  # a kept LoRA adapter's target: its base linear
    raise ValueError(f"the MLPs of this {adapter.family} model have no output linear to index (their"
                     " experts' weights are fused 3-D tensors, which Gradian does not index): set"
                     " grads.circuit_mlps=none to index the circuit's heads only.")


def circuit_sites(model: nn.Module, adapter, head_mask: torch.Tensor, mlp_mask: torch.Tensor | None) -> list[Site]:
    """Sites of the kept heads (W_O input columns) and kept MLPs (output linear), in forward order.

    head_mask (L, H) bool, mlp_mask (L,) bool or None (no MLPs). Per layer: its kept heads in
    head order, then its MLP.
    """
    if tuple(head_mask.shape) != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"the circuit's head_mask is {tuple(head_mask.shape)} but the model has"
                         f" {adapter.n_layers} layers x {adapter.n_heads} heads: it was found on another model.")
    names = _module_names(model)
    dh = adapter.head_dim
    sites: list[Site] = []
    for layer in range(adapter.n_layers):
        z_input = unwrap_linear(adapter.z_input(layer))
        for h in head_mask[layer].nonzero().flatten().tolist():
            sites.append(Site(f"{names[id(z_input)]}:head{h}", z_input, slice(h * dh, (h + 1) * dh)))
        if mlp_mask is not None and bool(mlp_mask[layer]):
            out = _mlp_out(adapter, layer)
            sites.append(Site(names[id(out)], out, None))
    if not sites:
        raise ValueError("the circuit keeps no head (and no MLP is indexed): nothing to index. Use a circuit"
                         " with kept heads, or grads.circuit=null for an unrestricted index.")
    return sites


def sites_from_names(model: nn.Module, adapter, names: list[str]) -> list[Site]:
    """Rebuild sites from the names a manifest lists (``module`` or ``module:head{h}``).

    Raises ValueError naming the first name the model does not have.
    """
    modules = modules_by_name(model)
    dh = adapter.head_dim
    sites = []
    for name in names:
        m = _HEAD_SUFFIX.match(name)
        module_name, head = (m["module"], int(m["head"])) if m else (name, None)
        if module_name not in modules:
            raise ValueError(f"the loaded model has no module {module_name!r} (index site {name!r}).")
        cols = None if head is None else slice(head * dh, (head + 1) * dh)
        sites.append(Site(name, modules[module_name], cols))
    return sites


def circuit_record(path: Path, circuit: dict[str, Any], sites: list[Site], circuit_mlps: str) -> dict[str, Any]:
    """What an index manifest records about its circuit: file sha256, kept heads and MLPs."""
    heads, mlps = kept_components(circuit)
    # No path: the sha256 is the identity, so a moved copy of the same circuit resumes an index.
    return {"sha256": circuit_sha256(path),
            "model_name": circuit.get("model_name"), "scope": circuit.get("scope", "heads"),
            "heads": heads.nonzero().tolist(), "mlps": mlps.nonzero().flatten().tolist() if circuit_mlps == "kept" else [],
            "circuit_mlps": circuit_mlps, "sites": [s.name for s in sites]}


def restricted_sites(model: nn.Module, adapter, circuit_path: str | Path, circuit_mlps: str = "kept",
                     model_name: str | None = None) -> tuple[list[Site], dict[str, Any]]:
    """(sites, manifest record) of the circuit at `circuit_path` for this model.

    circuit_mlps: "kept" indexes the output projections of the MLPs the circuit keeps
    (`kept_components`: all of them for a head-scope circuit), "none" the heads only.
    """
    if circuit_mlps not in CIRCUIT_MLPS:
        raise ValueError(f"grads.circuit_mlps={circuit_mlps!r}; valid: {', '.join(CIRCUIT_MLPS)}.")
    path = Path(circuit_path)
    if not path.is_file():
        raise FileNotFoundError(f"grads.circuit={str(circuit_path)!r} does not exist; give the circuit.pt the"
                                " pruning stage wrote (or grads.circuit=run inside the pipeline).")
    circuit = load_circuit(path)
    if model_name and circuit.get("model_name") and circuit["model_name"] != model_name:
        log.warning("grads.circuit %s was found on %s, the index is built for %s (same shape, so it is used).",
                    path, circuit["model_name"], model_name)
    heads, mlps = kept_components(circuit)
    if tuple(heads.shape) != (adapter.n_layers, adapter.n_heads):  # checked against the model it is used with
        raise UserError(f"grads.circuit={str(circuit_path)!r} is a circuit of {heads.shape[0]} layers x"
                        f" {heads.shape[1]} heads (made for {circuit.get('model_name')}), but the model has"
                        f" {adapter.n_layers} layers x {adapter.n_heads} heads: use a circuit found on this model.")
    sites = circuit_sites(model, adapter, heads, mlps if circuit_mlps == "kept" else None)
    return sites, circuit_record(path, circuit, sites, circuit_mlps)
