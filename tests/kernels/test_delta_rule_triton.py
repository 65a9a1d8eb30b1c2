"""The Triton delta rule kernel (under the interpreter on the CPU) against the torch loop it stands in for on a GPU:
outputs and kept states, key widths that are no power of two, value heads split over programs."""

import pytest

from dflash_trt.layers.delta_rule import delta_rule_steps
from tests.layers.test_delta_rule import _inputs


@pytest.mark.parametrize("t, h, dk, dv, keep_from", [(5, 2, 16, 16, 2), (3, 3, 24, 40, 0), (1, 1, 8, 8, 0)],
                         ids=["a verify block, states after its last 3", "odd widths, every state", "one token"])
def test_the_kernel_equals_the_torch_loop(triton_device, t, h, dk, dv, keep_from):
    from dflash_trt.kernels.delta_rule_triton import delta_rule_steps_triton

    q, k, v, beta, log_decay, state = _inputs(2, t, h, dk, dv)
    out, kept = delta_rule_steps(q, k, v, beta, log_decay.exp(), state, keep_from)
    args = [x.to(triton_device) for x in (q, k, v, beta, log_decay.exp(), state)]
    got, got_kept = delta_rule_steps_triton(*args, keep_from)
    assert (got.cpu() - out).abs().max() < 1e-5
    assert got_kept.shape == kept.shape and (got_kept.cpu() - kept).abs().max() < 1e-5
