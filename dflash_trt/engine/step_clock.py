"""StepClock: how a speculative step's time splits between drafting and verifying.

On a GPU the host only queues kernels, so the host clock read between the drafter's call and the target's reads
when the drafter's work was queued, not when it was done, and charged nearly all of it to the verify. There the
split point is a CUDA event on the model's device, read once the step's tokens reached the host (which waits for
both). The step's whole time is the host's either way: it ends after that wait. GPU work queued before the step
without a wait (a prompt chunk that ends no prompt) still lands on the verify side there.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self._events = device.type == "cuda"
        self._start = time.perf_counter()
        self._drafted = self._start
        if self._events:
            self._stream = torch.cuda.current_stream(device)  # the model's device, which need not be the current one
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._drafted_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(self._stream)

    def drafted(self) -> None:
        """Mark the end of drafting (after the drafter's work has been issued)."""
        if self._events:
            self._drafted_event.record(self._stream)
        else:
            self._drafted = time.perf_counter()

    def split(self) -> tuple[float, float]:
        """(draft seconds, verify seconds), read after the step's results are on the host."""
        total = time.perf_counter() - self._start
        if self._events:
            self._drafted_event.synchronize()
            draft = self._start_event.elapsed_time(self._drafted_event) / 1e3
        else:
            draft = self._drafted - self._start
        draft = min(draft, total)
        return draft, total - draft
