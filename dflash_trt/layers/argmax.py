"""Greedy token choice: `torch.argmax` over the last dimension, through the CPU kernel where it serves.

torch reduces each row of a [rows, V] argmax on one thread, and slowly for bf16: a verify block's 3 rows of
SmolLM2's 49,152 logits took 0.2-0.4 ms inside the decode loop, 2-3% of a whole step. The kernel
(kernels/cpu_ops.c `argmax_rows`) is one vectorised pass per row with torch's result: the first index of the
maximum, a NaN counting as the maximum.
"""

from __future__ import annotations

import torch

from dflash_trt.kernels import cpu_ops


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [..., V]; long indices of shape [...]."""
    if x.shape[-1] and x.numel() and cpu_ops.CpuOps.supports(x):
        ops = cpu_ops.load()
        if ops is not None:
            return ops.argmax(x)
    return x.argmax(-1)
