"""What the target model tests share: a forward's metadata over fresh rows, the prompts their engines answer, and a
speculative engine on a target and drafter directory."""

import torch

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target


def meta(ids: torch.Tensor, start: int = 0, rows: torch.Tensor | None = None) -> AttentionMetadata:
    """ids [B, Q] at positions start.. of rows 0..B-1 (or `rows`)."""
    b, n = ids.shape
    rows = torch.arange(b) if rows is None else rows
    return AttentionMetadata.causal_step(rows, start + torch.arange(n).expand(b, n))


def sample_prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Up to four prompts of 5, 17, 9 and 30 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=g).tolist() for length in (5, 17, 9, 30)[:n]]


def spec_engine(target_dir, drafter_dir, k: int, rows: int, dtype: torch.dtype = torch.float32,
                max_model_len: int = 96, **cfg) -> LLMEngine:
    target = load_target(target_dir, dtype)
    drafter = load_drafter(drafter_dir, target.config, dtype)
    return LLMEngine(target, None, drafter, EngineConfig(max_batch_size=rows, max_draft_len=k,
                                                         max_model_len=max_model_len,
                                                         dtype=str(dtype).removeprefix("torch."), **cfg))
