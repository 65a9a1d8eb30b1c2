"""Tree-free block verification: which draft tokens the target keeps.

Terms used throughout the project:
- draft tokens d_1..d_K: the drafter's proposal for the positions after the anchor;
- the target scores the block [anchor, d_1..d_K] in one forward, giving K + 1 distributions p_0..p_K
  (p_i is the target's distribution for the token after block position i);
- accepted tokens: the longest prefix d_1..d_a that the rule keeps (num_accepted = a, 0 <= a <= K);
- bonus token: the target's own token at position a (sampled from p_a, or from the residual after a
  rejection), always emitted, and the next block's anchor;
- acceptance length tau = a + 1 (it counts the bonus), so 1 <= tau <= K + 1 <= draft_block_size.

Rules: greedy (d_i == argmax p_{i-1}); "match" (target-sample-and-match: d_i == x_{i-1} with
x ~ p, lossless because every emitted token is the target's own sample); "rejection" (accept d_i with
probability min(1, p(d_i) / q(d_i)), on rejection resample from normalize(max(0, p - q)), bonus from
p_K if all are accepted; arXiv 2211.17192).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.layers.argmax import argmax_last
from dflash_trt.layers.sampler import sample_from, uniform


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] long, 0..K
    bonus: torch.Tensor  # [B] long

    def emitted(self, draft_tokens: torch.Tensor) -> list[list[int]]:
        """Per row: the accepted drafts followed by the bonus token."""
        # one read back from the device, not three (on a GPU each waits for every queued kernel)
        rows = torch.cat([draft_tokens, self.num_accepted[:, None], self.bonus[:, None]], dim=1).tolist()
        return [r[: r[-2]] + [r[-1]] for r in rows]


def _prefix_len(matches: torch.Tensor) -> torch.Tensor:
    # matches: [B, K] bool -> length of the all-True prefix per row
    return matches.to(torch.long).cumprod(dim=1).sum(dim=1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """draft_tokens [B, K], target_logits [B, K + 1, V]."""
    return accept_greedy(draft_tokens, argmax_last(target_logits))


def accept_greedy(draft_tokens: torch.Tensor, target_choice: torch.Tensor) -> VerifyResult:
    """The greedy rule given the target's argmax at every block position (target_choice [B, K + 1])."""
    a = _prefix_len(draft_tokens == target_choice[:, :-1])
    return VerifyResult(a, target_choice.gather(1, a[:, None])[:, 0])


def verify_match(draft_tokens: torch.Tensor, target_probs: torch.Tensor, generators: list[torch.Generator]) -> VerifyResult:
    """Target-sample-and-match. target_probs [B, K + 1, V]; row b draws K + 1 uniforms from generators[b]."""
    return match_from_uniforms(draft_tokens, target_probs, uniform(generators, target_probs.shape[1], target_probs.device))


def match_from_uniforms(draft_tokens: torch.Tensor, target_probs: torch.Tensor, u: torch.Tensor) -> VerifyResult:
    """verify_match given its uniforms u [B, K + 1] (one inverse-CDF draw per block position)."""
    choice = sample_from(target_probs, u)  # [B, K + 1]
    a = _prefix_len(draft_tokens == choice[:, :-1])
    return VerifyResult(a, choice.gather(1, a[:, None])[:, 0])


def verify_rejection(
    draft_tokens: torch.Tensor,  # [B, K] sampled from draft_probs
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    generators: list[torch.Generator],
) -> VerifyResult:
    k = draft_tokens.shape[1]
    u = uniform(generators, k + 1, target_probs.device)  # k acceptance draws + 1 for the final sample
    return rejection_from_uniforms(draft_tokens, draft_probs, target_probs, u)


def rejection_from_uniforms(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K + 1, V]
    u: torch.Tensor,  # [B, K + 1]: K acceptance draws, then the residual / bonus draw
) -> VerifyResult:
    b, k = draft_tokens.shape
    p = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    a = _prefix_len(u[:, :k] * q < p)
    rows = torch.arange(b, device=draft_tokens.device)
    p_a = target_probs[rows, a]  # [B, V]
    zeros = draft_probs.new_zeros(b, 1, target_probs.shape[-1])  # (not draft_probs[:, :1]: empty where K = 0)
    q_a = torch.cat([draft_probs, zeros], dim=1)[rows, a]  # zeros when all accepted
    residual = (p_a - q_a).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only when p == q exactly, where any rejection is impossible; fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), p_a)
    return VerifyResult(a, sample_from(residual, u[:, k]))
