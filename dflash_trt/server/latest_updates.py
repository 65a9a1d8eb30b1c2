"""Each choice's newest engine update, held for a reader on the event loop.

An update carries all of its request's tokens (and logprobs) so far, so one that the reader has not taken yet is
replaced by the next rather than queued behind it. A queue of every step's update grew with the square of the answer
for as long as a streaming client stopped reading (its sends wait on the socket): 4 stalled streams of 6,000 tokens
held a gigabyte. Held like this, a stalled request costs one update per choice.
"""

from __future__ import annotations

import asyncio
import contextlib

from dflash_trt.engine.engine_loop import RequestUpdate


class LatestUpdates:
    """put from the engine thread, get on the event loop: choices in the order their untaken updates arrived."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._latest: dict[int, RequestUpdate] = {}
        self._ready = asyncio.Event()

    def put(self, choice: int, update: RequestUpdate) -> None:
        """From any thread."""
        with contextlib.suppress(RuntimeError):  # the event loop closed: no one is left to answer
            self._aio.call_soon_threadsafe(self._put, choice, update)

    def _put(self, choice: int, update: RequestUpdate) -> None:
        self._latest[choice] = update  # an untaken one keeps its place: no choice waits behind a busier one
        self._ready.set()

    async def get(self) -> tuple[int, RequestUpdate]:
        while not self._latest:
            self._ready.clear()
            await self._ready.wait()
        choice = next(iter(self._latest))
        return choice, self._latest.pop(choice)

    def __len__(self) -> int:
        return len(self._latest)
