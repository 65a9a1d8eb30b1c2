"""Signal handlers set for a block (a build, a training run's stages) and put back after it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


def stop_signals() -> list[signal.Signals]:
    """What stops a server: SIGINT, SIGTERM, and SIGHUP (its terminal closed) unless ignored, as nohup leaves it."""
    hup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else []
    return [signal.SIGINT, signal.SIGTERM, *hup]


@contextlib.contextmanager
def signal_handlers(handler: Callable, *signals: signal.Signals) -> Iterator[None]:
    """`handler` for `signals` while the block runs, then what was there before. Only the main thread may set
    handlers; a signal that is ignored (SIGINT in a background job) stays ignored."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            if signal.getsignal(sig) != signal.SIG_IGN:
                previous[sig] = signal.getsignal(sig)
                signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            # getsignal gives None for a handler set outside Python: Python's own is the closest
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, old if old is not None else default)
