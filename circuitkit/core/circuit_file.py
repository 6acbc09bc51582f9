"""circuit.pt, typed: the `Circuit` a pruning run found, its one writer and its one reader.

    torch.load("circuit.pt", weights_only=True) -> {"format_version": 2, <the Circuit's fields>}

Tensors and plain Python types only, so `weights_only=True` loads it without pickle code. The
fields (`Circuit`, in the order they are stored):

    edge_mask (n_up, n_down) bool, kept edges           edge scope only
    mean_z (L, T, H·head_dim) or None                   means for mean ablation (head scope)
    upstream_nodes, downstream_nodes [names]            edge scope only
    graph {n_layers, n_heads, n_kv_heads, parallel_residual}
    mlp_mask (L,) bool (True = kept; head scope keeps every MLP)
    prepend_bos (token policy), d_model (for exports whose format states it)
    model_name, model_revision, scope ("heads" | "edges")
    head_mask (L, H) bool (True = kept), head_scores (L, H), mlp_scores (L,), embed_score ()
    edge_scores (n_up, n_down) or None
    ablation, rank_by, target_sparsity, achieved_sparsity, n_removed, n_heads_removed
    metrics {full, empty, circuit, faithfulness}, curve [rows], cpr, cmd, n_eval_examples
    config (resolved), versions                         written by the pipeline
    imported_from {format, path, sha256}                written by `circuitkit import`
    task, corruption                                    discovery.task; its corruption where it has a
                                                        choice (ioi: data_params.ioi_corruption, s2 | abc;
                                                        induction: key (single format) | swap | fresh (repeat format: data_params.induction_corruption))
    heldout_templates {n_examples, corruption, full, empty, circuit, faithfulness}
                                                        the same circuit and ablation measured on the
                                                        task's held-out templates (None = not measured)
    mib {cpr, cmd, cpr_rank_by, cmd_rank_by, curve_signed, curve_abs}
                                                        MIB's pair (edge scope, corrupted ablation, top_k):
                                                        CPR from the signed ranking, CMD from |score|
    head_means (L, H·head_dim) float32                  each head's mean z over every token of the
                                                        attribution examples: what a weight export folds in
    weight_ablations {mean: {full, empty, circuit, faithfulness}, zero: {...}, reference_ablation,
                      reference_faithfulness, n_heads_kept}
                                                        the kept heads' faithfulness under the ablations
                                                        weights can hold, beside pruning.ablation's
    verdict {scope, n_heads, seed, figures, notes, rows [{pillar, value, detail, definition}]}
                                                        the pillars (baselines, necessity, robustness,
                                                        generalization, stability) measured by the
                                                        pruning stage's evaluator; absent in older files

Format versions: 1, untyped (fields as above, some absent in older files); 2, written by
`save_circuit` from a `Circuit`. The reader takes both and checks the type of every field it
finds (a missing optional field reads as None).

This module is below both domains: Gradian's circuit-restricted index reads circuit.pt
through it (`load_circuit`, `kept_components`) and imports nothing of circuit discovery.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import EXIT_USAGE, UserError
from circuitkit.core.io import atomic_torch_save, sha256_file

FORMAT_VERSION = 2
_TENSOR, _NUMBER = "tensor", "number"


class CircuitFileError(UserError, ValueError):
    """A file given as circuit.pt that cannot be read as one (the message names the file).

    Exit 1: the file's content is bad (truncated, a byte flipped, another kind of file); a
    directory given where the file was asked for is a wrong argument (exit 2)."""


@dataclass(eq=False)
class Circuit:
    """What circuit.pt holds (see the module docstring); None = not stored."""

    model_name: str
    head_mask: torch.Tensor
    head_scores: torch.Tensor
    edge_mask: torch.Tensor | None = None
    mean_z: torch.Tensor | None = None
    upstream_nodes: list[str] | None = None
    downstream_nodes: list[str] | None = None
    graph: dict[str, Any] | None = None
    mlp_mask: torch.Tensor | None = None
    prepend_bos: bool | None = None
    d_model: int | None = None
    model_revision: str | None = None
    scope: str = "heads"
    mlp_scores: torch.Tensor | None = None
    embed_score: torch.Tensor | float | None = None
    edge_scores: torch.Tensor | None = None
    ablation: str | None = None
    rank_by: str | None = None
    target_sparsity: float | None = None
    achieved_sparsity: float | None = None
    n_removed: int | None = None
    n_heads_removed: int | None = None
    metrics: dict[str, float] | None = None
    curve: list[dict[str, Any]] | None = None
    cpr: float | None = None
    cmd: float | None = None
    n_eval_examples: int | None = None
    config: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    imported_from: dict[str, Any] | None = None
    curve_definition: str | None = None  # what the faithfulness curve is (MIB's edge grid or the head curve)
    selection: str | None = None  # pruning.selection: top_k / bootstrap / edge_pruning
    stability: dict[str, Any] | None = None  # Jaccard of the kept set over bootstrap resamples
    task: str | None = None  # discovery.task
    corruption: str | None = None  # the task's corruption where it has a choice (ioi: s2 | abc)
    heldout_templates: dict[str, Any] | None = None  # faithfulness on the task's held-out templates
    mib: dict[str, Any] | None = None  # MIB's (CPR from signed ranking, CMD from |score|) pair, both curves
    head_means: torch.Tensor | None = None  # (L, H*head_dim): per-head mean z, one vector per head
    weight_ablations: dict[str, Any] | None = None  # faithfulness under mean / zero (a weight export's)
    verdict: dict[str, Any] | None = None  # the pillars, rows and raw figures (circuitkit.discovery.pruning.verdict)
    # several corruptions in one discovery: {names, rule, faithfulness, by_corruption: {c: {full, empty, circuit,
    # faithfulness}}}; `metrics["faithfulness"]` and the curve are then the folded figure
    corruptions: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION

    # Read-only mapping access for callers written against the untyped dict (`c["head_mask"]`,
    # `c.get("mlp_mask")`); new code reads the attributes.
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELD_TYPES and key != "format_version":
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        value = getattr(self, key, None) if (key in _FIELD_TYPES or key == "format_version") else None
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return (key in _FIELD_TYPES or key == "format_version") and getattr(self, key) is not None


# Stored order (the pipeline's order since format 1), and each field's type.
_ORDER = ("edge_mask", "mean_z", "upstream_nodes", "downstream_nodes", "graph", "mlp_mask", "prepend_bos", "d_model",
          "model_name", "model_revision", "scope", "head_mask", "head_scores", "mlp_scores", "embed_score",
          "edge_scores", "ablation", "rank_by", "target_sparsity", "achieved_sparsity", "n_removed",
          "n_heads_removed", "metrics", "curve", "cpr", "cmd", "n_eval_examples", "config", "versions",
          "imported_from", "curve_definition", "selection", "stability", "task", "corruption", "heldout_templates",
          "mib", "head_means", "weight_ablations", "verdict", "corruptions")
_FIELD_TYPES: dict[str, Any] = {
    "edge_mask": _TENSOR, "mean_z": _TENSOR, "upstream_nodes": list, "downstream_nodes": list, "graph": dict,
    "mlp_mask": _TENSOR, "prepend_bos": bool, "d_model": int, "model_name": str, "model_revision": str,
    "scope": str, "head_mask": _TENSOR, "head_scores": _TENSOR, "mlp_scores": _TENSOR,
    "embed_score": (_TENSOR, _NUMBER), "edge_scores": _TENSOR, "ablation": str, "rank_by": str,
    "target_sparsity": _NUMBER, "achieved_sparsity": _NUMBER, "n_removed": int, "n_heads_removed": int,
    "metrics": dict, "curve": list, "cpr": _NUMBER, "cmd": _NUMBER, "n_eval_examples": int, "config": dict,
    "versions": dict, "imported_from": dict, "curve_definition": str, "selection": str, "stability": dict,
    "task": str, "corruption": str, "heldout_templates": dict, "mib": dict,
    "head_means": _TENSOR, "weight_ablations": dict, "verdict": dict, "corruptions": dict}
# Written as None when unset (readers of format 1 saw the key); the others are left out when unset.
_STORED_WHEN_NONE = {"mean_z", "graph", "mlp_mask", "prepend_bos", "d_model", "model_revision", "mlp_scores",
                     "embed_score", "edge_scores", "ablation", "rank_by", "target_sparsity", "achieved_sparsity",
                     "n_removed", "n_heads_removed", "metrics", "cpr", "cmd"}
REQUIRED = ("head_mask", "head_scores", "model_name")
assert set(_ORDER) == set(_FIELD_TYPES) == {f.name for f in fields(Circuit)} - {"format_version"}


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


def _is(value: Any, kind: Any) -> bool:
    if isinstance(kind, tuple):
        return any(_is(value, k) for k in kind)
    if kind == _TENSOR:
        return isinstance(value, torch.Tensor)
    if kind == _NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_kind_name(k) for k in kind)
    return kind if isinstance(kind, str) else kind.__name__


def run_circuit_path(output_path: str | None, run_dir: Path) -> Path:
    """Where a pipeline run's pruning stage writes circuit.pt (and `grads.circuit=run` reads it):
    `output_path` when set, else `run_dir/circuit.pt`."""
    return Path(output_path) if output_path else Path(run_dir) / "circuit.pt"


def grads_circuit_path(circuit: str | None, output_path: str | None, run_dir: Path | None) -> Path | None:
    """The circuit.pt that `grads.circuit` names, resolved in one place: None = no circuit; "run" =
    the file this run's pruning stage writes (`run_circuit_path`; without a run directory, as for
    an estimate made before the run, `output_path` or None); else the path given."""
    if circuit is None:
        return None
    if circuit != "run":
        return Path(circuit)
    if run_dir is None:
        return Path(output_path) if output_path else None
    return run_circuit_path(output_path, run_dir)


def save_circuit(path: Path, circuit: Circuit | dict[str, Any]) -> Path:
    """Write circuit.pt atomically: format_version, then the fields in their stored order. A dict
    is taken as a Circuit's fields (TypeError naming a field the format does not have)."""
    circuit = as_circuit(circuit)
    payload: dict[str, Any] = {"format_version": FORMAT_VERSION}
    for name in _ORDER:
        value = getattr(circuit, name)
        if value is not None or name in _STORED_WHEN_NONE:
            payload[name] = _plain(value, name)
    return atomic_torch_save(Path(path), payload)


