"""gpt-oss expert weights: MXFP4 (OCP microscaling FP4) checkpoint format, and expert-parallel sharding.

An HF gpt-oss checkpoint stores each layer's experts either in bf16 (`gate_up_proj` [E, H, 2I],
`down_proj` [E, I, H]) or as MXFP4 (`gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 + `gate_up_proj_scales`
[E, 2I, H/32] uint8, and the same for `down_proj` over I). One block is 32 FP4 (e2m1) values, two per
byte (low nibble first), sharing one power-of-two scale stored with exponent bias 127, as
transformers/integrations/mxfp4.py `convert_moe_packed_tensors` decodes them. Gate and up are
interleaved along 2I (gate = even rows, up = odd rows); the runtime keeps them as [gate ; up].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.models.weights import CheckpointError, WeightSet

# e2m1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per shared scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G * 32] in `dtype`.

    Worked example: byte 0x72 with scale 128 -> low nibble 2 (1.0), high nibble 7 (6.0), times 2**(128-127)
    -> [2.0, 12.0].
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (expected [..., G, 16] / [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]: low nibble is the earlier value
    # Every FP4 value times a power of two is exact in fp32 (and in bf16), so this matches ldexp in `dtype`.
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8).

    The scale is the smallest power of two that brings the block's largest magnitude within 6 (the largest
    e2m1 value); each value rounds to the nearest e2m1 value. Used to write MXFP4 checkpoints for tests and
    conversions; the loader only decodes.
    """
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"last dimension {w.shape[-1]} is not a multiple of the MXFP4 block ({MXFP4_BLOCK})")
    x = w.float().reshape(*w.shape[:-1], -1, MXFP4_BLOCK)  # [..., G, 32]
    amax = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = x / torch.exp2(exp)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude, 0..7
    code = code | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8).reshape(*x.shape[:-1], MXFP4_BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    scales = (exp[..., 0] + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def expert_range(num_experts: int, ep_rank: int = 0, ep_size: int = 1) -> range:
    """The experts rank `ep_rank` of an expert-parallel group of `ep_size` holds: a contiguous slice.

    Example: 128 experts, ep_size 8 -> rank 3 holds experts 48..63.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must be in [0, ep_size={ep_size})")
    if num_experts % ep_size:
        raise ValueError(f"num_local_experts={num_experts} is not divisible by ep_size={ep_size}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


@dataclass
class ExpertWeights:
    """One layer's experts in the runtime layout (nn.Linear's [out, in]), gate and up de-interleaved."""

    gate_up: torch.Tensor  # [E_local, 2I, H]: rows [gate_0..gate_{I-1}, up_0..up_{I-1}]
    gate_up_bias: torch.Tensor  # [E_local, 2I]
    down: torch.Tensor  # [E_local, H, I]
    down_bias: torch.Tensor  # [E_local, H]


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    # [..., 2I, ...] with gate/up alternating along `dim` -> [gate ; up] along `dim`
    idx = torch.arange(t.shape[dim])
    order = torch.cat([idx[0::2], idx[1::2]]).to(t.device)
    return t.index_select(dim, order)


def load_experts(
    weights: WeightSet,
    prefix: str,  # e.g. "model.layers.3.mlp.experts."
    num_experts: int,
    hidden: int,
    intermediate: int,
    experts: range,
    dtype: torch.dtype,
) -> ExpertWeights:
    """Read the experts in `experts` from a bf16 or an MXFP4 checkpoint (MXFP4 is dequantized to `dtype`,
    only for the selected experts)."""
    e, h, i = num_experts, hidden, intermediate
    sel = slice(experts.start, experts.stop)

    def proj(name: str, out_dim: int, in_dim: int) -> torch.Tensor:
        # -> [E_local, out_dim, in_dim]
        if prefix + name + "_blocks" in weights:
            if in_dim % MXFP4_BLOCK:
                raise CheckpointError(f"{prefix}{name}_blocks: input size {in_dim} is not a multiple of {MXFP4_BLOCK}")
            g = in_dim // MXFP4_BLOCK
            blocks = weights.get(prefix + name + "_blocks", (e, out_dim, g, MXFP4_BLOCK // 2), floating=False)[sel]
            scales = weights.get(prefix + name + "_scales", (e, out_dim, g), floating=False)[sel]
            return dequantize_mxfp4(blocks, scales, dtype)
        if prefix + name in weights:
            return weights.get(prefix + name, (e, in_dim, out_dim))[sel].transpose(1, 2).to(dtype)
        raise CheckpointError(
            f"{weights.model_dir}: missing tensor {prefix + name!r} (bf16) or {prefix + name + '_blocks'!r} (MXFP4)"
        )

    gate_up = _deinterleave(proj("gate_up_proj", 2 * i, h), 1)
    gate_up_bias = _deinterleave(weights.get(prefix + "gate_up_proj_bias", (e, 2 * i))[sel], 1)
    down = proj("down_proj", h, i)
    down_bias = weights.get(prefix + "down_proj_bias", (e, h))[sel]
    return ExpertWeights(gate_up.contiguous(), gate_up_bias.to(dtype), down.contiguous(), down_bias.to(dtype))
