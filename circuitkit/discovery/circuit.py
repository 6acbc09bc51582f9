"""Using a circuit: run a model as the circuit (`apply_circuit`), print one (`show_circuit`).

The circuit.pt format (the `Circuit` type, its writer and its reader, `kept_components`) lives
in `circuitkit.core.circuit_file`, below both domains, so that Gradian reads circuit.pt without
importing circuit discovery; its names are re-exported here for the discovery side.

`apply_circuit(adapter, circuit)` ablates the removed heads of a freshly loaded model, so a
circuit can be evaluated on any prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from circuitkit.core.circuit_file import (
    FORMAT_VERSION,
    Circuit,
    CircuitFileError,
    circuit_sha256,
    kept_components,
    load_circuit,
    run_circuit_path,
    save_circuit,
)
from circuitkit.discovery.pruning.heads import ablate_heads
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.placement import input_device

__all__ = ["FORMAT_VERSION", "Circuit", "CircuitFileError", "apply_circuit", "circuit_sha256", "kept_components",
           "load_circuit", "run_circuit_path", "save_circuit", "show_circuit", "verdict_table"]


@contextmanager
def apply_circuit(adapter: ModelAdapter, circuit: Circuit | dict, ablation: str | None = None) -> Iterator[None]:
    """Run the model as the circuit: removed heads ablated ('mean' or 'zero').

    The circuit's own ablation is used unless `ablation` is given; a circuit pruned with
    'corrupted' ablation needs an explicit 'mean' or 'zero' here, since an arbitrary prompt
    has no corrupted counterpart.
    """
    # Read by field name: a Circuit and a dict of its fields read alike.
    ablation = ablation or circuit["ablation"]
    mask = circuit["head_mask"]
    if tuple(mask.shape) != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"circuit head_mask is {tuple(mask.shape)} but the model has"
                         f" {adapter.n_layers} layers x {adapter.n_heads} heads; was it made for {circuit.get('model_name')}?")
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
    """`show` rows for the fields of `circuitkit.discovery.pruning.heads.circuit_fields` (selection, curve, stability)."""
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


def weight_ablation_rows(c: Circuit) -> list[tuple[str, str]]:
    """`show` rows for `weight_ablations`: the faithfulness a weight export keeps (mean / zero)
    beside the pruning ablation's figure, and how far apart they are."""
    w = c.get("weight_ablations")
    if not w:
        return []
    ref, ref_f = w["reference_ablation"], w["reference_faithfulness"]
    return [(f"faithfulness, {name} ablation (weights)", f"{w[name]['faithfulness']:.4f} ({ref} ablation:"
             f" {ref_f:.4f}, difference {w[name]['faithfulness'] - ref_f:+.4f}); `circuitkit export --format hf"
             f" --ablation {name}`") for name in ("mean", "zero") if name in w]


def verdict_value(row: dict[str, Any]) -> str:
    """A verdict row's value as printed: the random baseline's percentile to 0.1, a faithfulness to 0.001."""
    value = row["value"]
    if value is None:
        return "-"
    return f"{value:.1f}" if row["pillar"] == "baseline_random" else f"{value:.3f}"


def verdict_table(verdict: dict[str, Any]) -> Table:
    """The verdict (circuit.pt `verdict`) as a table: pillar, value, detail, definition."""
    scope = verdict.get("scope", "heads")
    table = Table(title=escape(f"verdict ({scope}, {verdict.get('n_heads', '?')} heads)"))
    for col, justify in (("pillar", "left"), ("value", "right"), ("detail", "left"), ("definition", "left")):
        table.add_column(col, justify=justify)
    for row in verdict["rows"]:
        table.add_row(escape(row["pillar"]), verdict_value(row), escape(row["detail"]), escape(row["definition"]))
    return table


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
        *([("task, corruption", f"{c.get('task', '?')}, {c['corruption']}")] if c.get("corruption") else []),
        *([("faithfulness, held-out templates", f"{c['heldout_templates']['faithfulness']:.4f} on"
            f" {c['heldout_templates']['n_examples']} pairs")] if c.get("heldout_templates") else []),
        ("CPR / CMD", f"{c.get('cpr', float('nan')):.4f} / {c.get('cmd', float('nan')):.4f}"),
        ("edge scores", "yes" if c.get("edge_scores") is not None else "no"),
    ]
    rows += stability_rows(c) + weight_ablation_rows(c)
    for key, value in rows:
        summary.add_row(key, escape(value))
    console.print(summary)
    if c.get("verdict"):
        console.print(verdict_table(c["verdict"]))
    else:
        console.print("no verdict: this circuit.pt was written before the pruning stage measured one (or imported);"
                      " run the pruning stage again for it.", markup=False)
    kept = Table(title="kept heads (by score)")
    for col in ("layer", "head", "score"):
        kept.add_column(col, justify="right")
    scores = c["head_scores"]
    order = sorted(mask.nonzero().tolist(), key=lambda lh: -abs(float(scores[lh[0], lh[1]])))
    for layer, head in order:
        kept.add_row(str(layer), str(head), f"{float(scores[layer, head]):+.4g}")
    console.print(kept)
