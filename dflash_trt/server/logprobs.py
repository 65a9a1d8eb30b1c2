"""OpenAI's logprobs objects from the engine's TokenLogprobs: chat's `content` entries (token, logprob, bytes,
top_logprobs) and completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its own decoding, special tokens included (as vLLM's); its bytes are exact where the tokenizer
says which bytes a token holds (byte-level BPE pieces, SentencePiece's <0xNN> byte tokens), so the bytes of a
character split across tokens add up to it, where each piece's own text is only U+FFFD. Completions name such a piece
`bytes:\\xNN...`, as OpenAI's legacy API does: U+FFFD alone would make every piece the same top_logprobs key.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache

from dflash_trt.engine.logprobs import TokenLogprob
from dflash_trt.server import protocol as p

# JSON has no -inf (a token the model rules out): OpenAI clients read vLLM's floor as "impossible"
FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): bytes that are printable Latin-1 stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class TokenText:
    """Token ids -> their text and bytes, each decoded once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self.text = lru_cache(maxsize=None)(self._text)
        self.bytes = lru_cache(maxsize=None)(self._bytes)
        self.name = lru_cache(maxsize=None)(self._name)
        # what decode(skip_special_tokens=True) leaves out: the named special tokens and every added token marked
        # special (SmolLM2's <repo_name>, <filename>, ... are only the latter)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = frozenset([*getattr(tokenizer, "all_special_ids", ()),
                                      *(i for i, token in added.items() if getattr(token, "special", False))])

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _name(self, token_id: int) -> str:
        """Its text, or OpenAI's `bytes:\\xNN...` where the token holds only part of a character."""
        token = self.text(token_id)
        if "\ufffd" in token and token_id not in self.special_ids:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.bytes(token_id))
        return token

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and piece and all(c in self._byte_level for c in piece):
                return [self._byte_level[c] for c in piece]
            if m := _BYTE_TOKEN.fullmatch(piece):
                return [int(m.group(1), 16)]
        return list(self.text(token_id).encode("utf-8"))


def _lp(x: float) -> float:
    return max(x, FLOOR)


def chat_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...], text: TokenText) -> p.ChatLogprobs:
    def top(token_id: int, logprob: float) -> p.TopLogprob:
        return p.TopLogprob(token=text.text(token_id), logprob=_lp(logprob), bytes=text.bytes(token_id))

    return p.ChatLogprobs(content=[
        p.ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries])


class TextOffsets:
    """Where each token starts in a completion's text: the characters its bytes completed before it (a character
    split across tokens counts once, at the token that ends it; special tokens, which an answer's text leaves out,
    count none, but an echoed prompt's text holds those it was written with). One per choice, carried across a
    stream's chunks."""

    def __init__(self, text: "TokenText") -> None:
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def take(self, token_id: int, echoed: str | None = None) -> int:
        """The token's offset; moves past it. echoed: the text of an echoed prompt the token is one of, where a special
        token counts its characters if the text holds it there (a BOS the tokenizer added, not written, does not)."""
        at = self.offset
        if token_id not in self._text.special_ids:
            self.offset += len(self._decoder.decode(bytes(self._text.bytes(token_id))))
        elif echoed is not None and echoed.startswith(special := self._text.text(token_id), at):
            self.offset += len(special)
        return at


def completion_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...], text: TokenText,
                        offsets: TextOffsets | None = None, echoed: list[int] | None = None,
                        echoed_text: str = "") -> p.CompletionLogprobs:
    """offsets: the choice's TextOffsets (a stream's, carried across its chunks; a new one by default). echoed: the
    prompt's ids, whose first token comes first with no logprob (OpenAI's echo; `entries` then holds the prompt's
    others, then the output's), and echoed_text the prompt as the choice's text repeats it. Tokens are named as
    OpenAI's legacy API names them: their text, or `bytes:\\xNN...` where they hold part of a character (whose text
    alone would be U+FFFD, the same for every such token)."""
    offsets = offsets or TextOffsets(text)
    out = p.CompletionLogprobs()
    if echoed:
        out.tokens.append(text.name(echoed[0]))
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offsets.take(echoed[0], echoed_text))
    prompt_entries = len(echoed) - 1 if echoed else 0
    for i, e in enumerate(entries):
        token = text.name(e.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_lp(e.logprob))
        # OpenAI's legacy shape: the top tokens, and the chosen one even where it is not among them
        out.top_logprobs.append({**{text.name(t): _lp(lp) for t, lp in e.top}, token: _lp(e.logprob)})
        out.text_offset.append(offsets.take(e.token_id, echoed_text if i < prompt_entries else None))
    return out
