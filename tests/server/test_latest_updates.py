"""What a request's reader is handed: each choice's newest update, however many steps it fell behind."""

from __future__ import annotations

import asyncio
import threading

from dflash_trt.engine.engine_loop import RequestUpdate
from dflash_trt.server.latest_updates import LatestUpdates


def _update(tokens: int, finished: bool = False) -> RequestUpdate:
    return RequestUpdate(request_id=7, token_ids=tuple(range(tokens)), finished=finished)


def test_a_reader_that_fell_behind_holds_one_update_per_choice_and_gets_the_newest():
    """A queue of every step's update (each carrying all tokens so far) grew with the square of the answer while a
    streaming client stopped reading."""
    async def main():
        updates = LatestUpdates(asyncio.get_running_loop())
        engine = threading.Thread(target=lambda: [updates.put(0, _update(n, n == 500)) for n in range(1, 501)])
        engine.start()
        await asyncio.to_thread(engine.join)
        await asyncio.sleep(0)  # the engine thread's puts run on the event loop
        assert len(updates) == 1
        choice, update = await updates.get()
        assert choice == 0 and update.finished and len(update.token_ids) == 500
        assert len(updates) == 0

    asyncio.run(main())


def test_choices_come_in_the_order_their_untaken_updates_arrived():
    async def main():
        updates = LatestUpdates(asyncio.get_running_loop())
        for choice, tokens in [(2, 1), (0, 1), (2, 2), (1, 1), (0, 2)]:
            updates.put(choice, _update(tokens))
        await asyncio.sleep(0)
        got = [await updates.get() for _ in range(3)]
        assert [(c, len(u.token_ids)) for c, u in got] == [(2, 2), (0, 2), (1, 1)]

    asyncio.run(main())


def test_a_reader_waits_for_the_next_update():
    async def main():
        updates = LatestUpdates(asyncio.get_running_loop())
        reader = asyncio.ensure_future(updates.get())
        await asyncio.sleep(0.01)
        assert not reader.done()
        threading.Thread(target=updates.put, args=(3, _update(4, True))).start()
        choice, update = await asyncio.wait_for(reader, 5)
        assert choice == 3 and update.finished

    asyncio.run(main())


def test_an_update_after_the_event_loop_closed_is_dropped():
    aio = asyncio.new_event_loop()
    held = LatestUpdates(aio)
    aio.close()
    held.put(0, _update(1))  # the engine thread must not raise: its request's server is gone
