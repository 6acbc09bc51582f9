"""A pruned model that runs without CircuitKit: `circuitkit export circuit.pt --format hf DIR`.

The circuit's removed heads are written into a copy of the model's weights, and the copy is saved
as a standard Hugging Face checkpoint (safetensors, config.json, the tokenizer files) that plain
`AutoModelForCausalLM.from_pretrained(DIR)` loads, trust_remote_code off, plus
`circuitkit_export.json`, the provenance. Per removed head h of layer l (z_h its slice of the
output projection's input, W_O[h] its columns):

    zero   W_O[h] = 0                                   (the head adds nothing)
    mean   b_O += W_O[h] m_h, then W_O[h] = 0           (m_h: circuit.pt's head_means, the head's
                                                         mean z over every token of the attribution
                                                         examples; one vector, not per position)

Both are exact: the output projection computes what it computes on z with the removed slices
replaced by 0 or m_h (the Evaluator's hooks, `circuitkit.discovery.pruning.heads.ablate_heads`).
Mean needs a bias on the output projection: a family whose config can add one (Llama's
`attention_bias` adds zero Q/K/V biases too) gets it, one whose cannot (Qwen2, Mistral) is refused.
The counterfactual ablation pruning uses by default has no weight form; the pruning stage reports
the circuit's faithfulness under mean and zero beside it (circuit.pt `weight_ablations`).

Smaller where the architecture allows: a KV group (a KV head and all of its query heads) whose
heads are all removed is cut out of Q, K, V and W_O when every layer can lose as many (the config's
head counts are per model); the families say where they cannot (GPT-2, GPT-NeoX: head_dim is
d_model / n_heads). Everything else removed is only zeroed, and the provenance says which is which.
All module and config names stay in the families (`ModelAdapter.ensure_o_bias`,
`fold_head_ablation`, `remove_kv_groups`, `set_head_counts`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.circuit_file import Circuit, circuit_sha256, load_circuit
from circuitkit.core.config import ConfigError
from circuitkit.core.errors import EXIT_USAGE, UserError
from circuitkit.core.io import atomic_write_json, check_writable
from circuitkit.core.provenance import software
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.config import ModelConfig, validate_model
from circuitkit.models.loading import LoadedModel, load_model, model_source, weights_hash

FORMATS = ("hf",)
ABLATIONS = ("mean", "zero")
PROVENANCE_FILE = "circuitkit_export.json"


class ExportError(UserError):
    """A circuit that cannot be exported as asked (the message says why and what to do)."""


def model_config_of(circuit: Circuit, name: str | None = None, precision: str | None = None) -> ModelConfig:
    """The model a circuit was made on (its resolved config's `model` group), or `name` instead;
    `precision` overrides the dtype."""
    base = (circuit.config or {}).get("model") or {}
    try:
        cfg = validate_model(dict(base))
    except ConfigError:  # a config written by another version: its name is what we need
        cfg = ModelConfig(name=circuit.model_name)
    if name is not None and name != cfg.name:
        cfg = ModelConfig(name=name, precision=cfg.precision)
    if precision is not None:
        cfg.precision = precision
    return cfg


def _removed_heads(circuit: Circuit, path: Path) -> torch.Tensor:
    """(L, H) bool, True = removed; one clear line when there is nothing to export."""
    kept = circuit.head_mask.bool()
    if int(kept.sum()) == 0:
        raise ExportError(f"{path}: the circuit keeps no head (0 of {kept.numel()}); an export would be the model"
                          " without attention. Prune to a lower pruning.target_sparsity.")
    if bool(kept.all()):
        raise ExportError(f"{path}: the circuit removes no head (all {kept.numel()} kept); the export would be the"
                          " base model. Prune with pruning.target_sparsity > 0.")
    return ~kept


def _check_fits(circuit: Circuit, adapter: ModelAdapter, model_name: str, path: Path) -> None:
    shape = (adapter.n_layers, adapter.n_heads)
    if tuple(circuit.head_mask.shape) != shape:
        raise ExportError(f"{path} was made for {circuit.model_name} ({circuit.head_mask.shape[0]} layers x"
                          f" {circuit.head_mask.shape[1]} heads), but {model_name} has {shape[0]} x {shape[1]};"
                          " give the model it was made on (--model).", exit_code=EXIT_USAGE)
    n_kv = (circuit.graph or {}).get("n_kv_heads")
    if n_kv is not None and n_kv != adapter.n_kv_heads:
        raise ExportError(f"{path} was made for a model with {n_kv} KV heads per layer, {model_name} has"
                          f" {adapter.n_kv_heads}; give the model it was made on (--model).", exit_code=EXIT_USAGE)
    means = circuit.head_means
    if means is not None and means.shape[1] != adapter.n_heads * adapter.head_dim:
        raise ExportError(f"{path}: head_means are {means.shape[1]} wide, {model_name}'s heads"
                          f" {adapter.n_heads} x {adapter.head_dim}; give the model it was made on (--model).",
                          exit_code=EXIT_USAGE)


def _sizes(model: torch.nn.Module) -> dict[str, int]:
    params = list(model.parameters())  # tied weights once
    return {"n_params": sum(p.numel() for p in params), "bytes": sum(p.numel() * p.element_size() for p in params)}


def _cut_kv_groups(adapter: ModelAdapter, removed: torch.Tensor) -> dict[str, Any]:
    """Cut the KV groups whose query heads are all removed, as many in every layer (the fewest any
    layer has); returns what was cut and why the rest was not."""
    H, KV = adapter.n_heads, adapter.n_kv_heads
    per_group = H // KV
    full = [[g for g in range(KV) if bool(removed[layer, g * per_group:(g + 1) * per_group].all())]
            for layer in range(adapter.n_layers)]
    if adapter.kv_groups_removable is not None:
        return {"kv_groups_per_layer": 0, "cut": [], "why_not": adapter.kv_groups_removable}
    n_cut = min(len(groups) for groups in full)
    note = None
    if n_cut == 0:
        note = ("no layer count to cut: some layer has no KV group whose query heads are all removed, and every"
                " layer must hold the same number of heads (config num_key_value_heads)")
    elif any(len(groups) > n_cut for groups in full):
        note = (f"{n_cut} KV group(s) cut per layer, the fewest any layer has; the other fully removed groups are"
                " zeroed only (every layer must hold the same number of heads)")
    cut = [groups[:n_cut] for groups in full]
    for layer, groups in enumerate(cut):
        adapter.remove_kv_groups(layer, groups)
    changes = adapter.set_head_counts(H - n_cut * per_group, KV - n_cut) if n_cut else {}
    return {"kv_groups_per_layer": n_cut, "query_heads_per_layer": n_cut * per_group,
            "cut": [[layer, g] for layer, groups in enumerate(cut) for g in groups], "why_not": note,
            "config_changes": changes}


def fold_circuit(adapter: ModelAdapter, circuit: Circuit, ablation: str, path: Path) -> dict[str, Any]:
    """Write the circuit's removed heads into `adapter.model`'s weights (in place) and cut the
    whole KV groups the architecture lets go; returns the provenance of what was done."""
    removed = _removed_heads(circuit, path)
    if ablation == "mean" and circuit.head_means is None:
        raise ExportError(f"{path} holds no per-head means (head_means: written by the pruning stage of this version;"
                          " an imported or older circuit lacks them): rerun the pruning stage, or export with"
                          " --ablation zero.")
    config_changes = adapter.ensure_o_bias() if ablation == "mean" else {}
    H, dh, G = adapter.n_heads, adapter.head_dim, adapter.n_heads // adapter.n_kv_heads
    for layer in range(adapter.n_layers):
        heads = removed[layer].nonzero().flatten().tolist()
        adapter.fold_head_ablation(layer, heads, circuit.head_means[layer] if ablation == "mean" else None)
    cut = _cut_kv_groups(adapter, removed)
    config_changes.update(cut.pop("config_changes", {}))
    cut_heads = {(layer, g * G + i) for layer, g in cut["cut"] for i in range(G)}
    zeroed = [[layer, h] for layer, h in removed.nonzero().tolist() if (layer, h) not in cut_heads]
    return {"removed_heads": removed.nonzero().tolist(), "n_heads_removed": int(removed.sum()),
            "n_heads_kept": int((~removed).sum()), "physically_removed": cut, "zeroed_only_heads": zeroed,
            "zeroed_params": len(zeroed) * dh * adapter.d_model, "config_changes": config_changes,
            "head_shape": {"n_heads": H, "n_kv_heads": adapter.n_kv_heads, "head_dim": dh}}


def _ablation_text(ablation: str, circuit: Circuit) -> str:
    if ablation == "zero":
        return "zero: each removed head's columns of the attention output projection set to 0"
    task = circuit.task or "the task"
    return (f"mean: each removed head's mean z over every token of {task}'s attribution examples (one vector per"
            " head), times its columns of the attention output projection, added to that projection's bias;"
            " the columns then set to 0")


def _write_dir(out_dir: Path, write) -> None:
    """Build the checkpoint in a temp dir beside `out_dir`, then rename it into place (an earlier
    export there is replaced; any other non-empty directory is refused)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir())
                                                       and not (out_dir / PROVENANCE_FILE).is_file())):
        raise ExportError(f"{out_dir} exists and is not an earlier export (no {PROVENANCE_FILE}); give a new or"
                          " empty directory.", exit_code=EXIT_USAGE)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_hf(circuit_path: Path, out_dir: Path, ablation: str = "mean", model_cfg: ModelConfig | None = None,
              loaded: LoadedModel | None = None) -> dict[str, Any]:
    """Write the pruned checkpoint of `circuit_path` to `out_dir`; returns the provenance.

    The model is `model_cfg` (default: the one the circuit's config names), loaded afresh on the
    CPU (`loaded`: a model to edit instead; it is changed in place). float32 folds exactly; the
    checkpoint keeps the loaded dtype.
    """
    if ablation not in ABLATIONS:
        raise ExportError(f"--ablation {ablation!r} is not one weights can hold; use one of {', '.join(ABLATIONS)}"
                          " (a counterfactual ablation needs the corrupted prompt at run time).", exit_code=EXIT_USAGE)
    circuit_path = Path(circuit_path)
    circuit = load_circuit(circuit_path)
    _removed_heads(circuit, circuit_path)
    model_cfg = model_cfg or model_config_of(circuit)
    loaded = loaded or load_model(model_cfg, device=torch.device("cpu"))
    adapter = loaded.adapter
    _check_fits(circuit, adapter, model_cfg.name, circuit_path)
    base_sha = weights_hash(loaded.model)
    before = _sizes(loaded.model)
    done = fold_circuit(adapter, circuit, ablation, circuit_path)
    after = _sizes(loaded.model)
    faith = circuit.weight_ablations or {}
    provenance = {
        "format": "hf", "software": software(), "loader": "transformers.AutoModelForCausalLM.from_pretrained(DIR), no CircuitKit code,"
                                  " trust_remote_code off",
        "circuit": {"path": str(circuit_path.resolve()), "sha256": circuit_sha256(circuit_path),
                    "model_name": circuit.model_name, "task": circuit.task, "scope": circuit.scope,
                    "pruning_ablation": circuit.ablation},
        "base_model": {"name": model_cfg.name, "revision": model_cfg.revision, "dtype": str(before_dtype(loaded)),
                       "source": model_source(model_cfg), "weights_sha256": base_sha},
        "exported_weights_sha256": weights_hash(loaded.model),
        "ablation": ablation, "ablation_definition": _ablation_text(ablation, circuit),
        **done,
        "params_before": before["n_params"], "params_after": after["n_params"],
        "param_bytes_before": before["bytes"], "param_bytes_after": after["bytes"],
        "faithfulness": ({**faith.get(ablation, {}), "reference_ablation": faith.get("reference_ablation"),
                          "reference_faithfulness": faith.get("reference_faithfulness")} if faith else None),
    }

    def write(tmp: Path) -> None:
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        provenance["safetensors_bytes"] = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        atomic_write_json(tmp / PROVENANCE_FILE, provenance)

    _write_dir(Path(out_dir), write)
    return provenance


