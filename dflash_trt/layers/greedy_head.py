"""GreedyHead: the greedy token of a bf16 output head, bit for bit the full head's argmax, reading half its bytes.

At one to a few rows the output head is read from memory, not computed: SmolLM2's 49,152 x 576 bf16 head is 57 MB,
2.3 ms of a 12 ms decode step on the 2-core CPU (benchmarks/profile_step.py). An int8 copy with one scale per
output feature screens every feature with a guaranteed error bound, and only the 64-feature groups that can hold
the maximum are computed exactly, by the same bf16 kernel as the full head (kernels/cpu_ops.c `head_argmax_bf16`:
the bound and why the chosen token is exactly the full head's, ties and rounding included). On SmolLM2's decode
steps the median step computes 2 of the head's 768 groups exactly (at most 34 in 60 steps measured at one row).
Sampling needs every logit and keeps the full head.
"""

from __future__ import annotations

import torch

from dflash_trt.kernels import cpu_ops


class GreedyHead:
    def __init__(self, weight: torch.Tensor, kernel_weight: torch.Tensor) -> None:
        """weight: the head [N, K] as torch holds it (bf16, finite); kernel_weight: cpu_ops' copy of it."""
        n = weight.shape[0]
        self.int8 = cpu_ops.Int8Weight(weight)
        self.kernel_weight = kernel_weight
        # Above these rows the screen costs more than the full head (kernels/cpu_ops.c head_screen_rows).
        self.max_rows = cpu_ops.load().head_screen_rows()
        # Reused by every call (a fresh one is mmap'd and page-faulted each step): a GreedyHead serves one thread,
        # the engine's.
        self._scratch = torch.empty(3 * self.max_rows * n // 2, dtype=torch.float32)

    @staticmethod
    def serves(weight: torch.Tensor, kernel_weight: torch.Tensor | None) -> bool:
        """Whether the screen applies: a CPU with its kernel, a bf16 head the bf16 kernel computes, in whole
        64-feature groups of at most Int8Weight.MAX_INPUTS inputs, finite."""
        ops = cpu_ops.load()
        return (ops is not None and ops.has_int8_kernels() and kernel_weight is not None
                and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % 64 == 0
                and weight.shape[1] <= cpu_ops.Int8Weight.MAX_INPUTS and bool(torch.isfinite(weight).all()))

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy tokens for hidden [..., K] (bf16, CPU), or None where the screen declines (the caller then
        runs the full head): more than max_rows rows, a row that is not finite, logits past fp32's range, no kernel
        for this CPU."""
        ops = cpu_ops.for_tensors(hidden)
        if ops is None or hidden.dtype != torch.bfloat16 or hidden.numel() > self.max_rows * hidden.shape[-1]:
            return None
        out = ops.head_argmax(hidden.reshape(-1, hidden.shape[-1]), self.int8, self.kernel_weight, self._scratch)
        return None if out is None else out.view(hidden.shape[:-1])
