"""What a request does to the target's logits before its choice, position by position: logit_bias adds to some
tokens, the repetition, frequency and presence penalties apply (vLLM's semantics), allowed_token_ids keep only those
tokens, min_tokens masks the stop tokens until the answer holds that many, structured output masks the tokens its
grammar refuses (engine/grammar.py), and min_p drops a sampled row's tokens less likely than that share of its
likeliest. vLLM masks before it penalizes; a
masked logit is -inf either way, and masking last keeps it so (the repetition penalty's clamp would make it finite).

repetition_penalty divides a positive logit (multiplies a negative one) of every token the prompt or the output
holds; frequency_penalty subtracts, per output token, its count so far; presence_penalty subtracts once for every token
the output holds. They shape the target's distribution itself, so a speculative step applies them at each verified
position with the drafts before it counted as output: the step then keeps exactly what decoding one token at a time
under the same settings would choose.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from dflash_trt.device_copy import to_device
from dflash_trt.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenSets:
    """One request's token sets as tensors on the logits' device, built once for all its steps (a logit_bias of
    100,000 ids took 105 ms to sort): what it may choose, what it biases and by how much, and its stop tokens."""

    blocked: torch.Tensor | None  # bool [V]: the tokens allowed_token_ids leaves out
    bias_ids: torch.Tensor | None  # long [n]
    bias: torch.Tensor | None  # float32 [n]
    stops: torch.Tensor | None  # long [m], the stop ids within the vocabulary

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: Collection[int], vocab: int, device: torch.device) -> "TokenSets":
        blocked = None
        if params.allowed_token_ids is not None:
            blocked = torch.ones(vocab, dtype=torch.bool, device=device)
            blocked[to_device(params.allowed_token_ids, torch.long, device)] = False
        bias_ids = bias = None
        if params.logit_bias:
            bias_ids = to_device(list(params.logit_bias), torch.long, device)
            bias = to_device(list(params.logit_bias.values()), torch.float32, device)
        stops = [t for t in stop_ids if 0 <= t < vocab]  # an id past the head is no token it can choose
        return cls(blocked, bias_ids, bias, to_device(stops, torch.long, device) if stops else None)


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   extras: list[list[int]], stop_ids: Collection[int] = (), sets: TokenSets | None = None,
                   refused: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, V] float at n positions; extras[j]: the tokens between the committed output and position j (a
    step's drafts before it) -> the logits the request's settings make of them (a new fp32 tensor); stop_ids are
    masked at the positions before params.min_tokens output tokens. sets: TokenSets.of(params, stop_ids, ...), where
    the caller keeps them across steps. refused: bool [n, V], the tokens a grammar refuses at each position."""
    out = logits.to(torch.float32, copy=True)
    if sets is None:
        sets = TokenSets.of(params, stop_ids, out.shape[-1], out.device)
    if sets.bias is not None:
        out[:, sets.bias_ids] += sets.bias  # a dict's ids are distinct: no two additions to one logit
    if params.penalized:
        out = _penalties(out, params, prompt_ids, output_ids, extras)
    if sets.blocked is not None:
        out.masked_fill_(sets.blocked, -torch.inf)
    if refused is not None:
        out.masked_fill_(refused, -torch.inf)
    if sets.stops is not None and len(output_ids) < params.min_tokens:
        held = [j for j, extra in enumerate(extras) if len(output_ids) + len(extra) < params.min_tokens]
        out[to_device(held, torch.long, out.device)[:, None], sets.stops] = -torch.inf
    if params.min_p > 0 and not params.greedy:
        # p_i < min_p * p_max at temperature T <=> logit_i < logit_max + T ln(min_p): the cut of vLLM's min_p, which
        # it applies after the temperature and before top-k and top-p, as the sampler then does
        cut = out.max(dim=-1, keepdim=True).values + params.temperature * math.log(params.min_p)
        out.masked_fill_(out < cut, -torch.inf)
    return out


def _penalties(out: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
               extras: list[list[int]]) -> torch.Tensor:
    n, vocab = out.shape
    dev = out.device
    counts = torch.zeros(vocab, device=dev).index_add_(
        0, to_device(output_ids, torch.long, dev), torch.ones(len(output_ids), device=dev))
    counts = counts.expand(n, vocab).clone()
    for j, extra in enumerate(extras):
        if extra:
            counts[j].index_add_(0, to_device(extra, torch.long, dev), torch.ones(len(extra), device=dev))
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        in_prompt[to_device(prompt_ids, torch.long, dev)] = True
        seen = (counts > 0) | in_prompt
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        # a penalty of 1e-38 (or 1e38) would take logits past float32's range: inf, then NaN probabilities
        limit = torch.finfo(out.dtype).max
        out = out.clamp(-limit, limit)
    if params.frequency_penalty:
        out = out - params.frequency_penalty * counts
    if params.presence_penalty:
        out = out - params.presence_penalty * (counts > 0).float()
    return out
