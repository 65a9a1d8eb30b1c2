"""TensorRT-LLM hook: the DFlash drafter with its block attention on `dflash::draft_attention`.

So Hopper GPUs need neither flash-attn (TensorRT-LLM's VANILLA DFlash backend) nor SM100 (its TRTLLM
backend). Extension point, as read in NVIDIA/TensorRT-LLM (the PyTorch backend of the 1.3 line):
- tensorrt_llm/_torch/models/modeling_dflash.py@009d8fa4: `@register_draft_model(SpeculativeDecodingMode.DFLASH)`
  on `_build_dflash_draft(model_config, draft_config, lm_head, model)`; `DFlashForCausalLM.__init__` with
  attention_backend "VANILLA" stores `get_dflash_flash_attention()` and its block decode calls it per draft
  layer as `flash_attention(q=[B,Q,H,D], k_cache=[slots,S,KVH,D], v_cache, k=[B,Q,KVH,D], v, cache_seqlens,
  cache_batch_idx, causal, window_size)`, window (W-1, 0) on causal and (W-1, W-1) on non-causal sliding layers;
- tensorrt_llm/_torch/speculative/dflash_attention.py@0352547d: `get_dflash_flash_attention()` imports
  `flash_attn.flash_attn_with_kvcache` or raises;
- tensorrt_llm/_torch/models/modeling_utils.py (`register_draft_model`): built-in builders only fill
  empty slots, external registrations overwrite.
`register_dflash_drafter()` registers a builder that serves VANILLA drafters with a `DFlashForCausalLM`
subclass whose attention callable is `draft_attention_with_kvcache` below (same contract, our op), and
hands everything else (the TRTLLM backend, Laguna, DSpark checkpoints) to the built-in builder.
Call it, before the model is built, in the process that builds the model: TensorRT-LLM builds it in its
executor worker processes (MPI workers; a separate process even at TP1 unless TLLM_WORKER_USE_SINGLE_PROCESS=1),
not in the process that constructs `tensorrt_llm.LLM`, so a call there alone does not reach them. Nor does
`trtllm-serve --custom_module_dirs` (which modeling_utils.register_draft_model names as the way in): serve.py imports
those modules in its own process only, and the workers are sent external `register_auto_model` classes
(export_external_model_modules), not draft builders (read in the indexed source, session 44). At TP1,
TLLM_WORKER_USE_SINGLE_PROCESS=1 builds the model in the process that registered; beyond, each worker would have to
import this module itself (unverified without TensorRT-LLM). dflash-trt's launchers (launch.py) do not call it yet:
VANILLA there needs flash-attn installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from dflash_trt.kernels.draft_attention import draft_attention


def _window(window_size: tuple[int, int], causal: bool) -> int:
    """flash-attn (left, right) -> draft_attention's window W (0 = none), for the shapes DFlash drafters use."""
    left, right = window_size
    if causal and left >= -1 and right >= -1:
        # flash-attn sets the right window to 0 on causal calls (flash_api.cpp), so only the left one counts: an
        # upstream sliding layer that is causal passes (W-1, W-1) with causal=True (modeling_dflash.py)
        return max(left + 1, 0)
    if (left, right) == (-1, -1):
        return 0
    if left >= 0 and right == left:
        return left + 1
    raise ValueError(
        f"window_size={window_size} with causal={causal} is not a DFlash drafter window: expected (-1, -1), "
        "(W-1, any) on causal or (W-1, W-1) on non-causal layers"
    )


