"""Where EAP-IG takes its gradients: interpolation points α_k and quadrature weights w_k.

The EAP-IG score integrates the gradient along e(α) = ẽ + α (e − ẽ), α ∈ [0, 1]:

    ∫₀¹ g(α) dα  ≈  Σ_k w_k g(α_k),   Σ_k w_k = 1,

with one forward+backward pass per point, so `ig_steps` is the number of passes for every rule.
The rules (m = ig_steps) and the polynomial degree of g they integrate exactly:

    right           α_k = k/m,            k = 1..m, w_k = 1/m                 degree 0 (the reference EAP-IG at
                                                                                node level; m = 1 is EAP)
    midpoint        α_k = (k − ½)/m,      k = 1..m, w_k = 1/m                 degree 1, error O(1/m²)
    trapezoid       α_k = k/(m − 1),      k = 0..m−1, w = (½, 1, …, 1, ½)/(m−1) degree 1, error O(1/m²);
                                                                                α = 0 is a pass at the corrupted input
    gauss_legendre  Gauss-Legendre nodes and weights mapped from [−1, 1]    degree 2m − 1
    left            α_k = k/m,            k = 0..m−1, w_k = 1/m               degree 0 (the reference EAP-IG at
                                                                                edge level)

Which rule is the reference (hannamw/EAP-IG, what MIB runs): its node-level EAP-IG-inputs
(`attribute_node.get_scores_eap_ig`) samples α = k/m for k = 1..m, our `right`; its edge-level
EAP-IG (`attribute.get_scores_eap_ig`) loops `for step in range(0, steps)` with α = step/steps, k = 0..m−1: it
evaluates the corrupted point α = 0 and never the clean one, our `left`. No other rule reproduces
its edge scores (they differ by 10-12 % relative at the same m). With m = 1 the reference's
edge-level "EAP-IG" is the gradient at the corrupted input alone, which is not EAP (EAP takes it
at the clean input: `right` with m = 1, or algorithm=eap).

This module is the one place that turns (algorithm, ig_steps, ig_rule) into points; the
attribution core and the memory estimate both read it. It imports nothing heavy so the
preflight can use it before torch models exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from circuitkit.core.config import choices
from circuitkit.discovery.config import DiscoveryConfig

DEFAULT_IG_STEPS = 30  # used when discovery.ig_steps is null
IG_RULES = choices(DiscoveryConfig, "ig_rule")
DEFAULT_IG_RULE = "right"
# Highest polynomial degree of the integrand each rule integrates exactly with m points.
EXACT_DEGREE = {"right": lambda m: 0, "midpoint": lambda m: 1, "trapezoid": lambda m: 1,
                "gauss_legendre": lambda m: 2 * m - 1, "left": lambda m: 0}


@dataclass(frozen=True)
class Quadrature:
    """Points α_k in [0, 1] and weights w_k = relative_weights[k] / len(alphas) (they sum to 1).

    The weights are kept relative to the plain mean (1.0 for every point of the right and
    midpoint rules) so that the equal-weight rules multiply by nothing and stay bit-identical
    to a plain sum divided by m.
    """

    alphas: tuple[float, ...]
    relative_weights: tuple[float, ...]
    rule: str

    @property
    def weights(self) -> tuple[float, ...]:
        n = len(self.alphas)
        return tuple(r / n for r in self.relative_weights)

    @property
    def passes(self) -> int:
        """Forward+backward passes per batch: one per point."""
        return len(self.alphas)


def quadrature(rule: str, m: int) -> Quadrature:
    """The m-point rule `rule` on [0, 1] (see the module docstring)."""
    if rule not in IG_RULES:
        raise ValueError(f"discovery.ig_rule={rule!r} is not a rule; choose one of {', '.join(IG_RULES)}")
    if m < 1:
        raise ValueError(f"discovery.ig_steps={m} must be >= 1 (1 is EAP)")
    if rule == "right":
        return Quadrature(tuple(k / m for k in range(1, m + 1)), (1.0,) * m, rule)
    if rule == "left":  # the reference's edge-level grid: α = 0 (corrupted) included, α = 1 (clean) never
        return Quadrature(tuple(k / m for k in range(m)), (1.0,) * m, rule)
    if rule == "midpoint":
        return Quadrature(tuple((k - 0.5) / m for k in range(1, m + 1)), (1.0,) * m, rule)
    if rule == "trapezoid":
        if m < 2:
            raise ValueError("discovery.ig_rule=trapezoid needs discovery.ig_steps >= 2 (its points include"
                             " both ends, α = 0 and α = 1); use ig_rule=right for ig_steps=1 (EAP)")
        inner = m / (m - 1)
        rel = tuple(inner * (0.5 if k in (0, m - 1) else 1.0) for k in range(m))
        return Quadrature(tuple(k / (m - 1) for k in range(m)), rel, rule)
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(m)  # nodes on [-1, 1], weights summing to 2
    return Quadrature(tuple(float(a) for a in (x + 1) / 2), tuple(float(r) for r in w * m / 2), rule)


def resolved_steps(ig_steps: int | None) -> int:
    """discovery.ig_steps as run: null means DEFAULT_IG_STEPS (30)."""
    return DEFAULT_IG_STEPS if ig_steps is None else ig_steps


def integration_rule(algorithm: str, ig_steps: int | None, ig_rule: str = DEFAULT_IG_RULE) -> Quadrature:
    """Points and weights of `algorithm`: eap = gradient at the clean input; clean-corrupted =
    mean of the gradients at α = 0 and 1; eap-ig = `ig_rule` with ig_steps points (null = 30)."""
    if algorithm == "eap":
        return Quadrature((1.0,), (1.0,), "right")
    if algorithm == "clean-corrupted":
        return Quadrature((0.0, 1.0), (1.0, 1.0), "clean-corrupted")
    if algorithm == "eap-ig":
        return quadrature(ig_rule, resolved_steps(ig_steps))
    raise ValueError(f"algorithm {algorithm!r} is not gradient-based; use circuitkit.discovery.attribution.exact")


def interpolation_points(algorithm: str, ig_steps: int | None, ig_rule: str = DEFAULT_IG_RULE) -> list[float]:
    """The α values at which gradients are taken (one pass each)."""
    return list(integration_rule(algorithm, ig_steps, ig_rule).alphas)
