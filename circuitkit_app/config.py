"""The pipeline's whole config: `AppConfig`, one section per group, each schema from its owner.

    model      circuitkit.models.config.ModelConfig
    discovery  circuitkit.discovery.config.DiscoveryConfig (pruning, export beside it)
    grads      gradian.settings.grads.GradsConfig
    attribute  gradian.settings.attribute.AttributeConfig
    preflight  circuitkit.preflight.config.PreflightConfig
    report     circuitkit_app.report.config.ReportConfig

It lives in the entry layer because it is the one place that knows every owner. Registered in
Hydra's ConfigStore as `schema` (conf/config.yaml lists it first), so every group file is merged
into its typed dataclass. The machinery (strict validation, override checks, Hydra's compose API
and its errors in one line) is the runner core's (`circuitkit.core.config.RootSchema`); here it is
bound to AppConfig with the rules that read several sections (`check_cross_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from circuitkit.core.config import ConfigError, RootSchema, _f
from circuitkit.core.flags import MAX_SEED
from circuitkit.discovery.config import DiscoveryConfig, ExportConfig, PruningConfig, check_discovery
from circuitkit.models.config import ModelConfig, check_placement
from circuitkit.preflight.config import PreflightConfig
from circuitkit_app.report.config import ReportConfig
from gradian.settings.attribute import AttributeConfig
from gradian.settings.grads import GradsConfig, check_grads

ALL_STAGES = ("preflight", "data", "attribution", "pruning", "export", "grads", "attribute")
# What a run without `stages=` runs: every stage but `attribute`, which needs an eval set of its own
# (attribute.eval_path) and a fine-tuned model; list it to run it.
DEFAULT_STAGES = ALL_STAGES[:-1]


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "model group"})
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig, metadata={"doc": "discovery group"})
    pruning: PruningConfig = field(default_factory=PruningConfig, metadata={"doc": "pruning group"})
    export: ExportConfig = field(default_factory=ExportConfig, metadata={"doc": "export group"})
    grads: GradsConfig = field(default_factory=GradsConfig, metadata={"doc": "grads group"})
    attribute: AttributeConfig = field(default_factory=AttributeConfig, metadata={"doc": "attribute group"})
    preflight: PreflightConfig = field(default_factory=PreflightConfig, metadata={"doc": "preflight group"})
    report: ReportConfig = field(default_factory=ReportConfig, metadata={"doc": "report group"})
    stages: list[str] = _f(list(DEFAULT_STAGES), "stages to run, in pipeline order (attribute runs only when listed)",
                           choices=ALL_STAGES)
    output_path: Optional[str] = _f(None, "where circuit.pt is written; null = <run dir>/circuit.pt")
    seed: int = _f(0, "seed for data sampling and anything random", ge=0, le=MAX_SEED)
    skip_completed: bool = _f(True, "skip stages whose artifacts and config hash match the manifest")


def register_configs() -> None:
    """Register the root schema `schema` in Hydra's ConfigStore.

    `conf/config.yaml` lists it first in its defaults, so every group file is merged into its
    typed dataclass (ModelConfig, DiscoveryConfig, ...). Group-level entries are not stored:
    they would show up as a bogus choice (`model=schema`) in Hydra's option lists.
    """
    ConfigStore.instance().store(name="schema", node=AppConfig)


register_configs()


def _check_attribute(cfg: AppConfig) -> None:
    """The attribute stage's settings agree with `stages`: listed, it needs an eval set, a base model
    and an index; attribute.eval_path without the stage would be silently ignored."""
    a, listed = cfg.attribute, "attribute" in cfg.stages
    if a.eval_path is not None and not listed:
        with_it = [s for s in ALL_STAGES if s in cfg.stages or s == "attribute"]
        raise ConfigError(f"Config key 'attribute.eval_path' = {a.eval_path!r} is set, but stages does not list"
                          f" attribute, so nothing would read it: add the stage (stages=[{','.join(with_it)}]) or"
                          " drop attribute.eval_path.")
    if not listed:
        return
    if a.eval_path is None:
        raise ConfigError("Config key 'attribute.eval_path' is null, but stages lists attribute, which measures the"
                          " fine-tune's regression on an eval set: set attribute.eval_path=EVAL.jsonl ({prompt,"
                          " completion} rows, the completion being the answer), or drop attribute from stages.")
    if not a.eval_path.strip():
        raise ConfigError("Config key 'attribute.eval_path' is empty: give the eval set's JSONL file.")
    if not cfg.model.adapter and not cfg.model.base_name:
        raise ConfigError("stages lists attribute, which compares the tuned model with the model it was tuned from,"
                          f" but model.name {cfg.model.name!r} has neither: set model.adapter=DIR (a LoRA fine-tune"
                          " of model.name) or model.base_name=NAME_OR_DIR (model.name is a full fine-tune of it).")
    if not cfg.grads.enabled and not cfg.grads.index_dir:
        raise ConfigError("Config key 'grads.enabled' = False, but stages lists attribute, which ranks the rows of"
                          " the gradient index the grads stage writes: set grads.enabled=true, or grads.index_dir="
                          "INDEX for an index made before.")


def check_cross_fields(cfg: AppConfig) -> None:
    """The rules that read several keys: each owner's own (placement, grads, discovery), then those
    that read several sections (the stages, the attribute stage, the adapter's linears)."""
    check_placement(cfg.model)
    check_grads(cfg.grads)
    if cfg.grads.module_filter and "adapter" in cfg.grads.module_filter and not cfg.model.adapter:
        raise ConfigError("Config key 'grads.module_filter' names 'adapter' (the linears of a LoRA adapter), but"
                          " model.adapter is null: set model.adapter=DIR, or drop 'adapter' from the filter.")
    order = [s for s in ALL_STAGES if s in cfg.stages]
    if list(cfg.stages) != order:
        raise ConfigError(f"Config key 'stages' = {list(cfg.stages)} must list stages in pipeline order"
                          f" {list(ALL_STAGES)}; e.g. stages=[{','.join(order)}].")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ConfigError(f"Config key 'stages' = {list(cfg.stages)} names a stage twice.")
    _check_attribute(cfg)
    check_discovery(cfg.discovery)


APP = RootSchema(AppConfig, check_cross_fields)


def validate(cfg: DictConfig | Mapping[str, Any] | AppConfig) -> AppConfig:
    """Check a composed config (or a plain dict shaped like it) and return the typed AppConfig.

    Missing keys take the schema defaults; anything unknown, mistyped or out of range raises
    ConfigError naming the key, the value and what is allowed.
    """
    return APP.validate(cfg)


def check_overrides(overrides: Iterable[str], ranges: bool = True) -> None:
    """Command-line overrides checked against AppConfig before Hydra composes them
    (`RootSchema.check_overrides`; a sweep passes ranges=False)."""
    APP.check_overrides(overrides, ranges)


def compose(overrides: Iterable[str] = (), config_name: str = "config") -> tuple[DictConfig, AppConfig]:
    """Compose the config like `python -m circuitkit.run` would, with Hydra's compose API.

    Returns the composed DictConfig and its validated AppConfig.
    """
    return APP.compose(overrides, config_name)


def compose_with_run_dir(overrides: Iterable[str], config_name: str = "config",
                         config_dir: str | None = None) -> tuple[AppConfig, str]:
    """The validated AppConfig and `hydra.run.dir` resolved now, from one composition."""
    return APP.compose_with_run_dir(overrides, config_name, config_dir)


def hydra_dir(overrides: Iterable[str], kind: str = "run", config_name: str = "config",
              config_dir: str | None = None) -> str:
    """`hydra.run.dir` (kind "run") or `hydra.sweep.dir` ("sweep") as these overrides set it, resolved now."""
    return APP.hydra_dir(overrides, kind, config_name, config_dir)
