"""FP8 checkpoints (Qwen's and DeepSeek's `-FP8` releases, ModelOpt's and compressed-tensors' FP8): linear weights
stored as float8 beside a scale, read here as the floating-point weights they stand for (the runtime computes in
bf16 or fp32; the weights take the memory of that dtype).

Each format multiplies: a block-wise `weight_scale_inv` (one scale a block of quantization_config's
weight_block_size, 128 x 128 in Qwen's and DeepSeek's), or a `weight_scale` for the whole tensor or each output
channel (ModelOpt's, compressed-tensors').
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # after a weight's name: a block grid's, a tensor's or its channels'


def quantization_config(config: dict) -> dict | None:
    """config.json's quantization_config (a multimodal checkpoint's at its top level or in its text_config)."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("quantization_config"), dict):
            return cfg["quantization_config"]
    return None


def weight_block_size(quantization: dict | None) -> tuple[int, int] | None:
    """quantization_config's weight_block_size, where it gives one."""
    block = (quantization or {}).get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str) -> torch.Tensor:
    """weight [..., rows, cols] in float8 times its scale, in fp32: a scalar, one a row ([rows] or [rows, 1]), or a
    grid of blocks [..., ceil(rows / block[0]), ceil(cols / block[1])]. ValueError naming the tensor where the
    scale's shape is none of these."""
    w, s = weight.float(), scale.float()
    rows, cols = w.shape[-2:]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in ((rows,), (rows, 1)):
        return w * s.reshape(rows, 1)
    if block is None:  # no config to say: the grid's blocks as the shapes give them (exact where they divide)
        block = (math.ceil(rows / s.shape[-2]), math.ceil(cols / s.shape[-1])) if s.dim() >= 2 else (0, 0)
    grid = (*w.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1])) if all(block) else None
    if grid is None or tuple(s.shape) != grid:
        raise ValueError(f"{name}: its scale has shape {tuple(s.shape)}; for a weight of {tuple(w.shape)} it must be "
                         f"a scalar, one a row, or a grid of {block[0]} x {block[1]} blocks {grid}")
    s = s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return w * s