def draft_attention_with_kvcache(
    q: torch.Tensor,  # [B, Q, H, D]
    k_cache: torch.Tensor,  # [slots, S, KVH, D]
    v_cache: torch.Tensor,  # [slots, S, KVH, D]
    k: torch.Tensor,  # [B, Q, KVH, D] the block's own K
    v: torch.Tensor,  # [B, Q, KVH, D]
    cache_seqlens: torch.Tensor,  # [B] int32: context tokens per row (the block goes right after them)
    cache_batch_idx: torch.Tensor | None = None,  # [B] int32: slot of each row (None: row b uses slot b)
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
) -> torch.Tensor:  # [B, Q, H, D]
    """`flash_attn_with_kvcache` as TensorRT-LLM's DFlash drafter calls it, computed by `dflash::draft_attention`.

    Like flash-attn, the block's K/V are also appended to the cache at cache_seqlens (scratch positions
    the next step's context overwrites), so the cache ends in the state TensorRT-LLM expects.
    """
    window = _window(window_size, causal)  # refuse before touching the cache
    b, n = q.shape[:2]
    rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=q.device)
    pos = cache_seqlens.long()[:, None] + torch.arange(n, device=q.device)  # [B, Q]
    k_cache[rows[:, None], pos] = k.to(k_cache.dtype)
    v_cache[rows[:, None], pos] = v.to(v_cache.dtype)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    # [slots, S, KVH, D] -> the op's [slots, KVH, S, D] view: no copy, the kernel takes strides
    return draft_attention(q, k, v, k_cache.transpose(1, 2), v_cache.transpose(1, 2), rows, cache_seqlens, scale,
                           causal, window, None)


@contextlib.contextmanager
def _attention_loader(modeling_dflash):
    # DFlashForCausalLM.__init__ loads flash-attn for VANILLA and raises without it; hand it ours instead.
    original = modeling_dflash.get_dflash_flash_attention
    modeling_dflash.get_dflash_flash_attention = lambda: draft_attention_with_kvcache
    try:
        yield
    finally:
        modeling_dflash.get_dflash_flash_attention = original


def register_dflash_drafter() -> Callable:
    """Register this project's builder for SpeculativeDecodingMode.DFLASH; returns the builder."""
    from dflash_trt.trtllm.launch import require_tensorrt_llm

    require_tensorrt_llm()
    try:
        from tensorrt_llm._torch.models import modeling_dflash
        from tensorrt_llm._torch.models.modeling_utils import register_draft_model
        from tensorrt_llm._torch.speculative.interface import SpeculativeDecodingMode
    except ImportError as error:
        raise RuntimeError(
            f"this tensorrt_llm has no DFlash draft-model registry ({error}); it needs a TensorRT-LLM whose "
            "_torch/models/modeling_utils.py defines register_draft_model (the 1.3 line with DFlash)"
        ) from error
    missing = [name for name in ("_build_dflash_draft", "DFlashForCausalLM", "declares_dspark_heads",
                                 "get_dflash_flash_attention") if not hasattr(modeling_dflash, name)]
    if missing:
        raise RuntimeError(f"this tensorrt_llm's _torch/models/modeling_dflash.py lacks {', '.join(missing)}, which "
                           "register_dflash_drafter hooks into (read at NVIDIA/TensorRT-LLM@009d8fa4)")
    builtin = modeling_dflash._build_dflash_draft

    class TritonDFlashForCausalLM(modeling_dflash.DFlashForCausalLM):
        """The upstream drafter, its block attention running dflash::draft_attention (Triton on CUDA)."""

        def __init__(self, draft_config):
            with _attention_loader(modeling_dflash):
                super().__init__(draft_config, dflash_attention_backend="VANILLA")

    @register_draft_model(SpeculativeDecodingMode.DFLASH)
    def build_dflash_draft(model_config, draft_config, lm_head, model):
        arches = getattr(draft_config.pretrained_config, "architectures", None) or []
        upstream_only = (
            model_config.spec_config.attention_backend != "VANILLA"
            or any("Laguna" in a for a in arches)
            or modeling_dflash.declares_dspark_heads(draft_config.pretrained_config)
        )
        if upstream_only:
            return builtin(model_config, draft_config, lm_head, model)
        return TritonDFlashForCausalLM(draft_config)

    return build_dflash_draft
