"""`circuitkit discover-smart`: size the run to the device, or just print the memory estimate.

    circuitkit discover-smart --model gemma4b --algorithm eap-ig --task mmlu --check-memory
    circuitkit discover-smart --model builtin:induction --algorithm eap-ig --task induction pruning.target_sparsity=0.5

`--model` is a model group (`conf/model/NAME.yaml`), a hub name or a local directory. With
`--check-memory` nothing is loaded: the estimate comes from the model's shape. Without it,
the largest `discovery.batch_size` that fits is chosen and the circuit stages run.
"""

from __future__ import annotations

import argparse
import dataclasses

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from circuitkit.core.config import CONF_DIR, AppConfig, DiscoveryConfig, choices, compose
from circuitkit.core.device import free_memory_bytes, get_device
from circuitkit.core.errors import EXIT_USAGE, UserError
from circuitkit.core.pipeline import make_console
from circuitkit.discovery.attribution.memory import (
    advice,
    attribution_estimate,
    ig_advice,
    largest_fitting_batch,
)
from circuitkit.preflight.stage import table
from circuitkit_app.run import main as run_main
from circuitkit_app.stage_list import CIRCUIT_STAGE_NAMES

# The budget table of the memory guide: these models at ig_steps=5, batch_size=4, num_examples=128.
BUDGET_MODELS = ("gpt2", "llama1b", "llama3b", "gemma4b")


def model_group_for(model: str) -> str | None:
    """The group in conf/model/ that `model` names: the group itself (`gemma4b`) or its hub name
    (`google/gemma-3-4b-it`), so known models keep their shape offline."""
    if (CONF_DIR / "model" / f"{model}.yaml").is_file():
        return model
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        if OmegaConf.load(path).get("name") == model:
            return path.stem
    return None


def _overrides(args: argparse.Namespace) -> list[str]:
    group = model_group_for(args.model)
    model = f"model={group}" if group else f"model.name={args.model}"
    algo = ["discovery=eap"] if args.algorithm == "eap" else [f"discovery.algorithm={args.algorithm}"]
    return [model, *algo, f"discovery.task={args.task}",
            f"stages=[{','.join(CIRCUIT_STAGE_NAMES)}]", *args.overrides]


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def budget_table(seq_len: int) -> Table:
    """Estimated peaks of the named models: weights only, EAP-IG default, and all levers pulled."""
    table = Table(title=f"attribution peak estimates (node level, {seq_len} tokens per example)")
    for col in ("model", "weights (bf16)", "eap-ig, batch 4, ig_steps 5", "batch 1, ig_steps 3"):
        table.add_column(col, justify="right")
    for name in BUDGET_MODELS:
        _, cfg = compose([f"model={name}", "discovery.ig_steps=5", "discovery.batch_size=4",
                          "discovery.data_params.num_examples=128", f"discovery.data_params.seq_len={seq_len}"])
        default = attribution_estimate(cfg)
        small = attribution_estimate(dataclasses.replace(
            cfg, discovery=dataclasses.replace(cfg.discovery, batch_size=1, ig_steps=3)))
        table.add_row(f"{name} ({cfg.model.name})", _gib(default.terms.get("weights", 0)), _gib(default.total_bytes),
                      _gib(small.total_bytes))
    return table


def check_memory(cfg: AppConfig, console: Console) -> int:
    """Print the estimate for `cfg` and whether it fits; load nothing. Exit status 0."""
    try:
        estimate = attribution_estimate(cfg)
    except (OSError, ValueError) as err:
        if isinstance(err, UserError):
            raise
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise UserError(f"the shape of {cfg.model.name!r} is not known offline (its config.json cannot be read:"
                        f" {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}). Pass a"
                        f" known model ({known}), its hub name, a local model directory, or give the shape as"
                        " model.shape.* overrides (family, n_layers, n_heads, n_kv_heads, head_dim, d_model, d_mlp,"
                        " vocab_size, n_params).", EXIT_USAGE) from None
    free = free_memory_bytes()
    console.print(table(estimate, free, cfg.preflight.headroom,
                        f"{cfg.model.name}: {cfg.discovery.algorithm} {cfg.discovery.level} level,"
                        f" batch {cfg.discovery.batch_size}"))
    budget = int(cfg.preflight.headroom * free)
    if estimate.total_bytes <= budget:
        console.print(f"[green]fits[/green] on {get_device()}.")
    else:
        console.print(f"[red]does not fit[/red] on {get_device()}; try: " + "; ".join(advice(cfg, budget)))
    if line := ig_advice(cfg):
        console.print(f"time/accuracy: {line}", markup=False, highlight=False)
    if (CONF_DIR / "model").is_dir():
        console.print(budget_table(cfg.discovery.data_params.seq_len))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="circuitkit discover-smart", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model group, hub name or local directory")
    parser.add_argument("--algorithm", required=True, choices=choices(DiscoveryConfig, "algorithm"))
    parser.add_argument("--task", required=True, choices=choices(DiscoveryConfig, "task"))
    parser.add_argument("--check-memory", action="store_true", help="print the estimate and exit; loads nothing")
    parser.add_argument("overrides", nargs="*", help="further key=value overrides")
    args = parser.parse_args(argv)

    console = make_console()
    _, cfg = compose(_overrides(args))
    if args.check_memory:
        return check_memory(cfg, console)

    budget = int(cfg.preflight.headroom * free_memory_bytes())
    best = min(largest_fitting_batch(cfg, budget), cfg.discovery.data_params.num_examples)
    if best == 0:
        raise UserError("even discovery.batch_size=1 does not fit; run with --check-memory for the terms and"
                        " what to change.")
    console.print(f"discovery.batch_size={best}: the largest that fits ({budget / 2**30:.2f} GiB usable)")

    if line := ig_advice(cfg):
        console.print(f"time/accuracy: {line}", markup=False, highlight=False)

    return run_main([*_overrides(args), f"discovery.batch_size={best}"])
