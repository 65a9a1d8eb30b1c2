"""A chat answer's text split into what its message carries: reasoning (a reasoning parser's), content, and tool calls
(a tool-call parser's), fed delta by delta or whole, alike.

Its ordered parts are (kind, value) pairs: ("reasoning", text), ("content", text), ("call", FunctionCall) for a call
sent whole, and, for a call whose arguments are sent as they come (a call tool_choice forces; a gpt_oss, hermes,
llama3_json or qwen3_coder call), ("call_opened", FunctionCall without arguments), ("arguments", text) pieces, then
("call_closed", FunctionCall whole) as the answer ends (cut by max_tokens, or not), or ("call_finished", FunctionCall
whole) where its JSON or end tag closed it.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.engine.detokenizer import tokens_writing
from dflash_trt.server.reasoning import ReasoningParser, ReasoningSplitter
from dflash_trt.server.call_parts import ArgumentsPiece, ClosedCall, FunctionCall, OpenedCall
from dflash_trt.server.tool_calls import ForcedCallSplitter, ToolCallSplitter

# the calls' pieces as parts: (kind, what the part carries)
_KINDS = {FunctionCall: ("call", lambda c: c), OpenedCall: ("call_opened", lambda p: p.call),
          ArgumentsPiece: ("arguments", lambda p: p.text)}
WHOLE_CALLS = ("call", "call_closed", "call_finished")  # the parts that carry a call whole


def _part(piece: Any, text_kind: str) -> tuple[str, Any]:
    if isinstance(piece, str):
        return text_kind, piece
    if isinstance(piece, ClosedCall):  # its JSON seen to close, or closed as the answer ended (cut, or not)
        return "call_finished" if piece.finished else "call_closed", piece.call
    kind, value = _KINDS[type(piece)]
    return kind, value(piece)


class ChatAnswerSplitter:
    def __init__(self, reasoning: ReasoningParser | None, calls: ToolCallSplitter | ForcedCallSplitter | None) -> None:
        self._reasoning = ReasoningSplitter(reasoning) if reasoning is not None else None
        self._calls = calls
        # hermes's calls follow the reasoning (a call the model only thinks of is no call); harmony's are a message
        # of their own, read out before the channels are
        self._calls_first = calls is not None and calls.before_reasoning
        self._last_call: str | None = None  # the kind of the last whole-call part given out

    @property
    def num_calls(self) -> int:
        """The calls the answer has made so far."""
        return self._calls.num_calls if self._calls is not None else 0

    @property
    def reasoning_open(self) -> bool:
        """Whether the answer fed so far ends in its reasoning, having made no call (every token of it is then the
        reasoning's, those that write no whole character too: a character's first bytes, special tokens)."""
        return self._reasoning is not None and self._reasoning.in_reasoning and self.num_calls == 0

    def reasoning_tokens(self, tokenizer, token_ids: list[int], ended_by_token: bool) -> int:
        """The answer's tokens of reasoning, its tags included (the answer fed whole): all of them where it ends in
        its reasoning, but the eos or stop token that ended it (ended_by_token); else the fewest that write the
        reasoning's characters."""
        if self.reasoning_open:
            return len(token_ids) - ended_by_token
        return tokens_writing(tokenizer, token_ids, self.reasoning_chars)

    @property
    def reasoning_chars(self) -> int:
        """How many leading characters of the answer (of its text past its calls, where they are read first) are its
        reasoning and its tags: ReasoningSplitter.reasoning_chars."""
        return self._reasoning.reasoning_chars if self._reasoning is not None else 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[FunctionCall]]:
        """The reasoning, content and calls (those whole in it) of text, the answer's next delta; `final` with its
        last."""
        parts = self.parts(text, final)
        return ("".join(v for k, v in parts if k == "reasoning"), "".join(v for k, v in parts if k == "content"),
                [v for k, v in parts if k in WHOLE_CALLS])

    @property
    def call_cut(self) -> bool:
        """Whether the answer's last call closed only as the answer ended (its JSON or end tag unseen: cut, where a
        stop string ended the answer)."""
        return self._last_call == "call_closed"

    def parts(self, text: str, final: bool = False) -> list[tuple[str, str | FunctionCall]]:
        """feed's reasoning, content and calls in the order the answer has them, as (kind, text or call) pairs."""
        out = self._parts(text, final)
        self._last_call = next((k for k, _ in reversed(out) if k in WHOLE_CALLS), self._last_call)
        return out

    def _parts(self, text: str, final: bool) -> list[tuple[str, str | FunctionCall]]:
        if self._calls_first:
            out = []
            for piece in self._calls.parts(text, final):
                out += self._reasoned(piece, False) if isinstance(piece, str) else [_part(piece, "content")]
            return out + (self._reasoned("", True) if final else [])
        out = self._reasoned(text, final)
        if self._calls is None:
            return out
        content = "".join(v for k, v in out if k == "content")
        return [p for p in out if p[0] == "reasoning"] + [_part(piece, "content")
                                                          for piece in self._calls.parts(content, final)]

    def _reasoned(self, text: str, final: bool) -> list[tuple[str, str]]:
        thought, content = self._reasoning.feed(text, final) if self._reasoning is not None else ("", text)
        return [(kind, piece) for kind, piece in (("reasoning", thought), ("content", content)) if piece]

    def split(self, text: str) -> tuple[str | None, str | None, list[FunctionCall]]:
        """A whole answer's (reasoning, content, calls): reasoning None where there is none; content None where the
        answer reasoned or made calls and said nothing else, its text as it is otherwise (as without parsers)."""
        thought, content, calls = self.feed(text, final=True)
        reasoned = self._reasoning is not None and self._reasoning.thought
        return thought or None, (content or None) if reasoned or calls else content, calls
