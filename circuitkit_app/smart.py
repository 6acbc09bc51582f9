"""`circuitkit discover-smart`: size the run to the device, or just print the memory estimate.

    circuitkit discover-smart --model gemma4b --algorithm eap-ig --task mmlu --check-memory
    circuitkit discover-smart --model builtin:induction --algorithm eap-ig --task induction pruning.target_sparsity=0.5

`--model` is a model group (`conf/model/NAME.yaml`), a hub name or a local directory. With
`--check-memory` no weights are loaded: each stage's estimate (attribution, pruning) comes from
the model's shape and the task's prompts tokenized with the model's tokenizer when it is on this
machine (`circuitkit.discovery.data_lengths`; else at discovery.data_params.seq_len, said so).
Without it, the largest `discovery.batch_size` that fits every stage that will run is chosen,
the stage that bounds it named, and the circuit stages run.
"""

from __future__ import annotations

import argparse
import dataclasses

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from circuitkit.core.config import CONF_DIR, choices
from circuitkit.core.device import free_memory_bytes, get_device
from circuitkit.core.errors import EXIT_USAGE, UserError
from circuitkit.core.pipeline import make_console
from circuitkit.discovery.attribution.memory import attribution_estimate, ig_advice
from circuitkit.discovery.config import DiscoveryConfig
from circuitkit.preflight.memory import MemoryEstimate, largest_fitting
from circuitkit.preflight.stage import table
from circuitkit_app.config import AppConfig, compose
from circuitkit_app.run import main as run_main
from circuitkit_app.stage_list import CIRCUIT_STAGE_NAMES, PIPELINE

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


def _with_batch(cfg: AppConfig, batch_size: int) -> AppConfig:
    return dataclasses.replace(cfg, discovery=dataclasses.replace(cfg.discovery, batch_size=batch_size))


def stage_estimates(cfg: AppConfig) -> dict[str, MemoryEstimate]:
    """{stage: estimate} for the stages `cfg` selects that declare one (at the tokenized prompt
    lengths where the stage knows them: `circuitkit.discovery.data_lengths`)."""
    out = {}
    for stage in PIPELINE.selected(cfg):
        if stage.memory is not None and (estimate := stage.memory.estimate(cfg)) is not None:
            out[stage.name] = estimate
    return out


def largest_batch(cfg: AppConfig, budget_bytes: int) -> tuple[int, dict[str, int]]:
    """(the largest discovery.batch_size at which every selected stage's estimate fits
    `budget_bytes`, {stage: the largest that stage alone allows}); at most num_examples, past
    which a batch holds the same pairs. 0 when even 1 does not fit."""
    cap = cfg.discovery.data_params.num_examples
    per_stage = {}
    for stage in PIPELINE.selected(cfg):
        if stage.memory is None:
            continue

        def fits(batch_size: int, stage=stage) -> bool:
            estimate = stage.memory.estimate(_with_batch(cfg, batch_size))
            return estimate is None or estimate.total_bytes <= budget_bytes

        per_stage[stage.name] = largest_fitting(fits, cap)
    return min(per_stage.values(), default=cap), per_stage


def bound_line(best: int, per_stage: dict[str, int], cap: int) -> str:
    """Which stage decided the batch size, e.g. 'bound by pruning (attribution alone: 32)'."""
    if best >= cap:
        return f"every stage fits the whole num_examples={cap} in one batch"
    bound = [name for name, b in per_stage.items() if b == best]
    others = ", ".join(f"{name} alone: {b}" for name, b in per_stage.items() if b != best)
    return f"bound by {' and '.join(bound)}" + (f" ({others})" if others else "")


def _unknown_shape(cfg: AppConfig, err: Exception) -> UserError:
    known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
    return UserError(f"the shape of {cfg.model.name!r} is not known offline (its config.json cannot be read:"
                     f" {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}). Pass a"
                     f" known model ({known}), its hub name, a local model directory, or give the shape as"
                     " model.shape.* overrides (family, n_layers, n_heads, n_kv_heads, head_dim, d_model, d_mlp,"
                     " vocab_size, n_params).", EXIT_USAGE)


def check_memory(cfg: AppConfig, console: Console) -> int:
    """Print every selected stage's estimate (attribution, pruning), whether it fits and the
    largest batch that fits them all; load nothing (the tokenizer, when on this machine, to
    measure the prompts). Exit status 0."""
    try:
        estimates = stage_estimates(cfg)
    except (OSError, ValueError) as err:
        if isinstance(err, UserError):
            raise
        raise _unknown_shape(cfg, err) from None
    free = free_memory_bytes()
    budget = int(cfg.preflight.headroom * free)
    d = cfg.discovery
    stages = {stage.name: stage for stage in PIPELINE.selected(cfg)}
    for name, estimate in estimates.items():
        what = f"{d.algorithm} {d.level} level" if name == "attribution" else name
        if line := estimate.lengths.get("line"):
            console.print(f"{name}: {line}", markup=False, highlight=False, soft_wrap=True)
        console.print(table(estimate, free, cfg.preflight.headroom, f"{cfg.model.name}: {what}, batch {d.batch_size}"))
        if estimate.total_bytes <= budget:
            console.print(f"{name}: [green]fits[/green] on {get_device()}.")
        else:
            console.print(f"{name}: [red]does not fit[/red] on {get_device()}; try: "
                          + "; ".join(stages[name].memory.advice(cfg, budget)))
    best, per_stage = largest_batch(cfg, budget)
    if per_stage:
        console.print(f"largest discovery.batch_size that fits every stage: {best};"
                      f" {bound_line(best, per_stage, d.data_params.num_examples)}", markup=False, highlight=False,
                      soft_wrap=True)
    if line := ig_advice(cfg):
        console.print(f"time/accuracy: {line}", markup=False, highlight=False)
    if (CONF_DIR / "model").is_dir():
        console.print(budget_table(d.data_params.seq_len))
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
    best, per_stage = largest_batch(cfg, budget)
    if best == 0:
        failing = ", ".join(name for name, b in per_stage.items() if b == 0)
        raise UserError(f"even discovery.batch_size=1 does not fit the {failing} stage ({budget / 2**30:.2f} GiB"
                        " usable); run with --check-memory for the terms and what to change.")
    console.print(f"discovery.batch_size={best}: the largest that fits every stage ({budget / 2**30:.2f} GiB usable);"
                  f" {bound_line(best, per_stage, cfg.discovery.data_params.num_examples)}", markup=False,
                  highlight=False, soft_wrap=True)

    if line := ig_advice(cfg):
        console.print(f"time/accuracy: {line}", markup=False, highlight=False)

    return run_main([*_overrides(args), f"discovery.batch_size={best}"])
