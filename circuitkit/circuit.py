"""circuit.pt: the pruned circuit as tensors and plain types, and how to use it.

    torch.load("circuit.pt", weights_only=True) -> dict with
        format_version, model_name, model_revision, head_mask (L, H) bool (True = kept),
        head_scores (L, H), mlp_scores (L,), embed_score (), edge_scores (n_up, n_down) or None,
        mean_z (L, T, H * head_dim) (for mean ablation) or None, ablation, rank_by,
        target_sparsity, achieved_sparsity, n_heads_removed, metrics {full, empty, circuit,
        faithfulness}, curve [rows], cpr, cmd, config (resolved), versions,
        mlp_mask (L,) bool (True = kept; head scope keeps every MLP), prepend_bos (token policy),
        edge_mask / upstream_nodes / downstream_nodes (edge scope)

`kept_components(circuit)` is the one reading of "what the circuit keeps" (Gradian's
circuit-restricted index uses it; it may import this module, nothing else of discovery).

`apply_circuit(adapter, circuit)` ablates the removed heads of a freshly loaded model, so a
circuit can be evaluated on any prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from circuitkit.errors import EXIT_USAGE, UserError
from circuitkit.io import atomic_torch_save, sha256_file
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device
from circuitkit.pruning import ablate_heads

FORMAT_VERSION = 1
# What `show_circuit` and `apply_circuit` read; a file without them is not a circuit.
REQUIRED_KEYS = ("head_mask", "head_scores", "model_name")


class CircuitFileError(UserError, ValueError):
    """A file given as circuit.pt that cannot be read as one (the message names the file)."""

    exit_code = EXIT_USAGE


def _plain(value: Any, where: str) -> Any:
    """Tensors and plain Python types only, so weights_only=True loads it without pickle code."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    for plain in (bool, int, float, str):  # also subclasses, such as torch.__version__
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise TypeError(f"circuit field {where} holds a {type(value).__name__}; only tensors and plain types are stored.")


def run_circuit_path(output_path: str | None, run_dir: Path) -> Path:
    """Where a pipeline run's pruning stage writes circuit.pt (and `grads.circuit=run` reads it):
    `output_path` when set, else `run_dir/circuit.pt`."""
    return Path(output_path) if output_path else Path(run_dir) / "circuit.pt"


def save_circuit(path: Path, circuit: dict[str, Any]) -> Path:
    """Write circuit.pt atomically (only tensors and plain Python types)."""
    payload = {"format_version": FORMAT_VERSION, **circuit}
    return atomic_torch_save(Path(path), {k: _plain(v, k) for k, v in payload.items()})


def load_circuit(path: Path) -> dict[str, Any]:
    """Read circuit.pt with weights_only=True (no pickle code runs)."""
    path = Path(path)
    if path.is_dir():
        raise CircuitFileError(f"{path} is a directory; give the circuit.pt file inside it"
                               f"{' (' + str(path / 'circuit.pt') + ')' if (path / 'circuit.pt').is_file() else ''}.")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the pruning stage writes it (see output_path).")
    try:
        circuit = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - zip, pickle and EOF errors all mean "not a readable circuit"
        import pickle

        if isinstance(err, pickle.UnpicklingError):  # torch's text here is a long note on weights_only
            reason = "not a torch.save file, or it holds objects other than tensors and plain types"
        else:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise CircuitFileError(f"{path} cannot be read as a circuit.pt ({reason}); it is"
                               " truncated, corrupted or not a CircuitKit file: run the pruning stage again to"
                               " write it.") from None
    if not isinstance(circuit, dict):
        raise CircuitFileError(f"{path} is not a CircuitKit circuit (it holds a {type(circuit).__name__},"
                               " not a dict with head_mask, head_scores, ...).")
    missing = [k for k in REQUIRED_KEYS if k not in circuit]
    if missing:
        raise CircuitFileError(f"{path} is not a CircuitKit circuit: missing {', '.join(missing)}.")
    if not isinstance(circuit["head_mask"], torch.Tensor) or circuit["head_mask"].dim() != 2:
        raise CircuitFileError(f"{path} is not a CircuitKit circuit: head_mask is not a (layers, heads) tensor.")
    return circuit


def circuit_sha256(path: Path) -> str:
    """sha256 of a circuit.pt file's bytes: the identity a gradient index records."""
    return sha256_file(Path(path))


