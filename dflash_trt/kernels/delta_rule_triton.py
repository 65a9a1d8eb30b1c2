"""Triton kernel for the gated delta rule token by token (semantics and CPU path: layers/delta_rule.py's
delta_rule_steps): one program per (row, value head, block of value channels) holds its slice of the [key, value]
state on chip through all of the step's tokens, where the torch loop launches about ten kernels a token and layer
(a verify block of 16 tokens through a Qwen3.5's 24 linear layers: some 4,000 launches). Each token's update is the
same code whatever the step's token count, so a verify step rounds as one-token steps do.
"""

from __future__ import annotations

import torch

from dflash_trt.kernels import on_device_of, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402


@triton.jit
def _delta_rule_steps_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr, state_ptr, out_ptr, kept_ptr, T, H,
                             keep_from, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_V: tl.constexpr):
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    tile = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    state = tl.load(state_ptr + (b * H + h) * K * V + state_offs, mask=tile, other=0.0)
    kept_count = T - keep_from
    for t in range(0, T):
        token = (b * T + t) * H + h
        q = tl.load(q_ptr + token * K + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + token * K + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + token * V + offs_v, mask=mask_v, other=0.0)
        state = state * tl.load(decay_ptr + token)
        remembered = tl.sum(state * k[:, None], axis=0)
        state = state + k[:, None] * ((v - remembered) * tl.load(beta_ptr + token))[None, :]
        tl.store(out_ptr + token * V + offs_v, tl.sum(state * q[:, None], axis=0), mask=mask_v)
        if t >= keep_from:
            slot = (b * kept_count + t - keep_from) * H + h
            tl.store(kept_ptr + slot * K * V + state_offs, state, mask=tile)


def delta_rule_steps_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                            decay: torch.Tensor, state: torch.Tensor,
                            keep_from: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """layers/delta_rule.py's delta_rule_steps (fp32 tensors, any device Triton launches on)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, decay, state = (x.float().contiguous() for x in (q, k, v, beta, decay, state))
    out = torch.empty(b, t, h, dv, dtype=torch.float32, device=q.device)
    kept = torch.empty(b, max(t - keep_from, 0), h, dk, dv, dtype=torch.float32, device=q.device)
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // block_k))  # the state slice a program holds
    with on_device_of(q):
        _delta_rule_steps_kernel[(b, h, triton.cdiv(dv, block_v))](
            q, k, v, beta, decay, state, out, kept, t, h, keep_from, K=dk, V=dv, BLOCK_K=block_k, BLOCK_V=block_v)
    return out, kept if kept.shape[1] else None
