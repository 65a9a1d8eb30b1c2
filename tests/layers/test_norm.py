"""RMSNorm against transformers' LlamaRMSNorm (fp32 math, cast back, then the weight): torch's ops bit for bit;
the CPU kernel that inference uses is tested in tests/kernels/test_cpu_ops.py."""

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.norm import RMSNorm


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), dim=st.sampled_from([8, 64, 576, 1000]), scale=st.sampled_from([1e-3, 1.0, 600.0]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 99))
def test_rms_norm_equals_the_reference_bit_for_bit(rows, dim, scale, dtype, seed):
    # scale 600 mimics SmolLM2's massive-activation channels, where fp16/bf16 accumulation would overflow or drift
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 3, dim, generator=g) * scale).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    ours, ref = RMSNorm(dim, 1e-5).to(dtype), LlamaRMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad(), mock.patch.object(cpu_ops, "for_tensors", return_value=None):
        ours.weight.copy_(w)
        ref.weight.copy_(w)
        assert torch.equal(ours(x), ref(x))
        total, y = torch.randn_like(x), x.flip(0)
        normed, total = ours.forward_with_residual(x, y)
        assert torch.equal(total, x + y) and torch.equal(normed, ref(x + y))
