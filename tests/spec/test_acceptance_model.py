"""The geometric acceptance model by its definition: tau = 1 + alpha + ... + alpha^K, and its inverse."""

import pytest

from dflash_trt.spec.acceptance_model import alpha_from_tau, tau_from_acceptance


def test_acceptance_model_by_its_definition():
    assert tau_from_acceptance(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tau_from_acceptance(0.0, 9) == 1.0 and tau_from_acceptance(1.0, 9) == 10.0
    for alpha, k in ((0.3, 3), (0.8, 9), (0.95, 15)):
        assert alpha_from_tau(tau_from_acceptance(alpha, k), k) == pytest.approx(alpha, abs=1e-9)
    with pytest.raises(ValueError, match=r"must be in \[1, 4\]"):
        alpha_from_tau(4.5, 3)
