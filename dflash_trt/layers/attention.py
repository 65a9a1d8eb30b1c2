"""Attention metadata (which cache rows, positions and visible keys) and the attention call.

One `AttentionMetadata` serves every layer of one forward. Visibility is derived from absolute
positions only, which is what makes rollback free (see engine/kv_cache.py):
- causal (target, prefill and verify): key t is visible to the query at position p iff t <= p;
- block (drafter): every query of a row sees all keys t < block_end[row], i.e. the drafter
  context plus the whole block, bidirectionally;
- a sliding window additionally hides keys with p - t >= window (and t - p >= window in blocks);
- tree (target, verifying a draft tree: spec/draft_tree.py): the step's tokens are written at consecutive cache
  positions from the row's first one, but each takes its rotary position from its depth; keys before that first
  position stay causal, and of the step's own keys a query sees only its ancestors and itself (a bitmask).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.linear import KERNEL_MAX_ROWS

KEY_BUCKET = 64  # keys the grouped CPU path reads: the live length rounded up to a multiple of this
KERNEL_MAX_QUERIES = 16  # steps of up to this many queries per row take the CPU kernels (decode, verify, draft)
# Whole steps of up to this many tokens (decode, verify, prompt chunks) may attend through the CPU kernels whatever a
# row's query count, where the projections take AMX tiles (or where oneDNN has no bf16: an AVX2 CPU); above, the
# kernels' per-query attention falls behind SDPA's (SmolLM2-135M, 2 threads: a 64-token prompt 22 against 34 ms, 256
# tokens 75 against 86, 512 tokens 177 against 166). With AVX-512 dot products, as far as the linear kernel serves (32
# rows): kernel_step_tokens.
KERNEL_MAX_STEP_TOKENS = 256
# SDPA's CUDA backends without cuDNN's: PyTorch picks cuDNN's attention for masked steps on Hopper, and it builds an
# execution plan for every new shape (H200, 2026-12-04, benchmarks/profile_train_step.py: ~52 ms a forward call and
# ~0.5 s a backward one on the CPU side, 8 and 2.5 ms of GPU work), while this runtime's shapes change every step
# (key counts, context lengths, batch rows): a training step of 128 sequences took ~11 s, the GPU mostly idle.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class QueryKeys:
    rows: torch.Tensor  # int64 [N]: each query's cache row
    positions: torch.Tensor  # int64 [N]: where its own K/V go
    lens: torch.Tensor  # int64 [N]: the keys it sees, [0, lens)
    longest: int
    tree: torch.Tensor | None = None  # int64 [N, 2]: (first tree position, visible-key bits) per query (tree steps)


@dataclass(frozen=True)
class HostRows:
    """The host's copies of what a step's metadata would otherwise read back from the device (on a GPU each read
    waits for every kernel queued before it): each row's cache row and first query position, the row's queries lying
    at consecutive positions from there, clamped below `limit` where a padded batch would run past the cache (for a
    drafter block the row's keys end where its block does)."""

    slots: list[int]
    starts: list[int]
    limit: int | None = None
    lens: list[int] | None = None  # each row's real queries where fewer than the step's (a prompt chunk's padding)

    def kv_len(self, queries: int) -> int:
        end = max(self.starts) + queries
        return end if self.limit is None else min(end, self.limit)

    def clamped(self, queries: int) -> bool:
        return self.limit is not None and max(self.starts) + queries > self.limit

    @property
    def first(self) -> int:
        """The lowest query position."""
        return min(self.starts) if self.limit is None else min(min(self.starts), self.limit - 1)

    @property
    def aligned(self) -> bool:
        """Every row's queries at the same positions."""
        return min(self.starts) == max(self.starts)

    @property
    def row_slice(self) -> slice | None:
        return _slice_of(self.slots)


@dataclass
class AttentionMetadata:
    rows: torch.Tensor  # [B] cache rows
    positions: torch.Tensor  # [B, Q] absolute positions of the queries (and of the K/V they write)
    kv_len: int  # keys [0, kv_len) are read from the cache
    causal: bool = True
    block_end: torch.Tensor | None = None  # [B] for non-causal blocks: keys t < block_end are visible
    row_slice: slice | None = None  # rows as a slice when they are contiguous (read without a copy)
    rotary_positions: torch.Tensor | None = None  # [B, Q] where they differ from positions (tree steps)
    tree: torch.Tensor | None = None  # int64 [B, Q]: bit j set = the key at positions[b, 0] + j is visible
    _masks: dict = field(default_factory=dict, repr=False)
    flat_index: dict = field(default_factory=dict, repr=False)  # per-cache write offsets (engine/kv_cache.py)
    _query_keys: "QueryKeys | None" = field(default=None, repr=False)
    host: HostRows | None = None  # where given, the mask's all-visible check and first_position read nothing

    # Each constructor takes the step's HostRows where the caller has them (the engine does, every step), and
    # otherwise reads the key count and the rows' layout from the tensors.
    @classmethod
    def causal_step(cls, rows: torch.Tensor, positions: torch.Tensor,
                    host: HostRows | None = None) -> "AttentionMetadata":
        if host is None:
            return cls(rows, positions, int(positions.max()) + 1, True, None, _slice_of(rows.tolist()))
        return cls(rows, positions, host.kv_len(positions.shape[1]), True, None, host.row_slice, host=host)

    @classmethod
    def block_step(cls, rows: torch.Tensor, positions: torch.Tensor, block_end: torch.Tensor,
                   host: HostRows | None = None) -> "AttentionMetadata":
        if host is None:
            return cls(rows, positions, int(block_end.max()), False, block_end, _slice_of(rows.tolist()))
        return cls(rows, positions, host.kv_len(positions.shape[1]), False, block_end, host.row_slice, host=host)

    @classmethod
    def tree_step(cls, rows: torch.Tensor, start: torch.Tensor, depths: torch.Tensor,
                  ancestors: torch.Tensor, host: HostRows | None = None) -> "AttentionMetadata":
        """A draft tree's verify: node j of row b (j = 0 the root) is written at start[b] + j and rotated at
        start[b] + depths[b, j]; ancestors[b, j] has bit i set where node i is node j or one of its ancestors (so
        every parent precedes its children: causal order is kept)."""
        positions = start[:, None] + torch.arange(depths.shape[1], device=start.device)
        meta = cls.causal_step(rows, positions, host)
        meta.rotary_positions, meta.tree = start[:, None] + depths, ancestors.to(torch.int64)
        return meta

    @property
    def first_position(self) -> int:
        """The step's lowest query position."""
        return self.host.first if self.host is not None else int(self.positions.min())

    @property
    def rope_positions(self) -> torch.Tensor:
        """The positions the queries and keys of this step are rotated at."""
        return self.positions if self.rotary_positions is None else self.rotary_positions

    def mask(self, window: int | None = None, causal: bool | None = None, kv_len: int | None = None) -> torch.Tensor | None:
        """Boolean mask [B, 1, Q, kv_len], or None when every key is visible. A kv_len beyond self.kv_len
        (keys read in buckets) adds keys past every query: always hidden."""
        causal = self.causal if causal is None else causal
        kv_len = self.kv_len if kv_len is None else kv_len
        key = (window, causal, kv_len)
        if key not in self._masks:
            self._masks[key] = self._build_mask(window, causal, kv_len)
        return self._masks[key]

    def query_keys(self) -> "QueryKeys":
        """Per query, flattened row-major: its cache row, its position and how many leading keys of the row it
        sees (causal: position + 1; a block without a window: block_end)."""
        if self._query_keys is None:
            q = self.positions.shape[1]
            positions = self.positions.to(torch.int64).reshape(-1).contiguous()
            rows = self.rows.to(torch.int64).repeat_interleave(q).contiguous()
            lens = positions + 1 if self.causal else self.block_end.to(torch.int64).repeat_interleave(q).contiguous()
            tree = None
            if self.tree is not None:  # (first tree position, bits) per query
                first = self.positions[:, :1].to(torch.int64).expand(-1, q).reshape(-1)
                tree = torch.stack([first, self.tree.reshape(-1)], dim=1).contiguous()
            self._query_keys = QueryKeys(rows, positions, lens, int(lens.max()), tree)
        return self._query_keys

    def _build_mask(self, window: int | None, causal: bool, kv_len: int) -> torch.Tensor | None:
        all_visible = self._all_visible(window, causal, kv_len)
        if all_visible:  # known from the host: no mask to build
            return None
        t = torch.arange(kv_len, device=self.positions.device)[None, None, :]  # [1, 1, T]
        p = self.rope_positions[:, :, None]  # [B, Q, 1]
        if self.tree is not None:
            q = self.positions.shape[1]
            rel = t - self.positions[:, :1, None]  # [B, 1, T]: the key's node index for the step's own keys
            bit = (self.tree[:, :, None] >> rel.clamp(0, 63)) & 1
            visible = (rel < 0) | ((rel < q) & (bit == 1))
            # a window measures a tree key from its node's depth, as a chain of its ancestors would place it
            depth_pos = self.rotary_positions.gather(1, rel[:, 0].clamp(0, q - 1))[:, None]  # [B, 1, T]
            t = torch.where((rel >= 0) & (rel < q), depth_pos, t)
        elif causal:
            visible = t <= p
        else:
            visible = t < self.block_end[:, None, None]
        if window is not None:
            visible = visible & (p - t < window)
            if not causal:
                visible = visible & (t - p < window)
        if all_visible is None:
            all_visible = bool(visible.all())
        return None if all_visible else visible[:, None]

    def _all_visible(self, window: int | None, causal: bool, kv_len: int) -> bool | None:
        """Whether every query sees every key, from the host's copies (None without them). Keys read past the
        step's own (buckets) are hidden; a causal step of several queries hides its later ones from its first (unless
        clamped onto one position: then the tensors tell); else the rows' queries must sit at the same positions, the
        last key within every window."""
        if self.host is None or self.host.clamped(self.positions.shape[1]):
            return None
        if kv_len > self.kv_len or (causal and self.positions.shape[1] > 1):
            return False
        return self.host.aligned and (window is None or self.kv_len - 1 < window)


def _slice_of(slots: list[int]) -> slice | None:
    """Cache rows as a slice where they are consecutive (read without a copy)."""
    first, n = slots[0], len(slots)
    return slice(first, first + n) if slots == list(range(first, first + n)) else None


def kernel_step_tokens(qkv_proj) -> int:
    """The most tokens a step may hold for its attention to run through the CPU kernels whatever its rows' query
    counts (KERNEL_MAX_STEP_TOKENS above), by the reach of the packed qkv projection (PackedLinear.kernel_max_rows);
    0 where the bf16 kernel does not serve it."""
    rows = getattr(qkv_proj, "kernel_max_rows", 0)
    return rows if rows <= KERNEL_MAX_ROWS["rows"] else KERNEL_MAX_STEP_TOKENS


def kernel_step(
    meta: AttentionMetadata, cache, *tensors: torch.Tensor, max_queries: int | None = KERNEL_MAX_QUERIES
) -> tuple[cpu_ops.CpuOps, QueryKeys] | None:
    """The CPU kernels and the step's per-query keys where the kernels serve this step: inference on the CPU in a
    supported dtype, at most `max_queries` per row (attention: decode, verify, short prompt chunks, drafter blocks;
    None for cache writes alone). Raises before anything is written if a query lies past the cache."""
    if max_queries is not None and meta.positions.shape[1] > max_queries:
        return None
    ops = cpu_ops.for_tensors(*tensors, cache.k)
    if ops is None:
        return None
    keys = meta.query_keys()
    if keys.longest > cache.max_len:  # a write there would land in the next row
        raise ValueError(f"a query at position {keys.longest - 1} is past this cache's {cache.max_len} positions")
    return ops, keys


def kernel_attention(
    step: tuple[cpu_ops.CpuOps, QueryKeys], cache, layer: int, qkv: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, heads: int, scale: float, window: int | None = None,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A step kernel_step admitted, through the CPU kernels: rotary (after the q/k norms, if any) and the cache
    write, then each query over its keys (with the heads' sink logits, if any) -> [N, H, D]."""
    ops, keys = step
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    q = ops.qkv_rotary_write(qkv, cos, sin, keys.rows, keys.positions, k_cache, v_cache, heads, norms)
    return ops.cached_attention(q, k_cache, v_cache, keys.rows, keys.lens, scale, window, keys.tree, sinks=sinks)


def cached_attention(
    cache, layer: int, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    window: int | None = None, causal: bool | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V ([B, Q, KVH, D]) into the cache, then attend q ([B, H, Q, D]) over it."""
    cache.write(layer, meta, k, v)
    kv_len = meta.kv_len
    if sinks is None and _takes_grouped_path(q):
        # The grouped path's batched matmuls go through oneDNN, which builds a new primitive for every new
        # shape: ~8 ms on this CPU against ~0.15 ms for the matmuls themselves (benchmarks/bench_shapes.py).
        # The key count grows by one every decode step, so each step would pay it; reading keys in buckets
        # (the extra ones are masked) lets a few shapes serve every length.
        kv_len = min(round_up(kv_len, KEY_BUCKET), cache.max_len)
    k_all, v_all = cache.read(layer, meta, kv_len)
    return attend(q, k_all, v_all, meta.mask(window, causal, kv_len), scale, sinks)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, Q, D], k/v: [B, KVH, T, D] -> [B, Q, H * D]. GQA by head groups."""
    if sinks is not None:
        out = _attend_grouped(q, k, v, mask, scale, sinks)
    elif _takes_grouped_path(q):
        # bf16 batched matmuls copy a strided batch (a cache view) themselves, transposing K as they go: slower
        # than this plain copy first (1.6x at 8 rows x 300 keys, 2.4x at 1,000, as ops).
        out = _attend_grouped(q, k.contiguous(), v.contiguous(), mask, scale)
    elif _masked_gqa_falls_to_math(q, k, mask):
        return _attend_folded(q, k, v, mask, scale)
    else:
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.device.type == "cuda" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def _attend_folded(q, k, v, mask, scale):
    """Masked GQA as attention without groups, each KV head's query heads folded onto the query axis -> [B, Q, H * D].

    CUDA's flash kernel takes GQA but no mask and its efficient kernel a mask but no GQA, so SDPA ran every masked
    step (prefill chunks, verify, mixed-length decodes, training) in its math kernel. K/V repeated per query head (as
    transformers' sdpa_attention does) copy the whole cache G times every step; the fold copies the mask G times
    instead (and SDPA its float bias): less where the keys outnumber a step's queries, as in decoding and verifying,
    about as much in training, where they are alike."""
    b, h, n, d = q.shape
    kvh, t = k.shape[1], k.shape[2]
    g = h // kvh
    folded = mask.expand(b, 1, n, t)[:, :, None].expand(b, 1, g, n, t).reshape(b, 1, g * n, t)
    with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.device.type == "cuda" else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.reshape(b, kvh, g * n, d), k, v, attn_mask=folded, scale=scale)
    # [B, KVH, G * Q, D] (CUDA's efficient kernel returns it strided, not contiguous) -> [B, Q, KVH * G * D]:
    # query head h = kv_head * G + group, as SDPA's GQA orders them
    return out.unflatten(2, (g, n)).permute(0, 3, 1, 2, 4).reshape(b, n, h * d)


def _masked_gqa_falls_to_math(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return q.device.type == "cuda" and mask is not None and k.shape[1] != q.shape[1]


def _takes_grouped_path(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _grouped_is_faster(q.shape[0], q.shape[2])


def _grouped_is_faster(rows: int, queries: int) -> bool:
    # Whole generate() runs decide, not the op alone (benchmarks/bench_attention.py --e2e, results/attention_cpu.json;
    # 2 threads, an 8-row engine, one query per row, other prompts every run, keys read in buckets): grouped
    # 190.7 / 242.2 / 375.3 tok/s against SDPA's 173.9 / 206.5 / 281.0 at 3 / 4 / 8 rows, a tie at 2 (131.8 against
    # 133.9), and SDPA ahead at 1 row (78.2 against 72.2) although the grouped op alone is faster there. Multi-query
    # blocks (verify, draft, prefill) stay on SDPA.
    return queries == 1 and rows >= 3


def _attend_grouped(q, k, v, mask, scale, sinks=None):
    """Query heads of one KV head share a matmul: no K/V expansion (repeated per query head, K/V copied gpt-oss's
    whole cache 8 times a layer: 4 GB a layer at 32 rows of 8k keys in bf16). sinks: a per-head logit that joins the
    softmax denominator but contributes no value (gpt-oss)."""
    b, h, n, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    scores = torch.matmul(q.reshape(b, kvh, g * n, d), k.transpose(-1, -2)).float() * scale  # [B, KVH, G*Q, T]
    t = scores.shape[-1]
    if mask is not None:  # mask: [B or 1, 1, Q or 1, T], broadcast like SDPA's
        visible = mask.reshape(mask.shape[0], 1, 1, mask.shape[2], t)
        scores = scores.view(b, kvh, g, n, t).masked_fill(~visible, float("-inf"))
        scores = scores.view(b, kvh, g * n, t)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # query head h = kv head * G + group
        sink = sinks.float().view(1, kvh, g, 1, 1).expand(b, kvh, g, n, 1).reshape(b, kvh, g * n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).view(b, h, n, d)
