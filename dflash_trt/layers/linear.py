"""Linears for CPU inference: this project's bf16 GEMV kernel for decode-sized inputs, oneDNN-prepacked above.

A bf16 or fp32 GEMV through oneDNN with the weight reordered once into its blocked layout runs about
2x faster on AVX-512 CPUs than `F.linear` on the plain weight, with bit-identical results. For up to
KERNEL_MAX_ROWS rows (decode and verify steps, short prompt chunks) the bf16 kernel in kernels/cpu_ops.c is
faster still when the weights stream from memory (120 SmolLM2 linears: 5.6 against 6.7 ms at 4 rows, 5.8 against
7.8 at 8, a tie at 32, benchmarks/bench_cpu_ops.py; with AMX tiles, 30 gate/up projections: 4.9 against 6.7 ms at
32 rows, 6.9 against 8.2 at 64, a tie at 128), and it computes every row the same way whatever rows share the call,
so a one-token decode and a K-token verify round alike. It reads the plain weight, or on CPUs with AMX a copy in AMX's
tile order (kernels/cpu_ops.c), so a bf16 model holds its projections twice or three times (SmolLM2: 212 MB more
each). Applied as a transform after the model is built (never in model code).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.kernels import cpu_ops

_PACKABLE = (torch.float32, torch.bfloat16)
# Rows up to which the bf16 kernel serves a linear where oneDNN packs it too, by the weight layout this CPU's kernel
# reads (cpu_ops.linear_layout): dot products ("rows": AVX-512 BF16, or AVX2 and FMA on CPUs without it; measured
# with AVX-512 BF16), or AMX tiles, whose cost grows far slower with the rows. AVX2 panels (CPUs without AVX-512)
# meet a oneDNN that packs bf16 only with AVX-NE-CONVERT; elsewhere no packed weight bounds them. Their 128 is not
# measured against oneDNN: panels ran 32 rows at ~140 GFLOP/s on an AVX2 EPYC (benchmarks/README.md, "AVX2 panels").
KERNEL_MAX_ROWS = {"rows": 32, "tiles": 128, "panels": 128}
# Rows up to which the kernel's dot products serve a linear that holds no oneDNN copy (PackedLinear(onednn=False))
# where oneDNN has bf16; past them torch's linear on the plain weight, its reorder paid each call (an expert's
# 5760 x 2880 projection: the kernel 12.6 against torch's 11.9 ms at 128 rows, 27.5 against 21.7 at 256, 57.3 against
# 44.5 at 512, oneDNN's packed copy 40.9; AMD EPYC with AVX-512 BF16, 2 threads, 2026-12-07). Not lower than AMX
# tiles' reach: a router of 32 experts, whose width tiles do not take, sits beside tiled projections.
UNPACKED_MAX_ROWS = KERNEL_MAX_ROWS["tiles"]


def onednn_packs(weight: torch.Tensor) -> bool:
    """oneDNN prepacks this weight: bf16 only where the CPU has its bf16 instructions (AVX-512, AVX-NE-CONVERT); on
    an AVX2 laptop its reorder raises."""
    return (weight.device.type == "cpu" and weight.dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def can_pack(weight: torch.Tensor, with_kernel: bool = True) -> bool:
    """A PackedLinear serves this weight: oneDNN prepacks it, or (with_kernel) the bf16 kernel reads it."""
    return onednn_packs(weight) or (with_kernel and kernel_serves(weight))


def kernel_serves(weight: torch.Tensor) -> bool:
    """The bf16 kernel serves this [N, K] weight on this CPU (PackedLinear(onednn=False) can hold it)."""
    ops = cpu_ops.load() if weight.device.type == "cpu" and weight.dim() == 2 else None
    return ops is not None and ops.linear_layout(weight) is not None


class PackedLinear(nn.Module):
    """with_kernel=False leaves the bf16 kernel out (its weight can be a copy of its own), onednn=False oneDNN's copy:
    for weights too many to hold twice, such as gpt-oss's experts, which then take the kernel where it serves them
    (its rows alike in a one-token decode and a verify) and oneDNN elsewhere. Without oneDNN's copy the kernel serves
    up to UNPACKED_MAX_ROWS rows in its dot products' layout where oneDNN has bf16 (torch's linear on the plain weight
    above), else every row count; where its weight is a reordered copy the plain one is dropped: such a linear runs
    only where the kernel does (inference, bf16 inputs). Where oneDNN cannot pack the weight (bf16 on an AVX2 CPU),
    rows past the kernel's run torch's linear on the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, with_kernel: bool = True,
                 onednn: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # The batch-size hint only tunes the blocking; any number of rows works.
        onednn_bf16 = onednn_packs(weight)  # (whether or not this linear takes a copy of its own)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1) if onednn and onednn_bf16 else None
        self.bias = None if bias is None else bias.detach().clone()
        ops = cpu_ops.load() if with_kernel and weight.dtype == torch.bfloat16 else None
        # The kernel's own copy: in its "rows" layout the weight itself (for a tied output head the embedding,
        # already resident), in "tiles" a reordered copy.
        self.kernel_weight = ops.kernel_weight(weight) if ops is not None else None
        self.kernel_layout = None if self.kernel_weight is None else ops.linear_layout(weight)
        self.kernel_max_rows = 0
        if self.kernel_weight is not None:
            if self.packed is not None:
                self.kernel_max_rows = KERNEL_MAX_ROWS[self.kernel_layout]
            elif self.kernel_layout == "rows" and onednn_bf16:
                # oneDNN's bf16 without a copy of its own (onednn=False): torch's linear on the plain weight past these
                self.kernel_max_rows = UNPACKED_MAX_ROWS
            else:
                # without oneDNN's bf16 only torch's unblocked bf16 matmul is left, far slower than the kernel at any
                # size
                self.kernel_max_rows = sys.maxsize
        if self.packed is None and self.kernel_weight is None:
            raise ValueError(f"no packed or kernel path serves a {weight.dtype} weight of shape {tuple(weight.shape)} "
                             "here (check can_pack first)")
        reordered = self.kernel_weight is not None and self.kernel_layout != "rows"
        self.weight = None if self.packed is not None or (not onednn and reordered) else weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None and x.numel() <= self.kernel_max_rows * self.in_features:
            ops = cpu_ops.for_tensors(x, self.kernel_weight)
            if ops is not None:
                return ops.linear(x, self.kernel_weight, self.bias)
        return self.forward_packed(x)

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's packed linear (or torch's where oneDNN cannot pack the weight), whatever the row count."""
        if self.packed is None:
            if self.weight is None:
                raise RuntimeError(f"this {self.out_features} x {self.in_features} linear keeps only the bf16 kernel's "
                                   f"copy of its weight, which serves bf16 inference only (got {x.dtype} inputs, "
                                   f"grad {'on' if torch.is_grad_enabled() else 'off'})")
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def kernel_weights(*linears: nn.Module) -> list[torch.Tensor] | None:
    """The weights the bf16 kernel reads (PackedLinear.kernel_weight), one per linear, or None unless the kernel
    serves every one of them (the condition for running a whole layer in one C call)."""
    weights = [getattr(linear, "kernel_weight", None) for linear in linears]
    return None if any(w is None for w in weights) else weights


def kernel_layout(model: nn.Module) -> str | None:
    """The layout (cpu_ops.linear_layout) of most of the weights the bf16 kernel serves in `model`, by size: "tiles"
    (AMX, where a verify step's extra rows cost about what one row does), "panels" (AVX2), "rows" (dot products), or
    None where the kernel serves none."""
    sizes = {"tiles": 0, "panels": 0, "rows": 0}
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.kernel_weight is not None:
            sizes[m.kernel_layout] += m.kernel_weight.numel()
    if not any(sizes.values()):
        return None
    return max(sizes, key=sizes.get)  # the first of a tie, in the order above


def row_invariant_rows(model: nn.Module) -> int | None:
    """The most rows a forward of `model` may carry for each to come out as it would in a one-row forward: the bf16
    kernel's reach (PackedLinear.kernel_max_rows) where it serves the linears, past which oneDNN's blocked products
    round apart; None unless it serves every one (no row count keeps oneDNN's or a GPU's products alike)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears or any(m.kernel_weight is None for m in linears):
        return None
    return min(m.kernel_max_rows for m in linears)


def pack_linears(model: nn.Module) -> int:
    """Replace every packable nn.Linear in `model` by a PackedLinear; returns how many were packed."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count
