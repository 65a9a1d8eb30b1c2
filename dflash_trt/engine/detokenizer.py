"""IncrementalDetokenizer: turns a growing list of token ids into text deltas for streaming.

Text is held back while it ends in an incomplete UTF-8 character ("\ufffd") or in a prefix of a
stop string, so a streamed answer never shows characters that the final answer does not contain.
Example: stop=["\n\n"], tokens decode to "Hi\n": "Hi" is sent and "\n" held; the next token
"\n" completes the stop string, the request finishes, and the final text "Hi" adds nothing.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # what has been sent

    def delta(self, token_ids: list[int] | tuple[int, ...], final_text: str | None = None) -> str:
        """The new text since the last call; pass the request's final text (cut at stops) when it finishes."""
        if final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        if len(text) <= len(self.text):
            return ""
        new = text[len(self.text):]
        self.text = text
        return new

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that starts (or is) one of the stop strings."""
        best = 0
        for stop in self.stop:
            cut = text.find(stop)
            if cut >= 0:
                best = max(best, len(text) - cut)
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
