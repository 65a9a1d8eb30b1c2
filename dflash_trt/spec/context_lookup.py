"""Context lookup: drafts copied from a request's own tokens (prompt lookup decoding, n-gram drafting).

Answers repeat their prompt and themselves: a summary quotes the passage, a list repeats its own phrasing, a small
model loops. Where the last n tokens (n from `max_ngram` down to `min_ngram`) occurred before, the tokens that
followed their latest earlier occurrence are a draft that costs no model at all. The engine offers it to a step's
draft tree (spec/draft_tree.py `build_tree`) beside the drafter's paths: each of the branch's prefixes is scored by
how often this request's lookups were accepted that deep, the drafter's paths by their probabilities, and the tree's
nodes go to the likeliest of both; a chain step drafts the lookup instead of the drafter's chain where its prefixes'
probabilities sum higher (the tokens each is expected to get accepted; engine/model_runner.py). The target verifies
the drafts in one forward and keeps what it agrees with, so the output stays the target's own whatever the draft.

A request may predict its output (OpenAI's predicted outputs: a file it rewrites with a few changes). Its lookups
copy the prediction first: from where the output, which starts aligned with the prediction's start, still follows
it; where the output has left it (an edit), from the first occurrence of the output's last tokens in the prediction
past where they were last aligned (the rest of the file after the edit); else from the context as above.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

# P(a lookup is accepted at least d tokens deep) before a request has any: about what SmolLM2's lookups reach on the
# `cpu-small` prompts (0.41 at depth 1, then ~0.75 per token; benchmarks/README.md, "Context lookup").
PRIOR_FIRST, PRIOR_NEXT = 0.4, 0.75
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed lookups at each depth


class ContextLookup:
    """One request's n-gram index (where each n-gram last occurred, so a lookup is a dict probe), its predicted
    output's where it has one, and how deep its lookups have been accepted."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, prediction: Sequence[int] = ()) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.ngrams = range(max_ngram, min_ngram - 1, -1)  # longest first: the most specific match wins
        self.prediction = list(prediction)
        # n-gram -> where the token after each of its occurrences in the prediction sits, in order
        self._predicted: dict[tuple[int, ...], list[int]] = {}
        for n in self.ngrams:
            for i in range(n, len(self.prediction)):
                self._predicted.setdefault(tuple(self.prediction[i - n:i]), []).append(i)
        self._prompt_len: int | None = None
        self._aligned: int | None = 0  # where the output goes on in the prediction, while it follows it
        self._reached = 0  # the furthest place in the prediction it has followed it to
        self._compared = 0  # output tokens compared with the prediction so far
        self.tokens: list[int] = []  # the request's tokens so far (its own copy: extended, never rebuilt)
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence sits
        self._indexed = 0  # continuation starts indexed so far: positions < _indexed
        self._verified: list[int] = []  # per depth d - 1: lookups the target verified at least d tokens deep
        self._accepted: list[int] = []  # per depth d - 1: lookups it accepted at least d tokens deep

    def extend(self, prompt: list[int], output: list[int]) -> None:
        """Catch up with the request: its prompt and output so far, which only ever grow."""
        if self._prompt_len is None:
            self._prompt_len = len(prompt)
        seen = len(self.tokens)
        if seen < len(prompt):
            self.tokens += prompt[seen:]
            seen = len(prompt)
        self.tokens += output[seen - len(prompt) :]

    def draft(self, max_len: int) -> list[int]:
        """Up to max_len tokens following the latest earlier occurrence of the longest matching suffix of the tokens
        so far (n-grams from max_ngram down to min_ngram tokens); [] without one. Where the occurrence is the
        request's own recent text (a loop), the copy runs on through what it has copied. A predicted output is drafted
        first, where the output follows it or rejoins it (_predicted_draft)."""
        tokens, end = self.tokens, len(self.tokens)
        if self.prediction and max_len > 0 and (predicted := self._predicted_draft(max_len)):
            return predicted
        for i in range(self._indexed, end):  # the n-grams ending just before each new continuation start
            for n in self.ngrams:
                if i >= n:
                    self._next[tuple(tokens[i - n : i])] = i
        self._indexed = end
        if max_len <= 0:
            return []
        for n in self.ngrams:
            if end > n:  # an n-gram ending at `end` can only have occurred earlier when end > n
                start = self._next.get(tuple(tokens[end - n :]))
                if start is not None:
                    out = tokens[start : start + max_len]
                    while len(out) < max_len:  # the match runs into the present: continue the period
                        out.append(out[len(out) - (end - start)])
                    return out
        return []

    def follows_prediction(self) -> bool:
        """Whether the output so far follows its prediction (from its start, or since it rejoined it), which has
        tokens left."""
        prediction, start = self.prediction, self._prompt_len or 0
        for t in self.tokens[start + self._compared:]:
            if self._aligned is not None and self._aligned < len(prediction) and prediction[self._aligned] == t:
                self._aligned += 1
                self._reached = max(self._reached, self._aligned)
            else:
                self._aligned = None
        self._compared = len(self.tokens) - start
        return self._aligned is not None and self._aligned < len(prediction)

    def _predicted_draft(self, max_len: int) -> list[int]:
        """Up to max_len tokens of the prediction from where the output follows it, or re-found it; [] where it
        does neither."""
        self.follows_prediction()
        if self._aligned is None:
            self._aligned = self._refound()
        if self._aligned is None:
            return []
        self._reached = max(self._reached, self._aligned)
        return self.prediction[self._aligned:self._aligned + max_len]

    def _refound(self) -> int | None:
        """Where the output's last tokens (the longest n-gram found) occur in the prediction: their first occurrence
        at or past where the output last followed it, else their last before."""
        end = len(self.tokens)
        for n in self.ngrams:
            if end >= n and (after := self._predicted.get(tuple(self.tokens[end - n:]))):
                at = bisect.bisect_left(after, self._reached)
                return after[at] if at < len(after) else after[-1]
        return None

    def scored_draft(self, max_len: int) -> list[tuple[int, float]]:
        """draft()'s tokens, each with the log-probability that the target accepts the draft up to it: this
        request's acceptance so far at that depth, shrunk towards the prior, never rising with depth."""
        out, best = [], 0.0
        for d, token in enumerate(self.draft(max_len)):
            prior = PRIOR_FIRST * PRIOR_NEXT**d
            verified, accepted = (self._verified[d], self._accepted[d]) if d < len(self._verified) else (0, 0)
            best = min(best, math.log((accepted + PRIOR_WEIGHT * prior) / (verified + PRIOR_WEIGHT)))
            out.append((token, best))
        return out

    def observe(self, verified: int, accepted: int) -> None:
        """A step verified the draft's first `verified` tokens and accepted its first `accepted`."""
        if len(self._verified) < verified:
            grow = verified - len(self._verified)
            self._verified += [0] * grow
            self._accepted += [0] * grow
        for d in range(verified):
            self._verified[d] += 1
            self._accepted[d] += d < accepted
