"""Qwen3-Coder's tool calls (vLLM's qwen3_coder and qwen3_xml parsers read them too): a `<tool_call>` block of
`<function=NAME>` elements, each of `<parameter=KEY>` elements whose text is the value, the template putting each on
lines of its own:

    <tool_call>
    <function=write_file>
    <parameter=path>
    /tmp/a.py
    </parameter>
    </function>
    </tool_call>

A value is read as the tool's schema types it: a string stays a string (the schema names no type for it, or no such
parameter), numbers, booleans, objects and arrays as JSON. The calls' arguments are a JSON object of those values.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dflash_trt.server.call_parts import ArgumentsPiece, CallPart, ClosedCall, FunctionCall, OpenedCall, json_text
from dflash_trt.server.reasoning import first_tag, held_back

CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)
FUNCTION_OPEN, FUNCTION_END = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_END = "<parameter=", "</parameter>"
_NAMED = re.compile(r"<(?:function|parameter)=([^>\n]+)>")  # an opening tag and its name, whole
_NAMING = re.compile(r"<(?:function|parameter)=[^>\n]*")  # one whose name may go on


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema names; a string's where it names none (or is no schema object)."""
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    kinds = kind if isinstance(kind, list) else [kind]
    return {k for k in kinds if isinstance(k, str)} or {"string"}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema types it: a string where the schema allows one (or says nothing of the
    parameter), else its JSON value (the text itself where it is none)."""
    types = _types(schema)
    if "string" in types and not (value == "null" and "null" in types):
        return value
    try:
        return json.loads(value)
    except ValueError:
        if "boolean" in types and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value


def _properties(schemas: dict[str, Any], function: str) -> dict[str, Any]:
    schema = schemas.get(function)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def coder_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    """A whole block's calls (its text past `<tool_call>`, before `</tool_call>`), or None where it is none."""
    calls, at = [], 0
    while at < len(body):  # one function a call, or several in one block
        function = _FUNCTION.match(body, at)
        if function is None:
            return None
        name, inner, at = function.group(1).strip(), function.group(2), function.end()
        if not name:
            return None
        properties = _properties(tools, name)
        arguments, inside = {}, 0
        while inside < len(inner):
            parameter = _PARAMETER.match(inner, inside)
            if parameter is None:
                if inner[inside:].strip():
                    return None
                break
            key, value = parameter.group(1).strip(), parameter.group(2)
            if not key:
                return None
            # the template writes each value on lines of its own: one newline either side is layout, not value
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, properties.get(key))
            inside = parameter.end()
        text = json_text(arguments)
        if text is None:
            return None
        calls.append(FunctionCall(name, text))
    return calls or None


_SPACE = re.compile(r"\s*")
# a function's or block's end on a line of its own, as the template writes them: where a value without its
# </parameter> ends (in one, it is the value's text)
_ENDS_WITHOUT_PARAMETER_END = ("\n" + FUNCTION_END, "\n" + CALL_END)
# what may end a value (the newline before it is the template's layout)
_CLOSES_VALUE = ("\n" + PARAMETER_END, PARAMETER_END, *_ENDS_WITHOUT_PARAMETER_END)


