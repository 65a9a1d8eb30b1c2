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


DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config's, where a checkpoint names none


def weight_block_size(quantization: dict | None) -> tuple[int, int]:
    """The blocks a grid of scales covers: quantization_config's weight_block_size, or compressed-tensors' weights'
    block_structure, else 128 x 128 (as transformers reads such a checkpoint: the grid's shape alone cannot tell 300
    rows in blocks of 128 from blocks of 100)."""
    quantization = quantization or {}
    block, key = quantization.get("weight_block_size"), "weight_block_size"
    groups = quantization.get("config_groups")
    if block is None and isinstance(groups, dict):
        key = "config_groups.*.weights.block_structure"
        block = next((g["weights"]["block_structure"] for g in groups.values() if isinstance(g, dict)
                      and isinstance(g.get("weights"), dict) and g["weights"].get("block_structure") is not None), None)
    if block is None:
        return DEFAULT_BLOCK
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.{key} must be two positive integers, got {block!r}")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """weight [..., rows, cols] in float8 times its scale, in fp32: a scalar, one a row ([rows] or [rows, 1]), or a
    grid of blocks [..., ceil(rows / block[0]), ceil(cols / block[1])]. ValueError naming the tensor where the
    scale's shape is none of these."""
    w, s = weight.float(), scale.float()
    rows, cols = w.shape[-2:]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.shape in ((rows,), (rows, 1)):
        return w * s.reshape(rows, 1)
    grid = (*w.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(s.shape) != grid:
        raise ValueError(f"{name}: its scale has shape {tuple(s.shape)}; for a weight of {tuple(w.shape)} it must be "
                         f"a scalar, one a row, or a grid of {block[0]} x {block[1]} blocks {grid}")
    s = s.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return w * s
