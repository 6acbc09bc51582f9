"""Closed-form backward of LayerNorm / RMSNorm, batched over many output gradients.

For y = γ ⊙ x̂ (+ β), with x̂ = (x - μ)/σ (LayerNorm) or x / rms (RMSNorm), and g = ∂m/∂y:

    LayerNorm:  ∂m/∂x = (g' - mean(g') - x̂ · mean(g' ⊙ x̂)) / σ,   g' = γ ⊙ g
    RMSNorm:    ∂m/∂x = (g' - x̂ · mean(g' ⊙ x̂)) / rms

The Jacobian depends on x only, so one x serves every head's gradient at once.
"""

from __future__ import annotations

import torch

from circuitkit.models.adapters import NormSpec


def norm_backward(spec: NormSpec, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient at the norm's input. x: (B, T, d) the input; g: (n, B, T, d) output gradients.

    Returns (n, B, T, d) float32.
    """
    x = x.float()
    if spec.kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)  # 1/σ or 1/rms, (B, T, 1)
    x_hat = x * inv
    g = g.float()
    if spec.weight is not None:
        g = g * spec.weight.float()
    out = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
    if spec.kind == "layernorm":
        out = out - g.mean(-1, keepdim=True)
    return out * inv
