"""A mixture of experts' bank of gated MLPs (gpt-oss's, Qwen3-MoE's): each expert's gate and up projections in one
weight, its down projection in another, and the routed tokens run through them expert by expert."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.layers.linear import PackedLinear, can_pack, kernel_serves


class ExpertBank(nn.Module):
    """The experts this rank holds (all of them unless expert-parallel). Subclasses give the activation of an
    expert's gate and up halves."""

    def __init__(self, hidden: int, intermediate: int, experts: range, bias: bool) -> None:
        super().__init__()
        self.experts = experts
        e = len(experts)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * intermediate, hidden))  # [E_local, 2I (gate ; up), H]
        self.down_proj = nn.Parameter(torch.empty(e, hidden, intermediate))  # [E_local, H, I]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * intermediate)) if bias else None  # [E_local, 2I]
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden)) if bias else None  # [E_local, H]
        self.packed: nn.ModuleList | None = None  # per local expert (gate_up, down), set by pack()
        # the routed tokens through every expert in two grouped GEMMs (torch._grouped_mm): None, on a GPU (one
        # product a projection for the whole step, and no host read: a loop of an expert's products at a time
        # launches hundreds of small kernels a layer, after reading the counts back; where torch has no grouped
        # kernel for the GPU or dtype, before SM90, it loops over the groups itself); False where torch's grouped
        # GEMM failed here, True to take it anywhere
        self.grouped: bool | None = None

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pack(self) -> None:
        """Prepack every expert's two projections, one copy each, and drop the stacked weights: the bf16 kernel's
        where it serves both (an expert's rows then come out alike whether one token or a verify block routes to it:
        oneDNN's blocked products round a row apart by how many share the call, and greedy speculative output parted
        from plain decoding's at near-ties), oneDNN's elsewhere (float32, or no kernel on this CPU)."""
        if self.packed is not None:
            return
        kernel = kernel_serves(self.gate_up_proj[0]) and kernel_serves(self.down_proj[0])
        if not kernel and not can_pack(self.gate_up_proj, with_kernel=False):
            return

        def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return None if b is None else b[e]

        self.packed = nn.ModuleList(
            nn.ModuleList([PackedLinear(self.gate_up_proj[e], bias(self.gate_up_proj_bias, e), kernel,
                                        onednn=not kernel),
                           PackedLinear(self.down_proj[e], bias(self.down_proj_bias, e), kernel, onednn=not kernel)])
            for e in range(len(self.experts))
        )
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            delattr(self, name)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # x: [N, H] -> [N, H] through local expert e
        if self.packed is not None:
            gate_up = self.packed[e][0](x)
        else:
            gate_up = F.linear(x, self.gate_up_proj[e], None if self.gate_up_proj_bias is None
                               else self.gate_up_proj_bias[e])
        h = self.activate(*gate_up.chunk(2, dim=-1))
        if self.packed is not None:
            return self.packed[e][1](h)
        return F.linear(h, self.down_proj[e], None if self.down_proj_bias is None else self.down_proj_bias[e])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids/expert_weights [T, k] (global ids) -> this rank's share of the output [T, H]."""
        count, k = len(self.experts), expert_ids.shape[1]
        local = (expert_ids - self.experts.start).flatten()  # [T * k], entry t * k + s: token t's slot s
        local = torch.where((local >= 0) & (local < count), local, count)  # another rank's experts: past the last
        # Grouped on the device: a stable sort keeps ascending expert order and tokens ascending within one, as
        # transformers accumulates (its float summation order); the counts by index_add_, where bincount on a GPU
        # reads its input's range back
        order = torch.argsort(local, stable=True)
        routed = torch.zeros(count + 1, dtype=torch.long, device=x.device).index_add_(0, local, torch.ones_like(local))
        if self.packed is None and (self.grouped or (self.grouped is None and x.is_cuda)):
            try:
                return self._grouped_forward(x, local, order, routed, expert_weights)
            except (RuntimeError, NotImplementedError) as e:
                if isinstance(e, torch.OutOfMemoryError) or type(e).__name__ == "AcceleratorError":
                    raise  # (the device's trouble, not the grouped GEMM's)
                warnings.warn(f"MoE experts run one at a time: torch's grouped GEMM failed here ({str(e)[:200]})",
                              RuntimeWarning, stacklevel=2)  # (once, not once a layer: the warnings filter's)
                self.grouped = False
        out = torch.zeros_like(x)
        # the counts read back once: on a GPU every read waits for the layer's kernels, and a read per routed expert
        # made a verify step wait hundreds of times
        start = 0
        for e, n in enumerate(routed[:count].tolist()):
            if n:
                entries = order[start : start + n]
                token, slot = entries // k, entries % k
                y = self._expert(e, x[token]) * expert_weights[token, slot, None]
                out.index_add_(0, token, y.to(x.dtype))
            start += n
        return out

    def _grouped_forward(self, x: torch.Tensor, local: torch.Tensor, order: torch.Tensor, routed: torch.Tensor,
                         expert_weights: torch.Tensor) -> torch.Tensor:
        """forward's sum by two grouped GEMMs over the routed entries sorted by expert (local: each entry's expert,
        len(experts) for another rank's; order: the entries by expert; routed: how many each expert has), nothing
        read back. Each token's experts are added in ascending order, one slot at a time, as forward's loop adds them
        (an index_add_ of every row at once adds by GPU atomics, in no fixed order)."""
        count, (tokens, k) = len(self.experts), expert_weights.shape
        token, expert = order // k, local[order]
        ends = torch.cumsum(routed[:count], 0).to(torch.int32)
        held = expert < count  # (another rank's entries come last, past every group: no product writes their rows)
        at = expert.clamp(max=count - 1)
        gate_up = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=ends)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[at]
        y = torch._grouped_mm(self.activate(*gate_up.chunk(2, dim=-1)), self.down_proj.transpose(1, 2), offs=ends)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[at]
        y = torch.where(held[:, None], y * expert_weights.flatten()[order, None], 0).to(x.dtype)
        by_entry = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, -1)  # back to [token, slot]
        slots = torch.argsort(local.view(tokens, k), dim=1, stable=True)  # each token's slots by expert
        by_expert = by_entry.gather(1, slots[..., None].expand_as(by_entry))
        out = torch.zeros_like(x)
        for s in range(k):
            out += by_expert[:, s]
        return out


class SiluExperts(ExpertBank):
    """Experts of SwiGLU MLPs (Qwen3-MoE's, Mixtral's): silu(gate) * up."""

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up
