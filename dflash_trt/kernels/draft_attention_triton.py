"""Triton kernel for `dflash::draft_attention` (semantics: draft_attention.py, oracle: draft_attention_ref).

One program per (row, kv head, context split) packs that kv head's GROUPS query heads x Q block slots
into one M = GROUPS * Q tile, so each context K/V tile is read once per kv head (GQA packing, as in
flash-decoding). The context is streamed in BLOCK_N tiles with an online softmax; the block's own
K/V form one more tile, handled by the last split. With num_splits > 1 (few rows, long contexts)
the splits write partial (acc, max, sum) and `_combine_kernel` merges them (and the sinks).
Non-constexpr arguments are ordered inputs, scalars, outputs, as TensorRT AOT plugins launch them. The block length
and the split count are runtime scalars, not constants: the torch op launches every draft length a schedule and a
request's end give it and a split count per batch size, and Triton compiles a kernel per set of constants, mid-serving
(the AOT plugin bakes them in as constants all the same).
"""

from __future__ import annotations

import math

import torch

from dflash_trt.kernels import on_device_of, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

_LOG2E = 1.4426950408889634


@triton.jit
def _tile_update(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    # q [M, D], k/v [N, D], visible [M, N]; online softmax in base 2.
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Triton would still compile a kernel apart for an int argument equal to 1 or divisible by 16 (K = 15, 16 or 32
# splits): not these two.
@triton.jit(do_not_specialize=["q_len", "num_splits"])
def draft_attention_kernel(
    Q, KB, VB, KC, VC, ROWS, CTX, SINKS,  # inputs
    s_qb, s_qq, s_qh,  # q [B, Q, H, D] (unit stride on D)
    s_kbb, s_kbq, s_kbh,  # k_block / v_block [B, Q, KVH, D]
    s_kcr, s_kch, s_kcs,  # k_cache / v_cache [R, KVH, S, D]
    s_ob, s_oq, s_oh,  # out [B, Q, H, D]
    qk_scale, window, q_len, num_splits,  # scale * log2(e); window 0 = none; block slots; context splits
    OUT, ML,  # outputs: OUT, or with splits partial acc [B, H, S, Q, D] and ML [B, H, S, Q, 2] (float32)
    KVH: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // KVH
    kvh = pid % KVH
    row = tl.load(ROWS + b).to(tl.int64)
    ctx = tl.load(CTX + b).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    g = offs_m // q_len  # query head within the group
    j = offs_m % q_len  # block slot
    m_valid = offs_m < GROUPS * q_len
    h = kvh * GROUPS + g
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + b * s_qb + j[:, None] * s_qq + h[:, None] * s_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qpos = ctx + j

    # A finite "minus infinity" for the running max: exp2(m - m) of a row that saw nothing stays 1, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Context keys sit before every query, so only the window can hide them: skip tiles wholly outside it.
    if HAS_WINDOW:
        lo = tl.maximum(ctx + 1 - window, 0)
    else:
        lo = ctx * 0
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)
    kc_base = KC + row * s_kcr + kvh * s_kch
    vc_base = VC + row * s_kcr + kvh * s_kch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(kc_base + offs_n[:, None] * s_kcs + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_base + offs_n[:, None] * s_kcs + offs_d[None, :], mask=kv_mask, other=0.0)
        visible = n_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (qpos[:, None] - offs_n[None, :] < window)
        if DOT_FP32:
            k = k.to(tl.float32)
        m_i, l_i, acc = _tile_update(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_FP32)

    if split == num_splits - 1:  # the block's own K/V, at positions ctx + i
        offs_i = tl.arange(0, BLOCK_Q)
        i_valid = offs_i < q_len
        kv_mask = i_valid[:, None] & d_valid[None, :]
        kb_off = b * s_kbb + offs_i[:, None] * s_kbq + kvh * s_kbh + offs_d[None, :]
        k = tl.load(KB + kb_off, mask=kv_mask, other=0.0)
        v = tl.load(VB + kb_off, mask=kv_mask, other=0.0)
        visible = i_valid[None, :] & m_valid[:, None]
        if CAUSAL:
            visible = visible & (offs_i[None, :] <= j[:, None])
        if HAS_WINDOW:
            visible = visible & (j[:, None] - offs_i[None, :] < window)
            if not CAUSAL:
                visible = visible & (offs_i[None, :] - j[:, None] < window)
        if DOT_FP32:
            k = k.to(tl.float32)
        m_i, l_i, acc = _tile_update(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_FP32)

    if num_splits == 1:
        if HAS_SINKS:
            sink = tl.load(SINKS + h, mask=m_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f)
            acc = acc * tl.exp2(m_i - m_f)[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on padded rows, never stored
        o_ptr = OUT + b * s_ob + j[:, None] * s_oq + h[:, None] * s_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    else:
        # partials [B, H, num_splits, q_len, D] and [B, H, num_splits, q_len, 2]; OUT is the fp32 acc here
        base = ((b * (KVH * GROUPS) + h) * num_splits + split) * q_len + j
        tl.store(OUT + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=m_valid[:, None])
        tl.store(ML + base * 2, m_i, mask=m_valid)
        tl.store(ML + base * 2 + 1, l_i, mask=m_valid)


@triton.jit(do_not_specialize=["q_len", "num_splits"])
def _combine_kernel(
    ACC, ML, SINKS, OUT, s_ob, s_oq, s_oh, q_len, num_splits,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)  # b * H + h
    b = pid // H
    h = pid % H
    offs_j = tl.arange(0, BLOCK_Q)
    j_valid = offs_j < q_len
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_Q], -1.0e30, tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(ML + ((pid * num_splits + s) * q_len + offs_j) * 2, mask=j_valid, other=-1.0e30))
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    l_tot = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for s in range(num_splits):
        base = (pid * num_splits + s) * q_len + offs_j
        m_s = tl.load(ML + base * 2, mask=j_valid, other=-1.0e30)
        l_s = tl.load(ML + base * 2 + 1, mask=j_valid, other=0.0)
        w = tl.exp2(m_s - m)
        l_tot += l_s * w
        acc += tl.load(ACC + base[:, None] * BLOCK_D + offs_d[None, :], mask=j_valid[:, None], other=0.0) * w[:, None]
    if HAS_SINKS:
        l_tot += tl.exp2(sink - m)
    out = acc / tl.where(j_valid, l_tot, 1.0)[:, None]
    o_ptr = OUT + b * s_ob + offs_j[:, None] * s_oq + h * s_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=j_valid[:, None] & (offs_d[None, :] < HEAD_DIM))


