"""Rotary position embeddings: default, linear, llama3 and YaRN frequency scaling (neox layout)."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale for a rope parameter dict.

    `params` holds `rope_theta` and, for scaled variants, `rope_type` plus its keys, in the
    layout of transformers' standardized `rope_parameters`.
    """
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, params, max_position_embeddings)
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    old_len = params.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / old_len
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    interpolation = extrapolation / factor
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions; apply with `apply_rotary`."""

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int) -> None:
        super().__init__()
        # A plain fp32 attribute, not a buffer: it is derived from the config, never loaded, and must
        # stay real even when the module is built on the meta device.
        with torch.device("cpu"):
            self.inv_freq, self.scaling = rope_inv_freq(head_dim, params, max_position_embeddings)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU: dtype -> cos, sin [positions, rot]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] (non-negative) -> cos, sin: [B, 1, T, rotary_dim]
        if positions.device.type == "cpu":
            # Read from a table of every position so far: computing cos and sin per step took ~70 us of a CPU decode
            # step, three times in a speculative one. The table holds the same values bit for bit (each entry is
            # the same elementwise computation; tests/layers/test_rotary.py).
            table = self._tables.get(dtype)
            if table is not None:
                try:
                    return table[0][positions][:, None], table[1][positions][:, None]
                except IndexError:  # a position past the table
                    pass
            table = self._grow_table(positions, dtype)
            return table[0][positions][:, None], table[1][positions][:, None]
        return self._compute(positions, dtype)

    def _grow_table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        size = 1024
        while size <= int(positions.max()):
            size *= 2
        cos, sin = self._compute(torch.arange(size)[None], dtype)
        self._tables[dtype] = cos[0, 0], sin[0, 0]
        return self._tables[dtype]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, None], sin[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, head_dim]; the rotary part is the leading cos.shape[-1] channels.
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((apply_rotary(x_rot, cos, sin), x_pass), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
