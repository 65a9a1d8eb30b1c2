"""The target's log-probabilities of the tokens a request emits, and of its likeliest alternatives.

Raw log-probabilities: the log-softmax of the target's logits before temperature, top-k and top-p (vLLM's default,
`raw_logprobs`), so a token's figure is the model's belief whatever the request sampled with. Each comes from the
forward that verified the token: the same distribution plain decoding would read at that position (in fp32 equal
to it; in bf16 a K-token verify and a one-token decode may round apart, as their logits do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the module stays torch-free for Sequence, which holds TokenLogprobs
    import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens at this position, best first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] at the positions where tokens[i] was emitted -> one TokenLogprob per token, each with `top`
    alternatives."""
    import torch

    from dflash_trt.device_copy import to_device

    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, to_device(tokens, torch.long, lp.device)[:, None])[:, 0].tolist()
    if top > 0:
        values, ids = lp.topk(top, dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alts = [()] * len(tokens)
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alts)]
