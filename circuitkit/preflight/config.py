"""The `preflight` group's schema: what the memory preflight does when an estimate does not fit."""

from __future__ import annotations

from dataclasses import dataclass

from circuitkit.core.config import _f


@dataclass
class PreflightConfig:
    on_exceed: str = _f("error", "when the estimate exceeds free memory", choices=("error", "warn"))
    headroom: float = _f(0.9, "fraction of free device memory a run may plan to use", gt=0.0, le=1.0)
    ig_error_budget: float = _f(0.01, "EAP-IG score error (relative L2) the ig_rule/ig_steps advice stays within",
                                gt=0.0, lt=1.0)