def before_dtype(loaded: LoadedModel) -> torch.dtype:
    return next(loaded.model.parameters()).dtype


def summary_line(out_dir: Path, p: dict[str, Any]) -> str:
    """One line: what was written, the sizes, the faithfulness it keeps."""
    cut = p["physically_removed"]
    shrink = (f"{cut['kv_groups_per_layer']} KV group(s) cut per layer" if cut["kv_groups_per_layer"]
              else "nothing cut (" + (cut["why_not"] or "") + ")")
    f = p.get("faithfulness") or {}
    faith = (f"; faithfulness {f['faithfulness']:.4f} under {p['ablation']} ablation ({f['reference_ablation']}:"
             f" {f['reference_faithfulness']:.4f})" if "faithfulness" in f else "")
    return (f"wrote {out_dir}: {p['n_heads_removed']} heads removed ({p['ablation']}), {shrink}; parameters"
            f" {p['params_before']:,} -> {p['params_after']:,}, {p['param_bytes_before'] / 2**20:.1f} ->"
            f" {p['param_bytes_after'] / 2**20:.1f} MiB{faith}")


def export_parser() -> argparse.ArgumentParser:
    """The arguments of `circuitkit export --format hf` (it has no numeric option)."""
    parser = argparse.ArgumentParser(prog="circuitkit export --format hf",
                                     description="Write the model with the circuit's removed heads folded into its"
                                                 " weights as a Hugging Face checkpoint.")
    parser.add_argument("src", help="circuit.pt (pruning stage)")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--ablation", default="mean", help="mean (per-head mean folded into the output bias) or zero")
    parser.add_argument("--model", default=None, help="the model to prune (default: the one circuit.pt names)")
    parser.add_argument("--precision", default=None, choices=("auto", "bfloat16", "float16", "float32"),
                        help="dtype of the checkpoint (default: the circuit's model.precision)")
    return parser


def export_main(argv: list[str]) -> int:
    """`circuitkit export CIRCUIT.pt --format hf DIR [--ablation mean|zero] [--model M] [--precision P]`."""
    parser = export_parser()
    args = parser.parse_args(argv)
    if args.ablation not in ABLATIONS:
        raise ExportError(f"--ablation {args.ablation!r} is not one weights can hold; use one of"
                          f" {', '.join(ABLATIONS)}.", exit_code=EXIT_USAGE)
    src = Path(args.src)
    if not src.is_file():
        raise ExportError(f"{src} {'is a directory' if src.is_dir() else 'does not exist'}; give the circuit.pt the"
                          " pruning stage wrote.", exit_code=EXIT_USAGE)
    check_writable(Path(args.out), "the output directory", directory=True)
    circuit = load_circuit(src)
    provenance = export_hf(src, Path(args.out), args.ablation, model_config_of(circuit, args.model, args.precision))
    print(summary_line(Path(args.out), provenance))
    return 0
