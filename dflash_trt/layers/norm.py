"""RMSNorm as Llama/Qwen3 reference code computes it: in fp32, cast back, then scaled by the weight."""

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops.for_tensors(x, self.weight)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)[0]
        # torch's fused rms_norm accumulates bf16/fp16 input in fp32 and rounds once, which is the reference's
        # x.float() -> normalise -> .to(dtype) bit for bit (tests/layers/test_norm.py) without two copies per call.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a pre-norm layer's residual add and the next norm, one pass on the CPU."""
        ops = cpu_ops.for_tensors(x, residual, self.weight)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        total = x + residual
        return self.forward(total), total
