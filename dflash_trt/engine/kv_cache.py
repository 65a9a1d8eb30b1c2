"""Static K/V cache: one row (slot) per request, positions written by index.

Rejected positions are never advanced past: their stale K/V is masked by the attention
metadata (keys beyond a query's position are invisible) and overwritten by the next step,
so rolling a row back to an accepted length costs nothing.
"""

from __future__ import annotations

import torch

from dflash_trt.layers.attention import AttentionMetadata


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
    ) -> None:
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_rows = num_rows
        self.max_len = max_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, Q, kv_heads, head_dim] at meta.positions [B, Q]
        rows = meta.rows[:, None]
        self.k[layer][rows, :, meta.positions] = k
        self.v[layer][rows, :, meta.positions] = v

    def read(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, kv_heads, kv_len, head_dim]; a view when the rows are contiguous
        if meta.row_slice is not None:
            return (
                self.k[layer, meta.row_slice, :, : meta.kv_len],
                self.v[layer, meta.row_slice, :, : meta.kv_len],
            )
        return (
            self.k[layer].index_select(0, meta.rows)[:, :, : meta.kv_len],
            self.v[layer].index_select(0, meta.rows)[:, :, : meta.kv_len],
        )
