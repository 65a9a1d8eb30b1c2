"""A tool call as the server sends it on: whole (FunctionCall), or opened, its arguments in pieces as the model writes
them, then closed (OpenedCall, ArgumentsPiece, ClosedCall); and the JSON text its arguments are carried as."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class OpenedCall:
    """A call whose arguments come after it in pieces (ArgumentsPiece), then whole (ClosedCall)."""
    call: FunctionCall  # (its arguments: none yet)


@dataclass(frozen=True)
class ArgumentsPiece:
    text: str  # the next piece of the arguments of the call opened last


@dataclass(frozen=True)
class ClosedCall:
    call: FunctionCall  # the call opened last, its arguments whole
    finished: bool = False  # its JSON or end tag seen to close it; else as the answer ended (cut, or not)


CallPart = FunctionCall | OpenedCall | ArgumentsPiece | ClosedCall


class BlockReader(Protocol):
    """One call block's calls read as they come (a parser's whose calls stream), the block's text given whole so far
    each time (past its start tag)."""

    called: bool  # whether it has read the block as calls (opened one: sent, or left out past the calls' room)

    def read(self, block: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        """(the calls' parts read since the last time, the text after the block's end or None while it runs on or the
        answer ended in it); None where the block holds no call this reader streams: it has opened none, and the
        block is read whole at its end."""


def json_text(value: Any) -> str | None:
    """value as JSON text, or None where it has none (NaN, infinities); a lone surrogate's escape stays escaped, as
    the response's UTF-8 cannot carry the character."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(value, allow_nan=False)
    return text


class WrittenCall:
    """A call whose arguments are the answer's text as the model writes it, from `at` on: opened, sent piece by piece
    as far as the text so far allows, closed (where it is sent: a call past the calls' room is read and left out)."""

    def __init__(self, out: list[CallPart], name: str, at: int, sent: bool = True) -> None:
        self.call = FunctionCall(name, "") if sent else None
        self.at = self.sent_to = at  # where its arguments begin, and how far they are sent
        if self.call is not None:
            out.append(OpenedCall(self.call))

    def send(self, out: list[CallPart], text: str, upto: int) -> None:
        """Its arguments from where they were last sent up to `upto`."""
        if self.call is not None and upto > self.sent_to:
            out.append(ArgumentsPiece(text[self.sent_to:upto]))
        self.sent_to = max(self.sent_to, upto)

    def close(self, out: list[CallPart], text: str, upto: int, finished: bool = False) -> None:
        """Sends its arguments up to `upto` and closes it with them whole (finished: its JSON or end tag seen)."""
        self.send(out, text, upto)
        if self.call is not None:
            out.append(ClosedCall(FunctionCall(self.call.name, text[self.at:upto], self.call.id), finished))