def kept_components(circuit: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(head_mask (L, H) bool, mlp_mask (L,) bool): the heads and MLPs the circuit keeps.

    A head is kept when the pruning kept it (head scope) or when at least one of its outgoing
    edges is kept (edge scope: its write reaches the circuit). MLPs: head-scope pruning never
    removes an MLP, so a head-scope circuit keeps all of them (the circuit whose faithfulness
    was measured ran with every MLP live); an edge-scope circuit keeps the MLPs with at least
    one kept outgoing edge. Files written before mlp_mask existed are read the same way.
    """
    heads = circuit["head_mask"].bool()
    if circuit.get("mlp_mask") is not None:
        return heads, circuit["mlp_mask"].bool()
    n_layers, n_heads = heads.shape
    edge_mask = circuit.get("edge_mask")
    if circuit.get("scope", "heads") == "edges" and edge_mask is not None:
        # Upstream rows: input, then per layer n_heads heads and the MLP (circuitkit.attribution.graph).
        rows = [1 + layer * (n_heads + 1) + n_heads for layer in range(n_layers)]
        return heads, edge_mask.bool()[rows].any(dim=1)
    return heads, torch.ones(n_layers, dtype=torch.bool)


@contextmanager
def apply_circuit(adapter: ModelAdapter, circuit: dict[str, Any], ablation: str | None = None) -> Iterator[None]:
    """Run the model as the circuit: removed heads ablated ('mean' or 'zero').

    The circuit's own ablation is used unless `ablation` is given; a circuit pruned with
    'corrupted' ablation needs an explicit 'mean' or 'zero' here, since an arbitrary prompt
    has no corrupted counterpart.
    """
    ablation = ablation or circuit["ablation"]
    mask = circuit["head_mask"]
    if tuple(mask.shape) != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"circuit head_mask is {tuple(mask.shape)} but the model has"
                         f" {adapter.n_layers} layers x {adapter.n_heads} heads; was it made for {circuit['model_name']}?")
    if ablation == "corrupted":
        raise ValueError("this circuit was pruned with corrupted ablation; pass ablation='mean' or 'zero' to"
                         " apply it to arbitrary prompts.")
    if ablation == "mean" and circuit.get("mean_z") is None:
        raise ValueError("the circuit stores no mean activations; pass ablation='zero'.")
    device = input_device(adapter.model)
    values = [None] * adapter.n_layers if ablation == "zero" else [v.to(device)[None] for v in circuit["mean_z"]]
    with ablate_heads(adapter, ~mask.bool(), values):
        yield


def stability_rows(c: dict[str, Any]) -> list[tuple[str, str]]:
    """`show` rows for the fields of `circuitkit.pruning.circuit_fields` (selection, curve, stability)."""
    rows = []
    if c.get("selection"):
        rows.append(("selection", str(c["selection"])))
    if c.get("curve_definition"):
        rows.append(("curve", str(c["curve_definition"])))
    st = c.get("stability")
    if st:
        rows.append(("stability (Jaccard)", f"mean {st['jaccard_mean']:.3f}, 5th pct {st['jaccard_p5']:.3f} over"
                     f" {st['n_resamples']} resamples of {st['n_examples']} examples (bar: 0.8)"))
    elif "stability" in c:
        rows.append(("stability (Jaccard)", "not measured (needs per-example scores: discovery.per_example=true)"))
    return rows


def show_circuit(path: Path, console: Console | None = None) -> None:
    """Print a summary table and the kept heads of circuit.pt."""
    c = load_circuit(path)
    console = console or Console()
    summary = Table(title=escape(f"circuit {path}"), show_header=False)
    summary.add_column("key")
    summary.add_column("value")
    mask = c["head_mask"]
    metrics = c.get("metrics", {})
    rows = [
        ("model", f"{c['model_name']}" + (f" @ {c['model_revision']}" if c.get("model_revision") else "")),
        ("heads kept", f"{int(mask.sum())} of {mask.numel()} ({mask.shape[0]} layers x {mask.shape[1]} heads)"),
        ("target / achieved sparsity", f"{c.get('target_sparsity', float('nan')):.3f} /"
                                       f" {c.get('achieved_sparsity', float('nan')):.3f}"),
        ("ranking, ablation", f"{c.get('rank_by', '?')}, {c.get('ablation', '?')}"),
        ("metric full / empty / circuit", " / ".join(f"{metrics.get(k, float('nan')):.4g}"
                                                     for k in ("full", "empty", "circuit"))),
        ("faithfulness", f"{metrics.get('faithfulness', float('nan')):.4f}"),
        ("CPR / CMD", f"{c.get('cpr', float('nan')):.4f} / {c.get('cmd', float('nan')):.4f}"),
        ("edge scores", "yes" if c.get("edge_scores") is not None else "no"),
    ]
    rows += stability_rows(c)
    for key, value in rows:
        summary.add_row(key, escape(value))
    console.print(summary)
    kept = Table(title="kept heads (by score)")
    for col in ("layer", "head", "score"):
        kept.add_column(col, justify="right")
    scores = c["head_scores"]
    order = sorted(mask.nonzero().tolist(), key=lambda lh: -abs(float(scores[lh[0], lh[1]])))
    for layer, head in order:
        kept.add_row(str(layer), str(head), f"{float(scores[layer, head]):+.4g}")
    console.print(kept)