def _pow2(x: int, least: int = 16) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(x))))


def num_splits_for(batch: int, kv_heads: int, cache_len: int, device: torch.device) -> int:
    """Split the context when rows x kv heads cannot fill the GPU (decided from static sizes: graph-safe)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / (batch * kv_heads))
    return max(1, min(want, math.ceil(cache_len / 512), 32))


def tiles(dtype: torch.dtype, groups: int, q_len: int, head_dim: int, on_cuda: bool = True) -> dict:
    """The kernel's tile sizes and launch options for this shape; off CUDA (the interpreter) a context tile of 16
    keys. fp32 tiles take twice the shared memory: 64 keys in 3 stages needed 131-180 KB for gpt-oss's and
    Qwen3-8B's drafters, past an RTX 30/40 or L4's 99 KB and an A100's 163 (Triton's OutOfResources at launch); 32
    keys in 2 stages take 66-74 KB."""
    block_m, block_d = _pow2(groups * q_len), _pow2(head_dim)
    fp32 = dtype == torch.float32
    return {"BLOCK_M": block_m, "BLOCK_N": (32 if fp32 else 64) if on_cuda else 16, "BLOCK_Q": _pow2(q_len),
            "BLOCK_D": block_d, "DOT_FP32": fp32, "num_warps": 8 if block_m * block_d >= 8192 else 4,
            "num_stages": 2 if fp32 else 3}


def draft_attention_triton(
    q: torch.Tensor,  # [B, Q, H, D]
    k_block: torch.Tensor,  # [B, Q, KVH, D]
    v_block: torch.Tensor,
    k_cache: torch.Tensor,  # [R, KVH, S, D]
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,  # [B]
    ctx_lens: torch.Tensor,  # [B]
    scale: float,
    causal: bool = False,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [H]
    num_splits: int | None = None,  # None: num_splits_for(...)
    block_n: int | None = None,  # context tile; None: 64 on CUDA (32 in fp32), 16 in the interpreter
) -> torch.Tensor:  # [B, Q, H, D]
    """Launch the kernel on q's device (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    b, n, h, d = q.shape
    kvh = k_block.shape[2]
    if h % kvh:
        raise ValueError(f"draft_attention: {h} query heads are not a multiple of {kvh} kv heads")
    tensors = [q, k_block, v_block, k_cache, v_cache]
    q, k_block, v_block, k_cache, v_cache = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    # One set of strides serves each pair: the blocks are a step's few rows, copied where their strides differ (the
    # runtime's k and v are views of one projection); a cache is copied whole only where its pair's differ.
    if k_block.stride() != v_block.stride():
        k_block, v_block = k_block.contiguous(), v_block.contiguous()
    if k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    # The kernel reads row b's entries at ROWS + b and CTX + b: the drafter passes its positions' first column, a view
    # whose stride is the block length (read as is, rows past the first took another row's context length).
    cache_rows, ctx_lens = cache_rows.contiguous(), ctx_lens.contiguous()
    sinks = sinks.contiguous() if sinks is not None else None  # read at SINKS + h too
    groups = h // kvh
    splits = num_splits or num_splits_for(b, kvh, k_cache.shape[2], q.device)
    block_d = _pow2(d)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if splits > 1:
        acc = torch.empty(b, h, splits, n, block_d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, splits, n, 2, dtype=torch.float32, device=q.device)
    else:
        acc, ml = out, out
    meta = tiles(q.dtype, groups, n, d, q.is_cuda)
    if block_n:
        meta["BLOCK_N"] = block_n
    with on_device_of(q):
        draft_attention_kernel[(b * kvh, splits)](
            q, k_block, v_block, k_cache, v_cache, cache_rows, ctx_lens, sinks if sinks is not None else q,
            q.stride(0), q.stride(1), q.stride(2),
            k_block.stride(0), k_block.stride(1), k_block.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            scale * _LOG2E, window, n, splits,
            acc, ml,
            KVH=kvh, GROUPS=groups, HEAD_DIM=d,
            CAUSAL=causal, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None, **meta,
        )
        if splits > 1:
            _combine_kernel[(b * h,)](
                acc, ml, sinks if sinks is not None else acc, out, out.stride(0), out.stride(1), out.stride(2), n,
                splits,
                H=h, HEAD_DIM=d, BLOCK_Q=_pow2(n), BLOCK_D=block_d, HAS_SINKS=sinks is not None,
            )
    return out