def _check(path: Path, raw: dict[str, Any]) -> Circuit:
    version = raw.get("format_version", 1)
    if not _is(version, int):
        raise CircuitFileError(f"{path}: format_version is {version!r}, not an integer; run the pruning stage"
                               " again to write it.")
    if version > FORMAT_VERSION:
        raise CircuitFileError(f"{path}: format_version {version} is newer than this CircuitKit reads"
                               f" ({FORMAT_VERSION}); upgrade circuitkit.")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise CircuitFileError(f"{path} is not a CircuitKit circuit: missing {', '.join(missing)}.")
    unknown = sorted(set(raw) - set(_FIELD_TYPES) - {"format_version"})
    if unknown and version >= 2:
        raise CircuitFileError(f"{path}: unknown field(s) {', '.join(unknown)} for format_version {version};"
                               " it was not written by CircuitKit.")
    for name, kind in _FIELD_TYPES.items():
        value = raw.get(name)
        if value is not None and not _is(value, kind):
            raise CircuitFileError(f"{path}: field {name} holds a {type(value).__name__}, expected a"
                                   f" {_kind_name(kind)}; the file is not a CircuitKit circuit.")
    mask = raw["head_mask"]
    if mask.dim() != 2:
        raise CircuitFileError(f"{path} is not a CircuitKit circuit: head_mask is not a (layers, heads) tensor.")
    for name, dims in (("head_scores", 2), ("mlp_mask", 1), ("mlp_scores", 1), ("edge_mask", 2), ("edge_scores", 2),
                       ("head_means", 2)):
        value = raw.get(name)
        if value is not None and value.dim() != dims:
            raise CircuitFileError(f"{path}: {name} has {value.dim()} dimensions, expected {dims}.")
    if tuple(raw["head_scores"].shape) != tuple(mask.shape):
        raise CircuitFileError(f"{path}: head_scores {tuple(raw['head_scores'].shape)} and head_mask"
                               f" {tuple(mask.shape)} differ in shape.")
    means = raw.get("head_means")
    if means is not None and (means.shape[0] != mask.shape[0] or means.shape[1] % mask.shape[1]):
        raise CircuitFileError(f"{path}: head_means {tuple(means.shape)} does not fit head_mask {tuple(mask.shape)}"
                               " (one row per layer, n_heads x head_dim wide).")
    if raw.get("mlp_mask") is not None and raw["mlp_mask"].shape[0] != mask.shape[0]:
        raise CircuitFileError(f"{path}: mlp_mask has {raw['mlp_mask'].shape[0]} layers, head_mask {mask.shape[0]}.")
    if raw.get("verdict") is not None:
        _check_verdict(path, raw["verdict"])
    known = {k: v for k, v in raw.items() if k in _FIELD_TYPES and not (k == "scope" and v is None)}
    return Circuit(**known, format_version=version)


