"""Non-finite factor sums are refused before any decomposition, naming the module and the setting.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.refusals import (
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
)


@pytest.mark.parametrize("projection", ["eigen", "whitened", "spectrum"])
def test_non_finite_factor_sums_are_refused_before_any_decomposition(projection, monkeypatch):
    from circuitkit.core.errors import UserError
    from gradian.curvature.allocation import spectrum_widths
    from gradian.curvature.factors import FactorSums
    from gradian.curvature.whitening import eigen_tensors, whitened_tensors

    def no_decomposition(*args, **kwargs):
        raise AssertionError("a decomposition ran on non-finite factors")
    for name in ("eigh", "eigvalsh"):
        monkeypatch.setattr(torch.linalg, name, no_decomposition)
    sums = FactorSums(["h.0.mlp", "h.1.mlp"])
    sums.projected = projection == "eigen"
    for name in sums.names:
        sums.a[name], sums.s[name] = torch.eye(4, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    sums.s["h.1.mlp"][1, 1] = float("inf")
    sums.tokens = 10
    call = {"eigen": lambda: eigen_tensors(None, sums, 4), "whitened": lambda: whitened_tensors(None, sums, 4),
            "spectrum": lambda: spectrum_widths({n: (3, 4) for n in sums.names}, sums, 4, 4)}[projection]
    with pytest.raises(UserError) as err:
        call()
    text = str(err.value)
    assert "output-gradient (S) sum of module h.1.mlp" in text and "NaN or infinity" in text
    assert {"eigen": "grads.projection=eigen", "whitened": "grads.projection=whitened",
            "spectrum": "grads.width_allocation=spectrum"}[projection] in text
    assert err.value.exit_code == 1
