"""Per-request decoding parameters."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from dflash_trt.structured_output import StructuredOutput

AcceptanceRule = Literal["match", "rejection"]

# Temperatures below this decode greedily: logits divided by one overflow fp32 to inf, and the softmax of those is NaN
# (1e-38 sampled garbage); at 1e-5 a logit gap of 0.001 is already a factor e^100 (vLLM's cut too).
GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (and vLLM's default max_logprobs)
# Each stop string is looked for at every step, on the engine's thread that every request shares: 100,000 of them
# made another request's 100 tokens take 7 s instead of 0.3 (OpenAI takes 4)
MAX_STOP_STRINGS = 256
# Characters of all stop strings together: a streamed answer is held back where its end may begin one, which costs up
# to the square of a stop's length an update on the server's event loop (256 stops of 80,000 characters stalled it
# 24 s); the engine decodes as many of the last tokens as the longest has bytes, every step
MAX_STOP_CHARS = 4096


def check_stop_strings(stop: list[str]) -> None:
    """ValueError where stop strings are empty, or more, or longer together, than a request may send."""
    if any(not x for x in stop):
        raise ValueError("stop strings must not be empty (an empty one would match before any text)")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings, more than the {MAX_STOP_STRINGS} a request may send (each "
                         "is looked for at every step, on the engine every request shares)")
    if (chars := sum(map(len, stop))) > MAX_STOP_CHARS:
        raise ValueError(f"stop strings hold {chars} characters together, more than the {MAX_STOP_CHARS} a request may "
                         "send")


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's `choice`-th answer (OpenAI's n): choice 0 keeps the request's own, so n=1 samples as
    before; the others are drawn from it, independent of each other and of any other request's seed."""
    if choice == 0:
        return seed
    import numpy as np

    state = np.random.SeedSequence(2 * abs(seed) + int(seed < 0), spawn_key=(choice,)).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def is_int(x: object) -> bool:  # numpy's integers too; not a bool, which would read as token 0 or 1
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:  # NaN is not in any range checked against it
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class ParamError(ValueError):
    """A request's setting the model cannot take (token ids past its vocabulary, a setting structured output cannot
    have beside it), naming the field (`param`) that holds it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request decodes.

    temperature 0 (or below GREEDY_BELOW) is greedy. With temperature > 0, `acceptance` picks the lossless rule:
    "match" drafts the drafter's argmax and keeps a draft token only when it equals the target's own
    sample (speculative sampling with a one-hot draft distribution); "rejection" samples drafts from
    the drafter's distribution q and accepts with probability min(1, p/q) (arXiv 2211.17192).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # None: the model's eos ids
    stop: list[str] = field(default_factory=list)  # a string alone is one stop string
    ignore_eos: bool = False
    acceptance: AcceptanceRule = "match"
    logprobs: int | None = None  # None: none; n: each emitted token's log-probability and its n likeliest alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after its first (OpenAI's echo)
    # penalties on the target's logits (layers/logits_processors.py, vLLM's semantics): 0, 0 and 1 leave them be
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: the stop token ids (eos unless ignore_eos, and stop_token_ids) are masked out of the target's logits
    # until the output holds this many tokens
    min_tokens: int = 0
    # OpenAI's: added to these tokens' logits ([-100, 100]); vLLM's: only these tokens may be chosen
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: a sampled token's probability must be at least this share of the likeliest's (0: off; greedy ignores it)
    min_p: float = 0.0
    # what the answer must match (structured_output.py): the target's choice among the tokens that keep it matching
    structured: StructuredOutput | None = None
    # OpenAI's predicted outputs: the answer's expected tokens (a file the answer rewrites with a few changes),
    # drafted where the answer follows them (spec/context_lookup.py); the answer is the target's own whatever they are
    prediction: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # else each of its characters would stop the answer
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        # containers and flags by type: bytes read as a list of ints, 'no' as a true ignore_eos, and an int failed
        # deep in a step with a TypeError
        if not (isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        self.stop = list(self.stop)
        for name in ("stop_token_ids", "allowed_token_ids", "prediction"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (list, tuple, set)):
                raise ValueError(f"{name} must be a list of token ids, got {getattr(self, name)!r:.80}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        # types first: a float count reached the engine as a draft length of 0.5, a string failed a comparison
        for name in ("max_new_tokens", "top_k", *(n for n in ("seed", "logprobs", "prompt_logprobs")
                                                 if getattr(self, n) is not None)):
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN compares False both ways
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        check_stop_strings(self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_TOP_LOGPROBS}, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not is_int(self.min_tokens):  # before the range, which a string or None would fail with a TypeError
            raise ValueError(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
        if self.logit_bias and not all(_is_real(b) and -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {list(self.logit_bias.values())}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (no token could be chosen)")
        if isinstance(self.prediction, set):  # (its order is the answer's)
            raise ValueError("prediction must be a list of token ids in the order the answer would have them")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids", "prediction"):
            if not all(is_int(t) and t >= 0 for t in getattr(self, name) or ()):
                raise ValueError(f"{name} token ids must be integers >= 0")
        if self.acceptance not in ("match", "rejection"):
            raise ValueError(f"acceptance must be 'match' or 'rejection', got {self.acceptance!r}")
        if self.structured is not None:
            self._check_structured()

    def _check_structured(self) -> None:
        if not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        # each of these can leave no token the grammar allows: the grammar's end is the model's eos, which
        # ignore_eos would not stop at and min_tokens masks; allowed_token_ids may hold none of a position's tokens
        for name, unset in (("ignore_eos", False), ("min_tokens", 0), ("allowed_token_ids", None)):
            if getattr(self, name) != unset:
                raise ParamError(name, f"{name} cannot be combined with structured output (the grammar decides which "
                                 "tokens may come, and where the answer ends)")

    def stop_ids(self, eos_token_ids: Collection[int]) -> set[int]:
        """The token ids that end the answer: stop_token_ids where given, else the model's eos unless ignore_eos."""
        if self.stop_token_ids is not None:
            return set(self.stop_token_ids)
        return set() if self.ignore_eos else set(eos_token_ids)

    def check_token_ids(self, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        """ParamError where logit_bias, allowed_token_ids or prediction name a token past the vocabulary (in a step
        the index would fail every request batched with this one), stop_token_ids one (it would never stop the
        answer), or min_tokens would mask every allowed token."""
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids", "prediction"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            if bad:
                raise ParamError(name, f"{name} token ids must be in 0..{vocab_size - 1}, got {bad[:5]}")
        if not self.min_tokens:
            return
        stops = self.stop_ids(eos_token_ids)
        if self.allowed_token_ids and set(self.allowed_token_ids) <= stops:
            raise ParamError("allowed_token_ids", "allowed_token_ids are all stop tokens, which min_tokens masks "
                               f"until the answer holds {self.min_tokens}: no token could be chosen")
        if sum(0 <= t < vocab_size for t in stops) == vocab_size:
            raise ParamError("stop_token_ids", f"stop_token_ids hold every token of the vocabulary ({vocab_size}), "
                               f"which min_tokens masks until the answer holds {self.min_tokens}: no token could be "
                               "chosen")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def samples_drafts(self) -> bool:
        """Whether its drafts are sampled from the drafter and accepted by the "rejection" rule; a greedy or "match"
        request is verified by the target's own choice instead, which draft trees and context lookups need."""
        return not self.greedy and self.acceptance == "rejection"