VERDICT_ROW = ("pillar", "value", "detail", "definition")


def _check_verdict(path: Path, verdict: dict[str, Any]) -> None:
    """The verdict's rows are what `show` and the report print: each {pillar, value, detail, definition},
    text but the value (a number, or None for a pillar not measured)."""
    rows = verdict.get("rows")
    if not isinstance(rows, list):
        raise CircuitFileError(f"{path}: verdict holds no list of rows; the file is not a CircuitKit circuit.")
    for i, row in enumerate(rows):
        if (not isinstance(row, dict) or set(row) != set(VERDICT_ROW)
                or not all(isinstance(row[k], str) for k in ("pillar", "detail", "definition"))
                or not (row["value"] is None or _is(row["value"], _NUMBER))):
            raise CircuitFileError(f"{path}: verdict row {i} is {row!r:.200}, expected {{{', '.join(VERDICT_ROW)}}}"
                                   " (value a number or None, the others text); the file is not a CircuitKit"
                                   " circuit.")


def load_circuit(path: Path) -> Circuit:
    """Read circuit.pt with weights_only=True (no pickle code runs) and check every field."""
    path = Path(path)
    if path.is_dir():
        raise CircuitFileError(f"{path} is a directory; give the circuit.pt file inside it"
                               f"{' (' + str(path / 'circuit.pt') + ')' if (path / 'circuit.pt').is_file() else ''}.",
                               exit_code=EXIT_USAGE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the pruning stage writes it (see output_path).")
    try:
        raw = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - zip, pickle and EOF errors all mean "not a readable circuit"
        if isinstance(err, pickle.UnpicklingError):  # torch's text here is a long note on weights_only
            reason = "not a torch.save file, or it holds objects other than tensors and plain types"
        else:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise CircuitFileError(f"{path} cannot be read as a circuit.pt ({reason}); it is"
                               " truncated, corrupted or not a CircuitKit file: run the pruning stage again to"
                               " write it.") from None
    if not isinstance(raw, dict):
        raise CircuitFileError(f"{path} is not a CircuitKit circuit (it holds a {type(raw).__name__},"
                               " not a dict with head_mask, head_scores, ...).")
    return _check(path, raw)


def circuit_sha256(path: Path) -> str:
    """sha256 of a circuit.pt file's bytes: the identity a gradient index records."""
    return sha256_file(Path(path))


def as_circuit(circuit: Circuit | dict[str, Any]) -> Circuit:
    """A Circuit from a Circuit or a dict of its fields (TypeError naming a field it does not have)."""
    if isinstance(circuit, Circuit):
        return circuit
    unknown = sorted(set(circuit) - set(_FIELD_TYPES) - {"format_version"})
    if unknown:
        raise TypeError(f"circuit.pt has no field(s) {', '.join(unknown)}; fields: {', '.join(_ORDER)}.")
    return Circuit(**{k: v for k, v in circuit.items() if k != "format_version"})


def kept_components(circuit: Circuit | dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(head_mask (L, H) bool, mlp_mask (L,) bool): the heads and MLPs the circuit keeps.

    A head is kept when the pruning kept it (head scope) or when at least one of its outgoing
    edges is kept (edge scope: its write reaches the circuit). MLPs: head-scope pruning never
    removes an MLP, so a head-scope circuit keeps all of them (the circuit whose faithfulness
    was measured ran with every MLP live); an edge-scope circuit keeps the MLPs with at least
    one kept outgoing edge. Files written before mlp_mask existed are read the same way.
    """
    # Read by field name, so that a Circuit and a dict of some of its fields read alike.
    heads = circuit["head_mask"].bool()
    if circuit.get("mlp_mask") is not None:
        return heads, circuit["mlp_mask"].bool()
    n_layers, n_heads = heads.shape
    edge_mask = circuit.get("edge_mask")
    if circuit.get("scope", "heads") == "edges" and edge_mask is not None:
        # Upstream rows: input, then per layer n_heads heads and the MLP (circuitkit.discovery.attribution.graph).
        rows = [1 + layer * (n_heads + 1) + n_heads for layer in range(n_layers)]
        return heads, edge_mask.bool()[rows].any(dim=1)
    return heads, torch.ones(n_layers, dtype=torch.bool)
