"""The gated delta rule by chunks equals it token by token, and both equal transformers' reference (fp32)."""

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.layers.delta_rule import delta_rule_chunked, delta_rule_steps


def _inputs(b, t, h, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    log_decay = -torch.rand(b, t, h, generator=g) * 2  # exp(g) in (0.14, 1]
    state = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, beta, log_decay, state


@pytest.mark.parametrize("t, chunk", [(100, 64), (64, 64), (37, 16), (5, 8)],
                         ids=["a chunk and a padded one", "one whole chunk", "three chunks, the last padded",
                              "less than a chunk"])
def test_chunks_equal_token_by_token_steps(t, chunk):
    q, k, v, beta, log_decay, state = _inputs(2, t, 3, 8, 6)
    out, kept = delta_rule_steps(q, k, v, beta, log_decay.exp(), state, keep_from=t - 1)
    chunked, last = delta_rule_chunked(q, k, v, beta, log_decay, state, chunk)
    assert (chunked - out).abs().max() < 1e-4
    assert (last - kept[:, -1]).abs().max() < 1e-4


def test_steps_equal_transformers_recurrent_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, beta, log_decay, state = _inputs(2, 20, 3, 8, 6, seed=1)
    ref, ref_state = torch_recurrent_gated_delta_rule(q * 8**0.5, k, v, log_decay, beta, initial_state=state,
                                                      output_final_state=True)
    out, kept = delta_rule_steps(q, k, v, beta, log_decay.exp(), state, keep_from=0)
    assert (out - ref).abs().max() < 1e-5 and (kept[:, -1] - ref_state).abs().max() < 1e-5
    assert kept.shape == (2, 20, 3, 8, 6)
