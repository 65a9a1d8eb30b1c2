"""The geometric acceptance model by its definition: tau = 1 + alpha + ... + alpha^K."""

import pytest

from dflash_trt.spec.acceptance_model import tau_from_acceptance


def test_acceptance_model_by_its_definition():
    assert tau_from_acceptance(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tau_from_acceptance(0.0, 9) == 1.0 and tau_from_acceptance(1.0, 9) == 10.0
