"""Prompts tokenized off the thread that takes requests (an HTTP server's event loop, Triton's execute), on two lanes.

The tokenizer lets go of the GIL, and a 12 MB prompt took 7 s to tokenize: on the thread that takes requests, every
stream, /health and every other request waited for it. Each lane is one thread with a tokenizer of its own (one
tokenizer is never called from two threads at once); prompts of over BIG_PROMPT_CHARS characters take the second, so
one that takes seconds holds only the big prompts queued behind it, not every request's.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from dflash_trt.engine.prompt_encoder import PromptEncoder

# Prompts of more characters than this are tokenized on a lane of their own (SmolLM2's tokenizer: ~0.1 s at this size)
BIG_PROMPT_CHARS = 64_000


class PromptLanes:
    def __init__(self, encoder: PromptEncoder) -> None:
        self._encoder = encoder
        self._lanes = {False: (encoder, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tokenize"))}
        self._lock = threading.Lock()

    def lane(self, chars: int) -> tuple[PromptEncoder, ThreadPoolExecutor]:
        """The encoder and thread for a prompt of `chars` characters (0: the small prompts' lane)."""
        big = chars > BIG_PROMPT_CHARS
        with self._lock:
            if big not in self._lanes:  # its tokenizer copied at the first big prompt: most servers never see one
                self._lanes[big] = (self._encoder.copy(),
                                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tokenize-big"))
            return self._lanes[big]

    def shutdown(self) -> None:
        """Waits for the prompts already handed to a lane."""
        with self._lock:
            lanes = list(self._lanes.values())
        for _, thread in lanes:
            thread.shutdown(wait=True)
