"""One request: its tokens, stop conditions, cache row and acceptance statistics (no torch)."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.engine.logprobs import TokenLogprob
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.spec.context_lookup import ContextLookup

_ids = itertools.count()


@dataclass
class SequenceStats:
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per speculative step
    draft_lens: list[int] = field(default_factory=list)  # K of each speculative step (the schedule may vary it)
    draft_time: float = 0.0  # seconds in drafter forwards (shared batch time, attributed to each row)
    verify_time: float = 0.0  # seconds in target verify forwards and acceptance
    prefill_time: float = 0.0
    decode_time: float = 0.0  # wall time from the end of prefill to the last token
    time_to_first_token: float | None = None  # from the request's arrival (its queueing included)
    latency: float | None = None  # from arrival to the last token

    @property
    def tau(self) -> float | None:
        """Mean acceptance length, counting the bonus token (1.0 when nothing is accepted; None without a step)."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else None

    def histogram(self, max_len: int) -> list[int]:
        """counts[i] = number of steps that committed i + 1 tokens, i in 0..max_len-1."""
        c = Counter(self.acceptance_lengths)
        return [c.get(i + 1, 0) for i in range(max_len)]


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt: at least one token is needed")
        self.request_id = next(_ids)
        self.arrival = time.perf_counter()
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stop_ids = params.stop_ids(eos_token_ids)
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # with params.logprobs: one per output id
        self.prompt_logprobs: list[TokenLogprob] = []  # with params.prompt_logprobs: one per prompt id after the first
        # the runner's last step's logprobs for the tokens it emitted, which append commits as far as it commits them
        self.new_logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended, where finish_reason is "error" (a step's failure, or its own)
        self.slot: int = -1
        self.num_prefilled = 0  # prompt tokens whose K/V the target holds (chunked prefill advances it)
        self.num_reused = 0  # of those, the ones its row held from an earlier request (the scheduler's reuse)
        self.drafter_context = 0  # positions [0, n) of its row's drafter cache hold its context
        self.decode_start: float | None = None  # perf_counter when the first token was sampled
        self.uniforms: Any = None  # layers.sampler.PositionalUniforms: the target's sampling uniforms
        self.generator: Any = None  # torch.Generator: the drafter's samples and the rejection rule's uniforms
        self.token_sets: Any = None  # layers.logits_processors.TokenSets, built at its first shaped step
        self.grammar: Any = None  # engine.grammar.Grammar: with params.structured, what the answer must match
        # Target features ([n_i, F] each) of tokens not yet in the drafter cache, joined only when injected: a
        # stretch of plain steps adds one per step, and re-concatenating each time would copy O(n^2).
        self.pending_features: list = []
        self.stats = SequenceStats()
        self._lookup: ContextLookup | None = None
        self.stop_check = None  # callable(output_ids) -> bool, for stop strings

    @property
    def num_pending_features(self) -> int:
        """Committed tokens whose target features the drafter cache has not taken in yet."""
        return sum(f.shape[0] for f in self.pending_features)

    def context_lookup(self) -> ContextLookup:
        """The n-gram index of this request's tokens (spec/context_lookup.py), built on first use, caught up with
        the tokens committed since the last."""
        if self._lookup is None:
            self._lookup = ContextLookup(prediction=self.params.prediction or ())
        self._lookup.extend(self.prompt_ids, self.output_ids)
        return self._lookup

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= len(self.prompt_ids)

    @property
    def shapes_logits(self) -> bool:
        """Whether this step changes the target's logits before its choice (layers/logits_processors.py): penalties,
        logit_bias, allowed_token_ids, min_p where it samples, a grammar, or min_tokens while the answer is short of it
        and has stop tokens to hold (after that, or with none, the row is as fast as any: a batch's greedy rows take the
        head's int8 screen only where none of them shapes its logits otherwise than by a grammar)."""
        return self.grammar is not None or self._shapes_otherwise

    @property
    def _shapes_otherwise(self) -> bool:
        p = self.params
        return (p.penalized or bool(p.logit_bias) or p.allowed_token_ids is not None or (p.min_p > 0 and not p.greedy)
                or (len(self.output_ids) < p.min_tokens and bool(self.stop_ids)))

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the target's logits as they are: the argmax alone decides (the head's int8 screen serves it)."""
        return self.params.greedy and not self.shapes_logits

    @property
    def greedy_in_grammar(self) -> bool:
        """Greedy with a grammar its only shaping: the target's argmax stands wherever the grammar allows it."""
        return self.params.greedy and self.grammar is not None and not self._shapes_otherwise

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_cached(self) -> int:
        """Tokens whose K/V the target holds: all but the last, which is the next anchor."""
        return self.num_tokens - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    def append(self, tokens: list[int], max_model_len: int) -> int:
        """Commit tokens in order until a stop condition; returns how many were committed."""
        logprobs, self.new_logprobs = self.new_logprobs, None
        n = 0
        for t in tokens:
            self.output_ids.append(int(t))
            n += 1
            if self.grammar is not None:
                self.grammar.commit(int(t))
            if int(t) in self.stop_ids:
                self.finish_reason = "stop"
            elif self.grammar is not None and self.grammar.failed:
                self.finish_reason = "error"
                self.error = f"the request's grammar failed while decoding: {self.grammar.failure}"
            elif self.grammar is not None and self.grammar.ended:  # its eos, where that is no stop token
                self.finish_reason = "stop"
            elif (self.stop_check is not None and len(self.output_ids) > self.params.min_tokens
                  and self.stop_check(self.output_ids)):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens or self.num_tokens >= max_model_len:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if logprobs is not None:
            self.output_logprobs.extend(logprobs[:n])
        return n
