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
    chosen = lp.gather(1, to_device(tokens, torch.long, lp.device)[:, None])
    values, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], lp[:, :0])
    # one read back to the host, not three (on a GPU each waits for the step's kernels); float64 holds the fp32
    # figures and the token ids exactly
    rows = torch.cat([chosen.double(), values.double(), ids.double()], dim=1).tolist()
    return [TokenLogprob(t, r[0], tuple(zip(map(int, r[1 + top:]), r[1: 1 + top]))) for t, r in zip(tokens, rows)]