def _waits(rest: str, tags: tuple[str, ...]) -> bool:
    """Whether rest, the block's text from here on so far, may yet begin one of tags: a beginning of one, or one of
    them an opening tag whose name is being written."""
    return any(tag.startswith(rest) for tag in tags) or (rest.startswith(tags) and _NAMING.fullmatch(rest) is not None)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(text: str) -> str:
    """text as it stands in a JSON string (a piece of one), each character escaped alike whatever piece it comes in:
    a lone surrogate as its escape (UTF-8 cannot carry it), the rest as JSON writes it."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(text, ensure_ascii=False)[1:-1])


def _end_before(block: str, at: int, start: int) -> int:
    """at, or the newline before it (the template's layout) where it is past start."""
    return at - 1 if at > start and block[at - 1] == "\n" else at


class CoderCallReader:
    """One block's calls as they come. Each opens where its function's first parameter (or its end) does, its
    arguments are sent as a JSON object piece by piece, a string's value character by character as the model writes
    it (other types whole at their `</parameter>`), and it closes with `</function>` (or `</tool_call>` where that
    comes first). A value ends at its `</parameter>`; one that holds `</function>` or `</tool_call>` on a line of its
    own is held from there until its `</parameter>` comes, and where the answer ends without one, it ends there. A
    call the answer's end cuts is sent as far as it came, a value as written. Once the block's first function has
    opened, text that is no element (nor whitespace) is left out, as are the calls past the room (the block read
    on); a block that opens otherwise, or ends before its first parameter, is none (read whole: the model's text)."""

    def __init__(self, schemas: dict[str, Any], room: int | None) -> None:
        self._schemas, self._room = schemas, room  # room: the calls the block may still make (None: any)
        self.called = False  # whether a function has opened (its call sent, or past the room)
        self._at = 0  # how far the block is read
        self._state = "between"  # between functions, in one ("function"), at a value's start ("value_start"), in it
        self._name = ""  # the function read now
        self._keeps = True  # whether its call is sent (within the room)
        self._opened = False  # whether its call has opened
        self._call: FunctionCall | None = None  # that call, where sent
        self._arguments: list[str] = []  # its arguments sent so far
        self._made = 0  # calls sent
        self._params = 0  # the function's parameters so far
        self._schema: Any = None  # the parameter's read now
        self._streams = False  # whether its value is sent as it comes (a string)
        self._value_at = self._sent = self._scanned = 0  # where its value begins, is sent to, and is searched from
        self._stop: int | None = None  # where the value first holds </function> or </tool_call> on a line

    def read(self, block: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        out: list[CallPart] = []
        while True:
            if self._state == "between":
                at = _SPACE.match(block, self._at).end()
                named = _NAMED.match(block, at)
                if named and block.startswith(FUNCTION_OPEN, at) and named[1].strip():
                    self._name, self._keeps = named[1].strip(), self._room is None or self._made < self._room
                    self._at, self._state, self._opened, self._params = named.end(), "function", False, 0
                    continue
                if not final and _waits(block[at:], (FUNCTION_OPEN, CALL_END)):
                    return out, None
                if not self.called:
                    return None
                if block.startswith(CALL_END, at):
                    return out, block[at + len(CALL_END):]
                if not self._skip(block, at, (FUNCTION_OPEN, CALL_END), final):
                    return out, None
            elif self._state == "function":
                at = _SPACE.match(block, self._at).end()
                named = _NAMED.match(block, at)
                if named and block.startswith(PARAMETER_OPEN, at) and named[1].strip():
                    self._open(out)
                    key = named[1].strip()
                    self._send(out, (", " if self._params else "") + json_text(key) + ": ")
                    self._schema = _properties(self._schemas, self._name).get(key)
                    self._at, self._state, self._params = named.end(), "value_start", self._params + 1
                    continue
                if block.startswith(FUNCTION_END, at):
                    self._open(out)  # (a function of no parameters: {})
                    self._close(out, finished=True)
                    self._at, self._state = at + len(FUNCTION_END), "between"
                    continue
                if block.startswith(CALL_END, at) and self.called:  # the block ends the function
                    self._close(out, finished=True)
                    self._at, self._state = at, "between"
                    continue
                if not final and _waits(block[at:], (PARAMETER_OPEN, FUNCTION_END, CALL_END)):
                    return out, None
                if not self.called:
                    return None  # text before the block's first parameter: no call
                if not self._skip(block, at, (PARAMETER_OPEN, FUNCTION_END, CALL_END), final):
                    if final:
                        self._close(out, finished=False)
                    return out, None
            elif self._state == "value_start":
                if self._at == len(block):
                    if final:
                        self._close(out, finished=False)
                    return out, None
                self._at += block.startswith("\n", self._at)  # (the template's layout)
                types = _types(self._schema)
                self._streams = "string" in types and "null" not in types  # (text "null" may be null)
                self._value_at = self._sent = self._scanned = self._at
                self._stop, self._state = None, "value"
                if self._streams:
                    self._send(out, '"')
            else:
                end = block.find(PARAMETER_END, self._scanned)
                if end < 0 and self._stop is None and (found := first_tag(block[max(self._value_at,
                                                                                    self._scanned - 1):],
                                                                          _ENDS_WITHOUT_PARAMETER_END)):
                    self._stop = max(self._value_at, self._scanned - 1) + found[0] + 1  # (at its "<")
                if end < 0:
                    self._scanned = max(self._scanned, len(block) - len(PARAMETER_END) + 1)
                    if final and self._stop is not None:
                        end = self._stop  # (ended by its function's or block's end: the state after reads it)
                    elif final:  # cut in the value: as far as it came, as written
                        self._send(out, _escaped(block[self._sent:]) if self._streams else block[self._value_at:])
                        self._close(out, finished=False)
                        return out, None
                    else:
                        if self._streams:
                            upto = len(block) - held_back(block[self._sent:], _CLOSES_VALUE, False)
                            if self._stop is not None:
                                upto = min(upto, _end_before(block, self._stop, self._value_at))
                            self._send(out, _escaped(block[self._sent:upto]))
                            self._sent = max(self._sent, upto)
                        return out, None
                upto = _end_before(block, end, self._value_at)
                if self._streams:
                    self._send(out, _escaped(block[self._sent:upto]) + '"')
                else:
                    value = block[self._value_at:upto]
                    self._send(out, json_text(_typed(value, self._schema)) or value)  # (NaN: as written)
                self._at = end + (len(PARAMETER_END) if block.startswith(PARAMETER_END, end) else 0)
                self._state = "function"

    def _skip(self, block: str, at: int, tags: tuple[str, ...], final: bool) -> bool:
        """Leaves out the text at `at`, which is no element, up to the next of tags; False where none has come."""
        found = first_tag(block[at + 1:], tags)
        if found is None:
            self._at = len(block) - held_back(block[at + 1:], tags, final)
            return False
        self._at = at + 1 + found[0]
        return True

    def _open(self, out: list[CallPart]) -> None:
        if self._opened:
            return
        self._opened = self.called = True
        if self._keeps:
            self._call, self._arguments = FunctionCall(self._name, ""), []
            self._made += 1
            out.append(OpenedCall(self._call))
            self._send(out, "{")

    def _send(self, out: list[CallPart], text: str) -> None:
        if self._call is not None and text:
            out.append(ArgumentsPiece(text))
            self._arguments.append(text)

    def _close(self, out: list[CallPart], finished: bool) -> None:
        if self._call is not None:
            if finished:
                self._send(out, "}")
            out.append(ClosedCall(FunctionCall(self._call.name, "".join(self._arguments), self._call.id), finished))
        self._call = None
