"""Static K/V cache: one row (slot) per request, positions written by index.

Rejected positions are never advanced past: their stale K/V is masked by the attention
metadata (keys beyond a query's position are invisible) and overwritten by the next step,
so rolling a row back to an accepted length costs nothing.
"""

from __future__ import annotations

import torch

from dflash_trt.device_copy import to_device
from dflash_trt.hardware import cpu_available_bytes
from dflash_trt.layers.attention import AttentionMetadata


# Of the memory free when a cache is made, what it may take: the rest holds a step's activations and logits.
CACHE_SHARE = 0.9


def check_fits(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, row_bytes: int = 0) -> None:
    """ValueError saying what fits where a cache of `shape` ([layers, rows, kv_heads, positions, head_dim], K and V)
    would not fit in the memory free on `device`: torch's out-of-memory error names neither the rows nor the length,
    and on the CPU a cache past the free memory swaps, or is killed by the kernel, without a word. row_bytes: what
    each row holds beside its K/V, whatever its length (a hybrid target's recurrent states)."""
    layers, rows, heads, positions, head_dim = shape
    per_position = 2 * layers * heads * head_dim * dtype.itemsize
    need = (per_position * positions + row_bytes) * rows
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what torch's allocator holds but does not use serves the cache too (mem_get_info counts it as taken)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        where = f"{device} has {free / 1e9:.1f} GB free after the weights"
    else:
        free = cpu_available_bytes()
        if free is None:  # nothing to go by
            return
        where = f"this machine has {free / 1e9:.1f} GB of memory available after the weights"
    usable = int(free * CACHE_SHARE)
    if need <= usable:
        return
    beside = f" and {row_bytes / 1e9:.2f} GB a row of recurrent states" if row_bytes else ""
    longest = max(0, usable // rows - row_bytes) // per_position
    raise ValueError(
        f"a K/V cache of {layers} layers{beside} for {rows} rows x {positions:,} positions needs {need / 1e9:.1f} GB; "
        f"{where} ({CACHE_SHARE:.0%} of it for the cache): at most {usable // (per_position * positions + row_bytes)} "
        f"rows at this length (--max-batch-size), or {longest:,} positions a row at {rows} rows (--max-model-len)")


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        row_bytes: int = 0,
    ) -> None:
        """row_bytes: what each row will hold beside its K/V (checked to fit with it, allocated by the caller)."""
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        check_fits(shape, dtype, device, row_bytes)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_rows = num_rows
        self.max_len = max_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, Q, kv_heads, head_dim] at meta.positions [B, Q]. One flat index_copy_ per tensor:
        # several times faster than advanced-index assignment across (row, position).
        idx = self._flat_index(meta)
        head_dim = k.shape[-1]
        self.k[layer].view(-1, head_dim).index_copy_(0, idx, k.reshape(-1, head_dim))
        self.v[layer].view(-1, head_dim).index_copy_(0, idx, v.reshape(-1, head_dim))

    def move(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """For (row, start, nodes): the K/V at start + nodes[d] go to start + d in every layer (a draft tree's
        accepted path, root first, to the positions of its depths). Read before written: sources may overlap."""
        for row, start, nodes in moves:
            src = to_device(nodes, torch.long, self.k.device) + start
            dst = torch.arange(len(nodes), device=self.k.device) + start
            for cache in (self.k, self.v):
                cache[:, row, :, dst] = cache[:, row, :, src]

    def copy_rows(self, src: int, dst: torch.Tensor, start: int, end: int) -> None:
        """Row src's K/V at positions [start, end) to rows dst, in every layer."""
        for cache in (self.k, self.v):
            cache[:, dst, :, start:end] = cache[:, src, None, :, start:end]

    def _flat_index(self, meta: AttentionMetadata) -> torch.Tensor:
        """Row-major offsets of (row, head, position) in a [rows, kv_heads, max_len] layer -> [B * Q * kv_heads]."""
        cached = meta.flat_index.get(id(self))
        if cached is None:
            heads = self.k.shape[2]
            h = torch.arange(heads, device=meta.positions.device)
            cached = ((meta.rows[:, None, None] * heads + h) * self.max_len + meta.positions[:, :, None]).reshape(-1)
            meta.flat_index[id(self)] = cached
        return cached

    def read(self, layer: int, meta: AttentionMetadata, kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v: [B, kv_heads, kv_len, head_dim] (default meta.kv_len); a view when the rows are contiguous."""
        kv_len = meta.kv_len if kv_len is None else kv_len
        if not 0 < kv_len <= self.max_len:
            raise ValueError(f"kv_len={kv_len} is outside this cache's 1..{self.max_len} positions")
        if meta.row_slice is not None:
            return self.k[layer, meta.row_slice, :, :kv_len], self.v[layer, meta.row_slice, :, :kv_len]
        # Slice before gathering: copy only the live prefix of each row.
        return (
            self.k[layer, :, :, :kv_len].index_select(0, meta.rows),
            self.v[layer, :, :, :kv_len].index_select(0, meta.rows),
        )
