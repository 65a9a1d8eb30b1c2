"""Triton kernels for `dflash::verify_block` (semantics: verify_block.py, oracle: verify_block_ref).

`choice_kernel`, one program per (row, block position): GREEDY rows take the argmax of the logits
in one streaming pass (per-lane running maxima, so the logits are read exactly once); MATCH rows
draw by inverse CDF from the sampler's probabilities. `accept_kernel`, one program per row: the
accepted prefix, the bonus token, and for REJECTION rows the ratio test and the residual draw.
CDFs accumulate in float64 and compare in float32, as torch's CPU cumsum does, so the kernels
pick the reference's token except within a rounding step of a CDF boundary.
"""

from __future__ import annotations

import torch

from dflash_trt.kernels import on_device_of, require_triton
from dflash_trt.kernels.verify_block import GREEDY, MATCH, REJECTION, target_probs

triton = require_triton()
import triton.language as tl  # noqa: E402


@triton.jit
def _argmax_row(ptr, V, BLOCK_V: tl.constexpr):
    # torch.argmax's: the first index of the maximum, a NaN counting as the maximum (as the CPU path's argmax)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        take = (x > best) | ((x != x) & (best == best))  # strict: each lane keeps its first maximum, or first NaN
        best = tl.where(take, x, best)
        best_idx = tl.where(take, offs, best_idx)
    nan = best != best
    first_nan = tl.min(tl.where(nan, best_idx, V), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    first_top = tl.min(tl.where(best == top, best_idx, V), axis=0)
    return tl.where(first_nan < V, first_nan, first_top)


@triton.jit
def _total(ptr, sub_ptr, V, HAS_SUB: tl.constexpr, BLOCK_V: tl.constexpr):
    # sum over v of x (HAS_SUB: of max(x - y, 0)), accumulated in float64
    acc = tl.zeros([BLOCK_V], tl.float64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
        if HAS_SUB:
            x = tl.maximum(x - tl.load(sub_ptr + offs, mask=offs < V, other=0.0).to(tl.float32), 0.0)
        acc += x.to(tl.float64)
    return tl.sum(acc, axis=0)


@triton.jit
def _weights(ptr, sub_ptr, denom, offs, valid, HAS_SUB: tl.constexpr):
    # float32 weights: x, or max(x - y, 0) / denom (the reference's normalised residual)
    x = tl.load(ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_SUB:
        x = tl.maximum(x - tl.load(sub_ptr + offs, mask=valid, other=0.0).to(tl.float32), 0.0) / denom
    return x


@triton.jit
def _inverse_cdf(ptr, sub_ptr, denom, u, V, HAS_SUB: tl.constexpr, BLOCK_V: tl.constexpr):
    """Index drawn by u from the weights: the count of CDF entries <= u * total (torch.searchsorted, right=True)."""
    acc = tl.zeros([BLOCK_V], tl.float64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        acc += _weights(ptr, sub_ptr, denom, offs, offs < V, HAS_SUB).to(tl.float64)
    target = u * tl.sum(acc, axis=0).to(tl.float32)
    running = tl.sum(tl.zeros([BLOCK_V], tl.float64), axis=0)
    count = tl.sum(tl.zeros([BLOCK_V], tl.int32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        valid = offs < V
        x64 = _weights(ptr, sub_ptr, denom, offs, valid, HAS_SUB).to(tl.float64)
        cdf = (running + tl.cumsum(x64, axis=0)).to(tl.float32)
        count += tl.sum((valid & (cdf <= target)).to(tl.int32), axis=0)
        running += tl.sum(x64, axis=0)
    return tl.minimum(count, V - 1)


# K and K + 1 change with the draft-length schedule: specialised (on 1 and multiples of 16), a new value would
# compile again in the middle of serving
@triton.jit(do_not_specialize=["K1"])
def choice_kernel(
    LOGITS, PROBS, U, MODES,  # inputs: logits / probs [B, K + 1, V] contiguous, uniforms [B, K + 1], modes [B]
    V, K1,
    CHOICE,  # output [B, K + 1] int64
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.program_id(1)
    mode = tl.load(MODES + b)
    row = (b * K1 + i).to(tl.int64) * V
    choice = tl.program_id(1) * 0
    if mode == 0:
        choice = _argmax_row(LOGITS + row, V, BLOCK_V)
    elif mode == 1:
        u = tl.load(U + b * K1 + i)
        choice = _inverse_cdf(PROBS + row, PROBS + row, 1.0, u, V, False, BLOCK_V)
    tl.store(CHOICE + b * K1 + i, choice.to(tl.int64))


@triton.jit(do_not_specialize=["K"])
def accept_kernel(
    DRAFT, CHOICE, PROBS, DPROBS, U, MODES,  # inputs: drafts [B, K], choices [B, K + 1], probs, draft probs [B, K, V]
    V, K,
    NUM_ACCEPTED, BONUS,  # outputs [B] int64
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    mode = tl.load(MODES + b)
    K1 = K + 1
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    d = tl.load(DRAFT + b * K + offs_k, mask=in_k, other=0)
    if mode == 2:
        p = tl.load(PROBS + (b * K1 + offs_k).to(tl.int64) * V + d, mask=in_k, other=0.0)
        q = tl.load(DPROBS + (b * K + offs_k).to(tl.int64) * V + d, mask=in_k, other=1.0)
        u = tl.load(U + b * K1 + offs_k, mask=in_k, other=1.0)
        ok = u * q < p
    else:
        ok = d == tl.load(CHOICE + b * K1 + offs_k, mask=in_k, other=-1)
    a = tl.min(tl.where(in_k & ~ok, offs_k, K), axis=0)  # length of the accepted prefix
    if mode == 2:
        p_row = PROBS + (b * K1 + a).to(tl.int64) * V
        u_last = tl.load(U + b * K1 + K)
        if a < K:
            q_row = DPROBS + (b * K + a).to(tl.int64) * V
            mass = _total(p_row, q_row, V, True, BLOCK_V).to(tl.float32)
            if mass > 0:
                bonus = _inverse_cdf(p_row, q_row, mass, u_last, V, True, BLOCK_V)
            else:  # p == q exactly: no rejection was possible, p is the answer
                bonus = _inverse_cdf(p_row, p_row, 1.0, u_last, V, False, BLOCK_V)
        else:  # all K accepted: the bonus comes from p_K
            bonus = _inverse_cdf(p_row, p_row, 1.0, u_last, V, False, BLOCK_V)
    else:
        bonus = tl.load(CHOICE + b * K1 + a).to(tl.int32)  # token ids fit; one type on every branch
    tl.store(NUM_ACCEPTED + b, a.to(tl.int64))
    tl.store(BONUS + b, bonus.to(tl.int64))


def verify_block_triton(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K + 1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V] float32
    uniforms: torch.Tensor,  # [B, K + 1] float32
    modes: torch.Tensor,  # [B]
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    block_v: int | None = None,  # vocabulary tile; None: 2048 on CUDA, 64 in the interpreter
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on the logits' device (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    b, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    logits = target_logits.contiguous()
    probs = target_probs(logits, modes, temperature, top_k, top_p, draft_probs)  # the runtime's sampler, sampled rows
    probs = logits if probs is None else probs
    dprobs = (probs if draft_probs is None else draft_probs).contiguous()
    u = uniforms.to(torch.float32).contiguous()
    modes = modes.to(torch.int32).contiguous()
    drafts = draft_tokens.to(torch.int64).contiguous()
    bv = block_v or (2048 if logits.is_cuda else 64)
    choice = torch.empty(b, k + 1, dtype=torch.int64, device=logits.device)
    num_accepted = torch.empty(b, dtype=torch.int64, device=logits.device)
    bonus = torch.empty(b, dtype=torch.int64, device=logits.device)
    # REJECTION rows need no per-position choice: their programs store 0 (no read to skip an all-REJECTION batch)
    with on_device_of(logits):
        choice_kernel[(b, k + 1)](logits, probs, u, modes, vocab, k + 1, choice, BLOCK_V=bv,
                                  num_warps=8 if logits.is_cuda else 4)
        accept_kernel[(b,)](
            drafts, choice, probs, dprobs, u, modes, vocab, k, num_accepted, bonus,
            BLOCK_K=max(16, triton.next_power_of_2(k)), BLOCK_V=bv,
        )
    return num_accepted, bonus


assert (GREEDY, MATCH, REJECTION) == (0, 1, 2), "the kernels test modes by these literal values"
