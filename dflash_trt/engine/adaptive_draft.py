"""Turning speculation off where it stops paying, from what the engine itself measures.

A draft_len_schedule fixes K per batch size ahead of time, from a tau measured offline. Served prompts can
accept far less: the CPU default's drafter reaches tau 1.44 at K=3 on its held-out prompts, ~1.2 on chat
benchmark prompts, while a K=3 step costs ~1.4x a plain one there, so a fixed K loses to plain decoding.

AdaptiveDraftLen keeps, per batch-size bucket, running means of the plain step time and of the step time at
each K it has run, plus, per K, a running mean of the tokens a row commits per step (tau). Each step it keeps the
scheduled K only while tau(K) / t(K) >= 1 / t(0), i.e. while speculation gives more tokens per second, and now
and then runs the other mode to keep both measurements current (at first every `probe_every` steps). While
speculation wins, a probe is a plain step (and a catch-up step after it), ~1.5% of a paying K's throughput at 16
steps, and what it measures, the plain step time, drifts slowly: each such probe that leaves the choice as it was
doubles the interval to the next (up to `max_probe_every`), and any change of choice brings it back to
`probe_every`. While plain decoding wins, speculation is probed at least every `max_probe_every` steps, since tau
changes with the text and is learned only from speculative steps (session 5 backed these probes off as probes
confirmed plain decoding, and an unlucky start then kept a paying K off). How often depends on what a probe costs:
its `probe_len` steps of t(K) commit tau tokens a row each where plain steps in that time would commit t(K) / t(0),
so a probe every n steps loses probe_len x (t(K) / t(0) - tau) / n of plain decoding's tokens; n keeps that under
`probe_budget`, and is never below `probe_every`. Where speculation nearly pays (t(K) 1.4x, tau 1.25) that is
every 30 steps; where it is far off, as K=2 at 4 rows on a CPU without AMX (t(K) 2.5x, tau 1.74: a probe loses 1.6
tokens a row), every 158 instead of 16, which had cost that engine 8% of plain decoding's throughput
(benchmarks/README.md, session 38). The estimate leaves out that a probe's first step catches up (untimed; 29
against 25 ms there), so probes lose somewhat more than the budget. Until tau has `settle` speculative steps behind
it the interval stays `probe_every`: a tau read from a few unlucky steps would otherwise space out the very probes
that correct it.
tau is averaged as it is measured: a mean of per-step acceptance rates put through the geometric model
(spec/acceptance_model.py) would read low, because tau is convex in the rate (steps of tau 1 and 3 average to 2,
their rates 0 and 1 to a rate giving 1.75 at K=2; on the CPU default's chat prompts 1.26 for a measured 1.38,
enough to keep a paying K=2 off).
Each side is measured `warmup` times before any decision, and its first step is dropped: first calls pay
one-off costs (seen: a first plain step slow enough to keep a useless drafter on for a whole request).
A speculative step that follows plain steps (or a prompt) first injects all their pending target features into
the drafter cache, more than a steady step's K + 1 (and past the drafter's block, padded): such catch-up steps
count for tau but not for the step time, and a probe of speculation runs `probe_len` steps so that it measures
a steady one. Timed, catch-ups made every probe from plain mode look slower than speculation runs.
A step's time is the engine's whole cycle (LLMEngine.step: from the end of the previous step to the end of this
one), not the model's forward passes alone: a server spends time per step outside them (handing tokens to the
streams, detokenizing, metrics; about 1.6 ms a step against a 5 ms plain forward, SmolLM2 on this CPU, one
stream), and a speculative step pays it once for several tokens. Timing the forwards alone ranked a K=2 that
serves 1.2x faster as barely better than plain decoding, so the mode ran plain steps often enough to give most of
the gain back (served one stream: 1.04-1.06x against 1.10-1.21x with the fixed K).
Verification is lossless, so K changes speed only, never the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def batch_bucket(batch_size: int) -> int:
    """Power-of-two buckets (1, 2, 4, 8, ...): step costs within one are close enough to share a measurement."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class AdaptiveDraftLen:
    probe_every: int = 16  # steps between runs of the mode not chosen
    max_probe_every: int = 256  # the longest interval between probes of either mode
    probe_budget: float = 0.01  # while plain wins: the share of its tokens that probes of speculation may lose
    settle: int = 8  # speculative steps measured before the budget may space probes out
    probe_len: int = 2  # speculative steps per probe from plain mode (the first one catches up)
    smoothing: float = 0.25  # weight of the newest step time in its running mean, once warm
    tau_smoothing: float = 0.05  # and of the newest step's tau: a step's tau is one of 1..K+1, so a longer memory
    warmup: int = 3  # observations of each side before deciding (the first is dropped)
    _step_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, K) -> seconds
    _seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, K) -> observations
    _since_probe: dict[int, int] = field(default_factory=dict)
    _probe_interval: dict[int, int] = field(default_factory=dict)  # bucket -> steps between probes now
    _spec_won: dict[int, bool] = field(default_factory=dict)  # bucket -> the last decision
    _probe_left: dict[int, int] = field(default_factory=dict)  # bucket -> speculative probe steps still to run
    _tau: dict[int, float] = field(default_factory=dict)  # K -> running mean tokens per row per step
    _tau_seen: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.probe_budget <= 0:
            raise ValueError(f"probe_budget must be > 0, got {self.probe_budget}")

    def choose(self, batch_size: int, k: int) -> int:
        """K for this step: the scheduled k, or 0 where plain decoding is measured to be faster."""
        if k == 0:
            return 0
        bucket = batch_bucket(batch_size)
        if self._probe_left.get(bucket, 0) > 0:
            self._probe_left[bucket] -= 1
            return k
        if self._seen.get((bucket, k), 0) < self.warmup or k not in self._tau:
            return k  # measure speculation first,
        if self._seen.get((bucket, 0), 0) < self.warmup:
            return 0  # then plain steps
        spec_s, plain_s = self._step_s[(bucket, k)], self._step_s[(bucket, 0)]
        spec_wins = self._tau[k] / spec_s >= 1.0 / plain_s
        interval = self._probe_interval.get(bucket, self.probe_every)
        if self._spec_won.get(bucket, spec_wins) != spec_wins:
            interval, self._since_probe[bucket] = self.probe_every, 0
        if not spec_wins and self._tau_seen[k] >= self.settle:
            lost = self.probe_len * (spec_s / plain_s - self._tau[k])  # tokens a row, against plain steps
            interval = max(self.probe_every, min(self.max_probe_every, math.ceil(lost / self.probe_budget)))
        self._spec_won[bucket] = spec_wins
        n = self._since_probe.get(bucket, 0) + 1
        self._since_probe[bucket] = n
        self._probe_interval[bucket] = interval
        if n >= interval:
            self._since_probe[bucket] = 0
            if spec_wins:  # doubled now; a probe that changes the choice resets it at the next decision
                self._probe_interval[bucket] = min(2 * interval, self.max_probe_every)
                return 0
            self._probe_left[bucket] = self.probe_len - 1
            return k
        return k if spec_wins else 0

    def observe(self, batch_size: int, k: int, step_s: float | None, tokens_per_row: list[int],
                catch_up: bool = False) -> None:
        """One decode step's wall time (None: not known) and, for k > 0, the tokens each row committed (accepted
        drafts + 1). catch_up: the step injected more pending features than a steady step (after plain steps or a
        prompt)."""
        if k > 0 and tokens_per_row:
            n = self._tau_seen[k] = self._tau_seen.get(k, 0) + 1
            tau = sum(tokens_per_row) / len(tokens_per_row)
            old = self._tau.get(k, tau)
            self._tau[k] = old + max(self.tau_smoothing, 1.0 / n) * (tau - old)  # a plain mean until it is warm
        if catch_up or step_s is None:
            return
        key = (batch_bucket(batch_size), k)
        n = self._seen[key] = self._seen.get(key, 0) + 1
        # the first observation is replaced by the second, then a plain mean until the running mean takes over
        weight = 1.0 if n <= 2 else max(self.smoothing, 1.0 / (n - 1))
        old = self._step_s.get(key, step_s)
        self._step_s[key] = old + weight * (step_s - old)
