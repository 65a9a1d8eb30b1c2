"""A chat answer's text split into what its message carries: reasoning (a reasoning parser's), content, and tool calls
(a tool-call parser's), fed delta by delta or whole, alike."""

from __future__ import annotations

from dflash_trt.server.reasoning import ReasoningParser, ReasoningSplitter
from dflash_trt.server.tool_calls import ForcedCallSplitter, FunctionCall, ToolCallSplitter


class ChatAnswerSplitter:
    def __init__(self, reasoning: ReasoningParser | None, calls: ToolCallSplitter | ForcedCallSplitter | None) -> None:
        self._reasoning = ReasoningSplitter(reasoning) if reasoning is not None else None
        self._calls = calls
        # hermes's calls follow the reasoning (a call the model only thinks of is no call); harmony's are a message
        # of their own, read out before the channels are
        self._calls_first = calls is not None and calls.before_reasoning

    @property
    def num_calls(self) -> int:
        """The calls the answer has made so far."""
        return self._calls.num_calls if self._calls is not None else 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[FunctionCall]]:
        """The reasoning, content and calls of text, the answer's next delta; `final` with its last."""
        parts = self.parts(text, final)
        return ("".join(v for k, v in parts if k == "reasoning"), "".join(v for k, v in parts if k == "content"),
                [v for k, v in parts if k == "call"])

    def parts(self, text: str, final: bool = False) -> list[tuple[str, str | FunctionCall]]:
        """feed's reasoning, content and calls in the order the answer has them, as (kind, text or call) pairs."""
        if self._calls_first:
            out = []
            for piece in self._calls.parts(text, final):
                out += [("call", piece)] if isinstance(piece, FunctionCall) else self._reasoned(piece, False)
            return out + (self._reasoned("", True) if final else [])
        out = self._reasoned(text, final)
        if self._calls is None:
            return out
        content = "".join(v for k, v in out if k == "content")
        return [p for p in out if p[0] == "reasoning"] + [
            ("call", piece) if isinstance(piece, FunctionCall) else ("content", piece)
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
