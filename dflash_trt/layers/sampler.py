"""Temperature / top-k / top-p distributions and per-row seeded sampling.

The same `sampling_probs` shapes the target's and the drafter's distributions, so the acceptance
rules compare like with like. Order: temperature, then top-k, then top-p over the top-k
probabilities (z-lab's order). Each row draws from its own streams, so no other row takes a request's draws. Under
the "rejection" rule its tokens still depend on how many tokens each step drafted, which the batch sets (K by the
number of rows, a neighbour near the end of its context, adaptive plain steps): the same seed can give another text
beside other requests, in the same distribution. With `PositionalUniforms` (the "match" rule) they depend on the
seed only.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_trt.device_copy import host_to_device
from dflash_trt.layers.argmax import argmax_last


def known_flags(temperature: list[float], top_k: list[int], top_p: list[float], vocab: int) -> dict[str, bool]:
    """sampling_probs' `truncates` and `any_greedy` for rows of these settings over `vocab` tokens, decided as its
    float32 tensors decide them."""
    return {"truncates": any(0 < k < vocab for k in top_k) or bool((np.float32(top_p) < 1.0).any()),
            "any_greedy": bool((np.float32(temperature) <= 0).any())}


def truncating_rows(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] bool: the rows whose top-k or top-p keeps only part of their `vocab` tokens (known_flags' rule)."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)


def sampling_probs(
    logits: torch.Tensor,  # [B, T, V] float
    temperature: torch.Tensor,  # [B]; 0 means greedy: a one-hot at the argmax
    top_k: torch.Tensor,  # [B] long; 0 means off
    top_p: torch.Tensor,  # [B] float; 1.0 means off
    truncates: bool | None = None,
    any_greedy: bool | None = None,
) -> torch.Tensor:
    """truncates / any_greedy: whether some row keeps only its top-k or top-p / has temperature 0, where the caller
    knows them (known_flags; on a GPU a read of the tensors waits for every queued kernel); None: read from the
    tensors."""
    logits = logits.float()
    greedy = temperature <= 0
    scores = logits / torch.where(greedy, 1.0, temperature)[:, None, None]
    vocab = scores.shape[-1]
    truncating = truncating_rows(top_k, top_p, vocab)
    if truncates is None:
        truncates = bool(truncating.any())
    probs = torch.softmax(scores, dim=-1)
    if truncates:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=scores.device)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None, None]
        sorted_scores = sorted_scores.masked_fill(rank >= k, float("-inf"))
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        # (rank 0 by name: a top_p under float32's least value reads as 0, and nothing would have stayed)
        keep = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None, None]) | (rank == 0)
        sorted_probs = sorted_probs * keep
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
        truncated = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
        # Only rows that truncate take the sorted path: there a float32 cumsum reaching 1 early would drop a tail
        # of tokens, so a row's distribution would depend on what else shared its batch.
        probs = torch.where(truncating[:, None, None], truncated, probs)
    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax_last(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def uniform(generators: list[torch.Generator], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, n] uniforms in [0, 1), row b drawn from generators[b]."""
    return host_to_device(torch.stack([torch.rand(n, generator=g) for g in generators]), device)


class PositionalUniforms:
    """One request's uniforms indexed by output position: the token at output position p is drawn with `at(p, 1)`.

    Under the "match" rule every emitted token is the target's own inverse-CDF sample with its position's uniform
    (spec/verifier.py), so indexing the uniforms by position, not by draw order, makes a seeded request's tokens
    the same whatever each step drafted (K, trees, plain steps chosen by timing) and whatever shared its batch,
    and equal to plain sampling with the same seed. Reusing a position's uniform after a rejected draft keeps the
    distribution exact: the emitted sequence is the one plain sampling computes from these same independent
    uniforms, and what a discarded branch sampled is never seen.

    PCG64 from numpy over SeedSequence(2 |seed| + [seed < 0]) (the whole seed enters, where torch's CPU generator
    keeps its low 32 bits; one integer, as a list of words would be zero-padded into another seed's), drawn in
    float32 so that no value rounds up to 1.0.
    """

    def __init__(self, seed: int | None) -> None:
        entropy = None if seed is None else 2 * abs(seed) + int(seed < 0)
        self._seeds = np.random.SeedSequence(entropy)
        self._rng = np.random.Generator(np.random.PCG64(self._seeds))
        self._values = np.empty(0, dtype=np.float32)

    def at(self, start: int, n: int) -> torch.Tensor:
        """[n] float32 uniforms in [0, 1) for output positions start .. start + n - 1."""
        need = start + n
        if need > self._values.size:  # draw ahead, at least 64 at a time
            more = max(need - self._values.size, 64)
            self._values = np.concatenate([self._values, self._rng.random(more, dtype=np.float32)])
        return torch.from_numpy(self._values[start:need].copy())

    def derived_seed(self) -> int:
        """A 63-bit seed for another generator of the same request (the rejection rule's torch.Generator), the same
        at every call."""
        child = np.random.SeedSequence(self._seeds.entropy, spawn_key=(1,))
        return int(child.generate_state(1, np.uint64)[0]) >> 1


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V], u [...] in [0, 1) -> token ids [...].

    Zero-probability tokens are never chosen: the CDF does not rise at them.
    """
    # torch's CPU cumsum adds float32 in double; its CUDA one in float32. Summed in double everywhere, as the Triton
    # verify kernel does, every kind of step draws a seeded request's tokens from the same CDF on either device.
    cdf = probs.cumsum(-1) if probs.device.type == "cpu" else probs.cumsum(-1, dtype=torch.float64).float()
    target = (u * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
