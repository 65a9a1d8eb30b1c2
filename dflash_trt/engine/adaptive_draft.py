"""Turning speculation off where it stops paying, from what the engine itself measures.

A draft_len_schedule fixes K per batch size ahead of time, from a tau measured offline. Served prompts can
accept far less: the CPU default's drafter reaches tau 1.44 at K=3 on its held-out prompts, ~1.2 on chat
benchmark prompts, while a K=3 step costs ~1.4x a plain one there, so a fixed K loses to plain decoding.

AdaptiveDraftLen keeps, per batch-size bucket, running means of the plain step time and of the step time at
each K it has run, plus a running per-draft acceptance rate alpha (geometric model, spec/acceptance_model.py). Each step
it keeps the scheduled K only while tau(alpha, K) / t(K) >= 1 / t(0), i.e. while speculation gives more tokens
per second, and every `probe_every` steps it runs the other mode once to keep both measurements current.
Each side is measured `warmup` times before any decision, and its first step is dropped: first calls pay
one-off costs (seen: a first plain step slow enough to keep a useless drafter on for a whole request).
Verification is lossless, so K changes speed only, never the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_trt.spec.acceptance_model import alpha_from_tau, tau_from_acceptance


def batch_bucket(batch_size: int) -> int:
    """Power-of-two buckets (1, 2, 4, 8, ...): step costs within one are close enough to share a measurement."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class AdaptiveDraftLen:
    probe_every: int = 16  # steps between runs of the mode not chosen
    smoothing: float = 0.25  # weight of the newest observation in the running means, once warm
    warmup: int = 3  # observations of each side before deciding (the first is dropped)
    _step_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, K) -> seconds
    _seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, K) -> observations
    _since_probe: dict[int, int] = field(default_factory=dict)
    alpha: float | None = None  # running per-draft acceptance

    def choose(self, batch_size: int, k: int) -> int:
        """K for this step: the scheduled k, or 0 where plain decoding is measured to be faster."""
        if k == 0:
            return 0
        bucket = batch_bucket(batch_size)
        if self._seen.get((bucket, k), 0) < self.warmup or self.alpha is None:
            return k  # measure speculation first,
        if self._seen.get((bucket, 0), 0) < self.warmup:
            return 0  # then plain steps
        spec_s, plain_s = self._step_s[(bucket, k)], self._step_s[(bucket, 0)]
        spec_wins = tau_from_acceptance(self.alpha, k) / spec_s >= 1.0 / plain_s
        n = self._since_probe.get(bucket, 0) + 1
        self._since_probe[bucket] = n % self.probe_every
        if n == self.probe_every:
            return 0 if spec_wins else k
        return k if spec_wins else 0

    def observe(self, batch_size: int, k: int, step_s: float, tokens_per_row: list[int]) -> None:
        """One decode step's wall time and, for k > 0, the tokens each row committed (accepted drafts + 1)."""
        key = (batch_bucket(batch_size), k)
        n = self._seen[key] = self._seen.get(key, 0) + 1
        # the first observation is replaced by the second, then a plain mean until the running mean takes over
        weight = 1.0 if n <= 2 else max(self.smoothing, 1.0 / (n - 1))
        old = self._step_s.get(key, step_s)
        self._step_s[key] = old + weight * (step_s - old)
        if k > 0 and tokens_per_row:
            tau = sum(tokens_per_row) / len(tokens_per_row)
            a = alpha_from_tau(min(max(tau, 1.0), k + 1.0), k)
            self.alpha = a if self.alpha is None else self.alpha + self.smoothing * (a - self.alpha)
