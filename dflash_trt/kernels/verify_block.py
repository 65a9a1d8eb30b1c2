"""`dflash::verify_block`: tree-free block verification for a batch whose rows mix acceptance rules.

Terms and rules are spec/verifier.py's. Each row b has a mode:
- GREEDY: accept the prefix where d_i == argmax(logits_{i-1}); bonus = argmax at the first miss;
- MATCH: target-sample-and-match, x_i ~ p_i by inverse CDF with uniforms[b, i];
- REJECTION: accept d_i when uniforms[b, i-1] * q(d_i) < p(d_i); at the first rejection (or after K
  accepts) sample from normalize(max(0, p - q)) (p alone after K accepts) with uniforms[b, K]
(arXiv 2211.17192). p is the target's distribution after temperature -> top-k -> top-p, computed by
the runtime's own sampler (layers/sampler.py), so speculative and plain sampling agree exactly.
The uniforms come from the caller (engine/model_runner.py `_uniforms`: each row's from its own seed, by output
position under MATCH), so the op stays a pure function. It is not CUDA-graph safe: a
sampled step reads four flags of the batch back to the host once (target_probs) to skip what no row needs.

Worked example (GREEDY, K = 3): drafts [5, 9, 2], argmax per block position [5, 9, 7, 4] ->
num_accepted = 2 (5 and 9 match, 2 != 7), bonus = 7; the row emits [5, 9, 7].
"""

from __future__ import annotations

import torch

from dflash_trt.layers.sampler import sampling_probs, truncating_rows
from dflash_trt.spec.verifier import match_from_uniforms, rejection_from_uniforms, verify_greedy

GREEDY, MATCH, REJECTION = 0, 1, 2
MODE_OF_ACCEPTANCE = {"match": MATCH, "rejection": REJECTION}  # SamplingParams.acceptance -> mode (non-greedy rows)


def target_probs(
    target_logits: torch.Tensor,  # [B, K + 1, V]
    modes: torch.Tensor,  # [B]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [B, K + 1, V] float32 (zero rows for GREEDY), None when every row is greedy
    """The sampler's distributions of the sampled rows, all in one call (row by row what plain decoding's sampler
    gives). What the host must know of the batch is read back in one go: on a GPU every read waits for the queued
    kernels. Raises where REJECTION rows come without draft_probs."""
    sampled = modes != GREEDY
    truncating = truncating_rows(top_k, top_p, target_logits.shape[-1])
    any_sampled, truncates, zero_temperature, rejection = torch.stack([
        sampled.any(), (sampled & truncating).any(), (sampled & (temperature <= 0)).any(), (modes == REJECTION).any(),
    ]).tolist()
    if rejection and draft_probs is None:
        raise ValueError("verify_block: REJECTION rows need draft_probs [B, K, V]")
    if not any_sampled:
        return None
    # GREEDY rows at temperature 1, then zeroed: their one-hots are not needed
    probs = sampling_probs(target_logits, torch.where(sampled, temperature, 1.0), top_k, top_p, truncates,
                           zero_temperature)
    return torch.where(sampled[:, None, None], probs, 0.0)


def verify_block_ref(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K + 1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, read on REJECTION rows only
    uniforms: torch.Tensor,  # [B, K + 1] float32 in [0, 1), read on MATCH / REJECTION rows
    modes: torch.Tensor,  # [B] int: GREEDY / MATCH / REJECTION
    temperature: torch.Tensor,  # [B] float
    top_k: torch.Tensor,  # [B] long, 0 = off
    top_p: torch.Tensor,  # [B] float, 1.0 = off
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] long, bonus [B] long
    b = draft_tokens.shape[0]
    num_accepted = torch.zeros(b, dtype=torch.long, device=draft_tokens.device)
    bonus = torch.zeros(b, dtype=torch.long, device=draft_tokens.device)
    probs = target_probs(target_logits, modes, temperature, top_k, top_p, draft_probs)
    for mode in (GREEDY, MATCH, REJECTION):
        idx = (modes == mode).nonzero()[:, 0]
        if not idx.numel():
            continue
        if idx.numel() == b:  # every row under one rule (the usual case): no copy of the [B, K + 1, V] logits
            idx = slice(None)
        if mode == GREEDY:
            r = verify_greedy(draft_tokens[idx], target_logits[idx])
        elif mode == MATCH:
            r = match_from_uniforms(draft_tokens[idx], probs[idx], uniforms[idx])
        else:
            r = rejection_from_uniforms(draft_tokens[idx], draft_probs[idx], probs[idx], uniforms[idx])
        num_accepted[idx], bonus[idx] = r.num_accepted, r.bonus
    return num_accepted, bonus


@torch.library.custom_op("dflash::verify_block", mutates_args=())
def verify_block(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    modes: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the reference elsewhere. Shapes as in `verify_block_ref`."""
    args = (draft_tokens, target_logits, draft_probs, uniforms, modes, temperature, top_k, top_p)
    if target_logits.is_cuda:
        from dflash_trt.kernels.verify_block_triton import verify_block_triton

        return verify_block_triton(*args)
    return verify_block_ref(*args)


@verify_block.register_fake
def _(draft_tokens, target_logits, draft_probs, uniforms, modes, temperature, top_k, top_p):
    b = draft_tokens.shape[0]
    return draft_tokens.new_empty(b, dtype=torch.long), draft_tokens.new_empty(b, dtype=torch.long)
