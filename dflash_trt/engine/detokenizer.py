"""The text of an answer as a client gets it, where stop strings cut it, and IncrementalDetokenizer: a growing list
of token ids turned into text deltas for streaming.

Text is held back while it ends in an incomplete UTF-8 character ("\ufffd") or in a prefix of a
stop string, so a streamed answer never shows characters that the final answer does not contain.
Example: stop=["\n\n"], tokens decode to "Hi\n": "Hi" is sent and "\n" held; the next token
"\n" completes the stop string, the request finishes, and the final text "Hi" adds nothing.

With min_tokens, as vLLM's: a stop string counts only where it ends past the text of the answer's first min_tokens
tokens (one that ends within it stays in the answer).
"""

from __future__ import annotations

from collections.abc import Sequence

STOP_HEAD = 8  # characters of a stop string searched for before a suffix of the answer is compared with all of it


def client_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of ids as a client gets it: without special tokens, and without the U+FFFD of a character whose bytes
    have not all come yet (streaming holds it back; an answer cut by max_tokens mid-character ends before it)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True).rstrip("\ufffd")


def tokens_writing(tokenizer, ids: Sequence[int], chars: int) -> int:
    """How many of ids it takes to write the first `chars` characters of their text: the fewest whose client_text is
    that long (all of them where it never is). A binary search: log2(len(ids)) decodes, not one a token."""
    if chars <= 0:
        return 0
    fewest, most = 1, len(ids)
    while fewest < most:
        middle = (fewest + most) // 2
        if len(client_text(tokenizer, ids[:middle])) >= chars:
            most = middle
        else:
            fewest = middle + 1
    return most


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, str | None]:
    """Where the answer's text ends and the stop string that ends it: the first that ends past character `after`
    (the first listed of those starting there); (-1, None) where none does."""
    found = [(cut, stop) for stop in stops if (cut := text.find(stop, max(after - len(stop) + 1, 0))) >= 0]
    return min(found, key=lambda x: x[0], default=(-1, None))


def stop_search_start(tokenizer, ids: Sequence[int], min_tokens: int) -> int:
    """The character past which stop strings count: the length of the text of the first min_tokens ids (all of
    ids' text while they are no more)."""
    return len(client_text(tokenizer, ids[:min_tokens])) if min_tokens > 0 else 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self._after: int | None = None if min_tokens and self.stop else 0  # stop_search_start, once it is known
        self.text = ""  # what has been sent
        # Decoding every id on every update costs O(n) per token (SmolLM2's tokenizer on this CPU: 35 us at 200
        # ids, 1.1 ms at 8,000; this way 10 us at 8,000): only a window of the last ids is decoded, and its growth
        # appended. The window starts at the previous update's ids, so that what a token's text depends on before
        # it (SentencePiece's leading space) decodes as in the whole text.
        self.decoded = ""  # the text of ids[:self._read]
        self._prefix = 0  # the window is ids[self._prefix:]; ids[self._prefix:self._read] decode to self._prefix_text
        self._read = 0
        self._prefix_text = ""

    def delta(self, token_ids: list[int] | tuple[int, ...], final_text: str | None = None) -> str:
        """The new text since the last call; pass the request's final text (cut at stops) when it finishes."""
        if final_text is not None:
            text = final_text
        else:
            text = self._decode(token_ids)
            text = text[: len(text) - self._stop_prefix_len(text, self._stops_after(token_ids, text))]
        return self._sent(text)

    def text_delta(self, text: str, final_text: str | None = None) -> str:
        """delta() for an engine that decodes its own tokens (TensorRT-LLM's outputs carry their text so far): held
        back alike, where that engine would cut a stop string from its final text only (min_tokens aside)."""
        if final_text is None:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        return self._sent(final_text if final_text is not None else text)

    def _sent(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        new = text[len(self.text):]
        self.text = text
        return new

    def _decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """The text of all of token_ids, less any incomplete character at its end."""
        window = self.tokenizer.decode(list(token_ids[self._prefix:]), skip_special_tokens=True)
        if window.endswith("\ufffd"):
            # A character split across ids decodes as "\ufffd" until its last byte arrives: the window only
            # moves on from complete text (so a run of invalid bytes widens it until text follows).
            return (self.decoded + window[len(self._prefix_text):]).rstrip("\ufffd")
        self.decoded += window[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(token_ids)
        self._prefix_text = self.tokenizer.decode(list(token_ids[self._prefix:self._read]), skip_special_tokens=True)
        return self.decoded

    def _stops_after(self, token_ids: Sequence[int], text: str) -> int:
        if self._after is not None:
            return self._after
        if len(token_ids) < self.min_tokens:
            return len(text)  # no stop string counts yet; one that may end past the first min_tokens is held
        self._after = stop_search_start(self.tokenizer, token_ids, self.min_tokens)
        return self._after

    def _stop_prefix_len(self, text: str, after: int = 0) -> int:
        """Length of the longest suffix of text that starts (or is) one of the stop strings (those that end past
        character `after`)."""
        best = 0
        cut, _ = find_stop(text, self.stop, after)
        if cut >= 0:
            best = len(text) - cut
        for stop in self.stop:
            for i in _suffix_starts(text, stop):  # longest first
                if len(text) - i <= best:
                    break
                if stop.startswith(text[i:]):
                    best = len(text) - i
                    break
        return best


def _suffix_starts(text: str, stop: str):
    """Where a suffix of text that begins stop may start: where its first STOP_HEAD characters occur (found by
    str.find), then the last STOP_HEAD - 1 positions (too short to hold them), left to right. Every suffix that began
    with its first character, compared whole, took 122 ms an update (on the event loop) for 256 stops of 4,000
    characters that began with a space."""
    head = stop[:STOP_HEAD]
    i = text.find(head, max(len(text) - len(stop) + 1, 0))
    while i >= 0:
        yield i
        i = text.find(head, i + 1)
    yield from range(max(len(text) - len(head) + 1, 0), len(text))
