"""`dflash::draft_attention`: block queries over [per-row context K/V ; the block's own K/V] (KV injection).

The DFlash drafter's attention (arXiv 2602.06036 §3). Row b's context holds `ctx_lens[b]` tokens at
positions 0..ctx_lens[b]-1 of its cache row `cache_rows[b]`; the block's Q tokens sit at positions
ctx_lens[b] + j and bring their own K/V. A query at position p sees key position t when
- non-causal (full drafter layers): always (the whole context and the whole block);
- causal (sliding drafter layers): t <= p;
- with a window W > 0 additionally p - t < W, and for non-causal layers also t - p < W
  (flash-attn's window (W-1, 0) causal / (W-1, W-1) non-causal, as TensorRT-LLM passes it).
GQA: query head h reads kv head h // (H // KVH). An optional per-head sink logit joins the softmax
denominator and contributes no value (gpt-oss).

Worked example: ctx_lens = [3, 1], Q = 2, no window. Row 0's queries (positions 3, 4) see cache
positions 0..2 plus block keys at 3, 4; row 1's (positions 1, 2) see cache position 0 plus its
block keys. Cache entries at or past ctx_lens[b] are never read, so stale or padded writes there
are harmless.
"""

from __future__ import annotations

import torch

from dflash_trt.layers.attention import attend


def draft_attention_ref(
    q: torch.Tensor,  # [B, Q, H, D]
    k_block: torch.Tensor,  # [B, Q, KVH, D]
    v_block: torch.Tensor,  # [B, Q, KVH, D]
    k_cache: torch.Tensor,  # [R, KVH, S, D] (any strides)
    v_cache: torch.Tensor,  # [R, KVH, S, D]
    cache_rows: torch.Tensor,  # [B] long: cache row of each batch row
    ctx_lens: torch.Tensor,  # [B] int: context tokens of each row (the block starts there)
    scale: float,
    causal: bool = False,
    window: int = 0,  # 0: no window
    sinks: torch.Tensor | None = None,  # [H] float logits
) -> torch.Tensor:  # [B, Q, H, D]
    """The semantics, in torch: place the block after each row's context and attend with a position mask."""
    b, n = q.shape[:2]
    ctx = ctx_lens.to(torch.long)
    rows = cache_rows.to(torch.long)
    longest = int(ctx.max())
    k_ctx = k_cache[:, :, :longest].index_select(0, rows)  # [B, KVH, max ctx, D]: copies only what is read
    v_ctx = v_cache[:, :, :longest].index_select(0, rows)
    if bool((ctx == longest).all()):  # equal contexts (always at batch 1): the block simply follows
        k_all = torch.cat([k_ctx, k_block.transpose(1, 2).to(k_ctx.dtype)], dim=2)  # [B, KVH, T, D]
        v_all = torch.cat([v_ctx, v_block.transpose(1, 2).to(v_ctx.dtype)], dim=2)
    else:  # ragged: the block goes at positions ctx[b] + j; entries past a row's context are never read
        stale = torch.arange(longest, device=q.device)[None, :] >= ctx[:, None]  # [B, max ctx]
        room = k_ctx.new_zeros(b, k_ctx.shape[1], n, k_ctx.shape[3])  # the block may be longer than any context
        k_all = torch.cat([k_ctx.masked_fill(stale[:, None, :, None], 0), room], dim=2)
        v_all = torch.cat([v_ctx.masked_fill(stale[:, None, :, None], 0), room.clone()], dim=2)
        pos = ctx[:, None] + torch.arange(n, device=q.device)  # [B, Q]
        brow = torch.arange(b, device=q.device)[:, None]
        k_all[brow, :, pos] = k_block.to(k_all.dtype)
        v_all[brow, :, pos] = v_block.to(v_all.dtype)
    total = longest + n
    t = torch.arange(total, device=q.device)[None, None, :]  # [1, 1, T] key positions
    p = (ctx[:, None] + torch.arange(n, device=q.device))[:, :, None]  # [B, Q, 1] query positions
    visible = (t <= p) if causal else (t < (ctx + n)[:, None, None])
    if window > 0:
        visible = visible & (p - t < window)
        if not causal:
            visible = visible & (t - p < window)
    mask = None if bool(visible.all()) else visible[:, None]
    out = attend(q.transpose(1, 2), k_all, v_all, mask, scale, sinks)  # [B, Q, H * D]
    return out.view(q.shape)


@torch.library.custom_op("dflash::draft_attention", mutates_args=())
def draft_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    causal: bool = False,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton on CUDA, the reference elsewhere. Shapes as in `draft_attention_ref`; reads, never writes, the cache."""
    if q.is_cuda:
        from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

        return draft_attention_triton(q, k_block, v_block, k_cache, v_cache, cache_rows, ctx_lens, scale, causal, window, sinks)
    return draft_attention_ref(q, k_block, v_block, k_cache, v_cache, cache_rows, ctx_lens, scale, causal, window, sinks)


@draft_attention.register_fake
def _(q, k_block, v_block, k_cache, v_cache, cache_rows, ctx_lens, scale, causal=False, window=0, sinks=None):
    return q.new_empty(q.shape)
