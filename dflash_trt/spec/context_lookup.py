"""Context lookup: drafts copied from a request's own tokens (prompt lookup decoding, n-gram drafting).

Answers repeat their prompt and themselves: a summary quotes the passage, a list repeats its own phrasing, a small
model loops. Where the last n tokens (n from `max_ngram` down to `min_ngram`) occurred before, the tokens that
followed their latest earlier occurrence are a draft that costs no model at all. The engine grafts it onto a step's
draft tree (spec/draft_tree.py `graft`) beside the drafter's paths, so the target verifies both in the same forward
and keeps whichever it agrees with: the output stays the target's own, whatever the draft.

On the SmolLM2 drafter's held-out prompts a 7-token lookup branch beside a 6-node tree (K=7) would accept about 0.4
more tokens a step, offline (benchmarks/README.md, "Context lookup").
"""

from __future__ import annotations


class ContextLookup:
    """An incremental index of one request's n-grams: where each last occurred, so a lookup costs a dict probe."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.ngrams = range(max_ngram, min_ngram - 1, -1)  # longest first: the most specific match wins
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence sits
        self._indexed = 0  # continuations indexed: positions 1.._indexed - 1 (of the tokens seen so far)

    def draft(self, tokens: list[int], max_len: int) -> list[int]:
        """Up to max_len tokens that followed the latest earlier occurrence of the longest matching suffix of
        `tokens` (the request's prompt and output so far; only ever extended between calls); [] without one."""
        if max_len <= 0:
            return []
        end = len(tokens)
        for i in range(max(1, self._indexed), end):  # the n-grams ending just before each new continuation start
            for n in self.ngrams:
                if i >= n:
                    self._next[tuple(tokens[i - n : i])] = i
        self._indexed = max(self._indexed, end)
        for n in self.ngrams:
            if end > n:  # an n-gram ending at `end` can only have occurred earlier when end > n
                start = self._next.get(tuple(tokens[end - n :]))
                if start is not None:
                    return tokens[start : start + max_len]
        return []
