"""Temperature / top-k / top-p distributions and per-row seeded sampling.

The same `sampling_probs` shapes the target's and the drafter's distributions, so the acceptance
rules compare like with like. Order: temperature, then top-k, then top-p over the top-k
probabilities (z-lab's order). Each row draws from its own torch.Generator, so a request's output
depends on its seed only, not on what else is in the batch.
"""

from __future__ import annotations

import torch

from dflash_trt.layers.argmax import argmax_last


def sampling_probs(
    logits: torch.Tensor,  # [B, T, V] float
    temperature: torch.Tensor,  # [B]; 0 means greedy: a one-hot at the argmax
    top_k: torch.Tensor,  # [B] long; 0 means off
    top_p: torch.Tensor,  # [B] float; 1.0 means off
) -> torch.Tensor:
    logits = logits.float()
    greedy = temperature <= 0
    scores = logits / torch.where(greedy, 1.0, temperature)[:, None, None]
    vocab = scores.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=scores.device)
        k = torch.where(use_k, top_k, vocab)[:, None, None]
        sorted_scores = sorted_scores.masked_fill(rank >= k, float("-inf"))
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None, None]
        sorted_probs = sorted_probs * keep
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
        probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    else:
        probs = torch.softmax(scores, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax_last(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def uniform(generators: list[torch.Generator], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, n] uniforms in [0, 1), row b drawn from generators[b]."""
    return torch.stack([torch.rand(n, generator=g) for g in generators]).to(device)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V], u [...] in [0, 1) -> token ids [...].

    Zero-probability tokens are never chosen: the CDF does not rise at them.
    """
    cdf = probs.cumsum(-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
