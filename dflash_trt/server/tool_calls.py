"""A chat answer's tool calls read out of its text, as `--tool-call-parser` does in vLLM (`--tool_parser` in
trtllm-serve): each call the model writes becomes an entry of the message's `tool_calls` (OpenAI's shape, arguments
as a JSON string), the text around them its `content`, and the choice finishes with "tool_calls".

- hermes (Qwen2.5, Qwen3, Hermes; TensorRT-LLM's `qwen3`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  ("parameters" for "arguments" too), or a list of such objects in one block; a call that names its function first
  opens once its arguments' object begins, its arguments sent as they come, as written;
- qwen3_coder (Qwen3-Coder; vLLM's `qwen3_xml` too): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`, each value read as the tool's schema types it (a string stays a string; numbers, booleans,
  objects and arrays as JSON; server/coder_calls.py); a call opens at its first parameter, its arguments sent as a
  JSON object piece by piece, a string's as the model writes it;
- llama3_json (Llama 3.1, 3.2 and 3.3 with JSON tool calling): an answer that opens with a call, `{"name": ...,
  "parameters": {...}}` ("arguments" for "parameters" too; one of them: JSON with a "name" alone is an answer),
  several separated by `;`, after `<|python_tag|>` where the text holds it. A call that names its function first (as
  Llama's template writes it) opens where its parameters' object begins, its arguments sent as they come; once one
  has, the text after the calls that is no call is content. An answer that opens otherwise, and does not parse
  whole as calls, is content (vLLM's streaming reading; its whole-answer reader of late takes calls amid text);
- gpt_oss: harmony's commentary channel addressed to a function, as the answer's text holds it without harmony's
  special tokens (as the gpt_oss reasoning parser reads its channels): `<|start|>assistant<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` is "assistantcommentary to=functions.NAME json{...}",
  the answer's last message (`<|call|>` ends gpt-oss's turn). Read before the reasoning split, which then takes the
  text before it. The call opens where its arguments begin, which are sent as they come (as written, to the answer's
  end: cut by max_tokens, as far as they came). The default for a gpt-oss target.

Like the reasoning split, it reads the text as the client gets it, delta by delta or whole, alike: text that may begin a
call is held back until the next delta says whether it does, and a call is sent whole once it closes (or the answer
ends; or in pieces as they come, where the parser reads them so: a cut call is that call, its arguments as far as
they came). A block that does not parse as a call (or opens none) stays in the content as written, so nothing the
model said is lost; whitespace next to a call is dropped, the rest of the text outside calls is the content (None
where there is none).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from dflash_trt.server.call_parts import (ArgumentsPiece, BlockReader, CallPart, ClosedCall, FunctionCall, OpenedCall,
                                          WrittenCall, json_text)
from dflash_trt.server.coder_calls import CoderCallReader, coder_calls
from dflash_trt.server.reasoning import first_tag, held_back, parser_named, template_text

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# harmony's call as its text holds it: after an analysis message ("assistant" is the next message's header), or
# opening the answer; the recipient in the channel's header, as gpt-oss writes it, or in the role's, as gpt-oss's
# template writes past calls (at the answer's start the prompt holds the role: " to=functions.", read only there)
HARMONY_STARTS = ("assistantcommentary to=functions.", "commentary to=functions.", "assistant to=functions.")
HARMONY_OPENING = (" to=functions.",)


def _arguments(value: Any) -> str | None:
    """A call's arguments as a JSON object's text, or None where they are no object."""
    if value is None:  # said to be none: no arguments
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json_text(value) if isinstance(value, dict) else None


def _named_call(call: Any) -> FunctionCall | None:
    """{"name": ..., "arguments": {...}} ("parameters" for "arguments" too) as a call; None where it is none."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = _arguments(call.get("arguments", call.get("parameters")))
    return FunctionCall(call["name"], arguments) if arguments is not None else None


def _hermes_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    calls = [_named_call(call) for call in (parsed if isinstance(parsed, list) else [parsed])]
    return calls if calls and None not in calls else None


PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before a call (special: most answers' text leaves it out)
_CALLS_APART = re.compile(r"\s*;\s*")


def _llama_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    body, decoder, calls, at = body.removeprefix(PYTHON_TAG).lstrip(), json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        if not ({"parameters", "arguments"} & set(value if isinstance(value, dict) else ())):
            return None
        if (call := _named_call(value)) is None:
            return None
        calls.append(call)
        if at == len(body):
            return calls
        if (apart := _CALLS_APART.match(body, at)) is None or apart.end() == len(body):
            return None
        at = apart.end()


# what may follow a harmony call's function name before its arguments: the role-header form's channel, and the
# <|constrain|>json its text leaves as "json"
_HARMONY_SUFFIX = r"\s*(?:commentary)?\s*(?:json)?\s*"


def _harmony_name(head: str, tools: dict[str, dict]) -> str | None:
    """The function a harmony call's header (its text up to the arguments) names, or None: a function named in the
    request as named ("fetch_json", not "fetch_" and its constraint); others as the shortest name the rest can
    follow."""
    head = head.strip()
    known = [n for n in tools if head.startswith(n) and re.fullmatch(_HARMONY_SUFFIX, head[len(n):])]
    named = re.fullmatch(r"([\w.\-]+?)" + _HARMONY_SUFFIX, head)  # a name as functions are named
    return max(known, key=len) if known else named.group(1) if named else None


def _harmony_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    brace = body.find("{")
    if brace < 0:
        return None
    name = _harmony_name(body[:brace], tools)
    try:
        arguments, end = json.JSONDecoder().raw_decode(body, brace)
    except ValueError:
        return None
    if not name or not isinstance(arguments, dict) or body[end:].strip():
        return None
    text = json_text(arguments)
    return [FunctionCall(name, text)] if text is not None else None


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    trtllm_name: str | None  # trtllm-serve's --tool_parser for the same format (None: it reads it unasked)
    # (block's text, {tool name: its parameters' schema}) -> the calls, or None where it is no call
    parse: Callable[[str, dict[str, Any]], list[FunctionCall] | None]
    starts: tuple[str, ...] = (CALL_START,)  # what opens a call
    end: str | None = CALL_END  # what closes it; None: the answer's end
    opening: tuple[str, ...] = ()  # what opens a call at the answer's start only
    before_reasoning: bool = False  # read before the reasoning split (its calls are outside the reasoning's tags)
    keeps_opening: bool = False  # the opening is parsed with the call (Llama's "{" is its JSON's; its python tag)
    in_trtllm: bool = True  # whether trtllm-serve reads the format at all
    # ({tool name: its parameters' schema}, the calls it may still make or None) -> a reader of one call block whose
    # calls it sends as they come (opened, their arguments in pieces, closed), where it streams them
    reader: Callable[[dict[str, Any], int | None], BlockReader] | None = None


class _JsonNesting:
    """How deep a JSON text nests, read a character at a time (strings, and the escapes in them, skipped)."""

    def __init__(self) -> None:
        self.depth, self._in_string, self._escaped = 0, False, False

    def read(self, c: str) -> int:
        """+1 where c opens an object or array, -1 where it closes one (none below depth 0: a list's own "]" read
        from inside it), else 0."""
        if self._in_string:
            self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self.depth += 1
            return 1
        elif c in "}]" and self.depth:
            self.depth -= 1
            return -1
        return 0


# a call's JSON up to its arguments' object, its name first (as Qwen's and Llama's templates write it); the regex
# module's, whose partial matches say whether text so far may yet be one
_NAME_FIRST = regex.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*'
                            r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _head(block: str, at: int, final: bool) -> tuple[int, str] | bool | None:
    """Where the arguments of a call whose JSON begins at `at` (past whitespace) begin, and the function it names;
    True where the text so far may yet be such a head (the answer goes on); None where it is none (its name no
    JSON string, or empty)."""
    head = _NAME_FIRST.match(block, at, partial=not final)
    if head is None or head.partial:
        return head is not None or None
    try:
        name = json.loads(head["name"])
    except ValueError:
        return None
    return (head.end(), name) if name else None


class _HermesCallReader:
    """A hermes block whose JSON names its function before its arguments' object (as Qwen writes it): the call opens
    where that object begins, its arguments are sent as written, piece by piece, and it closes with the end tag (the
    answer's end: cut, as far as they came); past the room it is read on and left out. A block that begins otherwise
    (a list, its name last) is read whole."""

    def __init__(self, schemas: dict[str, Any], room: int | None) -> None:
        self._keeps = room != 0
        self._call: WrittenCall | None = None
        # where its arguments end, how far they are read, and how deep they nest there
        self._end, self._scanned = None, 0
        self._nesting = _JsonNesting()

    @property
    def called(self) -> bool:
        return self._call is not None

    def read(self, block: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        out: list[CallPart] = []
        if self._call is None:
            head = _head(block, 0, final)
            if head is True:
                return out, None  # (what it is, the next delta says)
            if head is None:
                return None
            self._scanned, name = head
            self._call = WrittenCall(out, name, self._scanned, self._keeps)
        for at in range(self._scanned, len(block) if self._end is None else 0):
            if self._nesting.read(block[at]) < 0 and self._nesting.depth == 0:
                self._end = at + 1
                break
        self._scanned = len(block) if self._end is None else self._end
        upto = self._end if self._end is not None else len(block)
        closing = block.find(CALL_END, self._end) if self._end is not None else -1
        if closing < 0 and not final:
            self._call.send(out, block, upto)
            return out, None
        self._call.close(out, block, upto, finished=closing >= 0)
        return out, (block[closing + len(CALL_END):] if closing >= 0 else None)


class _HarmonyCallReader:
    """harmony's call, the answer's last message: it opens where its header names a function and its arguments begin,
    which are sent as written, piece by piece, and it closes with the answer's end (past the room, read on and left
    out). One that has not opened by then is read whole (a call, or the model's text)."""

    def __init__(self, schemas: dict[str, Any], room: int | None) -> None:
        self._schemas, self._keeps = schemas, room != 0
        self._call: WrittenCall | None = None

    @property
    def called(self) -> bool:
        return self._call is not None

    def read(self, block: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        out: list[CallPart] = []
        if self._call is None:
            brace = block.find("{")
            name = _harmony_name(block[:brace], self._schemas) if brace >= 0 else None
            if name is None:
                return None if final else (out, None)
            self._call = WrittenCall(out, name, brace, self._keeps)
        if final:
            self._call.close(out, block, len(block))
        else:
            self._call.send(out, block, len(block))
        return out, None


class _LlamaCallReader:
    """Llama 3's answer of calls, `{"name": ..., "parameters": {...}}` apart by ";" (after <|python_tag|> where the
    text holds it). Each call whose JSON names its function before its parameters' object (as Llama's template writes
    it) opens where that object begins, its arguments are sent as written, piece by piece, and it closes with its JSON
    (the answer's end: cut, as far as they came); past the room, read on and left out. Once the first has opened,
    what follows the calls that is no call is content (";" at the answer's end, nothing); an answer that opens
    otherwise is read whole (all calls, or none)."""

    def __init__(self, schemas: dict[str, Any], room: int | None) -> None:
        self._room = room
        self.called = False  # whether a call has opened (sent, or past the room)
        self._made = 0  # calls sent
        self._next = 0  # where the text after the last call begins
        self._call: WrittenCall | None = None  # the call read now
        # where its arguments end; how far its JSON is read, and how deep it nests there
        self._end, self._scanned = None, 0
        self._nesting = _JsonNesting()

    def read(self, block: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        out: list[CallPart] = []
        while True:
            if self._call is None:
                if not self.called:
                    start = len(PYTHON_TAG) if block.startswith(PYTHON_TAG) else 0
                    head = _head(block, start, final)
                    if head is True:
                        return out, None
                    if head is None:
                        return None
                else:
                    apart = _CALLS_APART.match(block, self._next)
                    start = apart.end() if apart else 0
                    head = _head(block, start, final) if apart else None
                    if head is True or (head is None and not final and not block[self._next:].strip()):
                        return out, None  # (what comes, the next delta says)
                    if head is None:
                        rest = block[self._next:]
                        return out, ("" if re.fullmatch(r"\s*;\s*", rest) else rest)
                self._open(out, block.index("{", start), *head)
            for at in range(self._scanned, len(block)):
                moved, depth = self._nesting.read(block[at]), self._nesting.depth
                if moved < 0 and depth == 1 and self._end is None:
                    self._end = at + 1  # (its arguments' object: its JSON's only one at depth 2 past its head)
                if moved < 0 and depth == 0:
                    self._next = at + 1
                    break
            closed = self._next > self._call.at
            self._scanned = self._next if closed else len(block)
            upto = self._end if self._end is not None else len(block)
            if closed or final:
                self._call.close(out, block, upto, finished=closed)
                self._call = None
                if closed:
                    continue
            else:
                self._call.send(out, block, upto)
            return out, None

    def _open(self, out: list[CallPart], opens: int, at: int, name: str) -> None:
        """The call whose JSON opens at `opens`, its arguments at `at`."""
        keeps = self._room is None or self._made < self._room
        self._call = WrittenCall(out, name, at, keeps)
        self._made += keeps
        self.called, self._nesting, self._scanned, self._end = True, _JsonNesting(), opens, None


PARSERS = {p.name: p for p in (ToolCallParser("hermes", "qwen3", _hermes_calls, reader=_HermesCallReader),
                               ToolCallParser("qwen3_coder", "qwen3_coder", coder_calls, reader=CoderCallReader),
                               ToolCallParser("llama3_json", None, _llama_calls, (), None, (PYTHON_TAG, "{"),
                                              keeps_opening=True, in_trtllm=False, reader=_LlamaCallReader),
                               # trtllm-serve reads a gpt-oss target's harmony itself
                               ToolCallParser("gpt_oss", None, _harmony_calls, HARMONY_STARTS, None,
                                              HARMONY_OPENING, True, reader=_HarmonyCallReader))}
ALIASES = {"qwen3": "hermes", "qwen3_xml": "qwen3_coder", "openai": "gpt_oss"}  # TensorRT-LLM's and vLLM's names


def tool_call_parser(name: str | None) -> ToolCallParser | None:
    """The parser named (vLLM's or TensorRT-LLM's name); None for None or "none"."""
    return parser_named("tool-call", PARSERS, ALIASES, name)


def default_tool_parser(target, chat_template: str | dict[str, str] | None) -> ToolCallParser | None:
    """The parser a target's calls take unless the server is told otherwise: gpt-oss's (its chat format is
    harmony's); else the form its chat template shows the model calls in: `<function=NAME>` with `<parameter=...>`
    inside `<tool_call>` (qwen3_coder: Qwen3.5's, Qwen3.6's, Qwen3-Coder's, Nemotron 3's), JSON inside `<tool_call>`
    (hermes: Qwen2.5's, Qwen3's); None for a template that shows neither (no tools, or a form the server would
    misread: Llama's bare JSON is read only when asked for)."""
    from dflash_trt.models.gpt_oss import GptOssForCausalLM

    if isinstance(target, GptOssForCausalLM):
        return PARSERS["gpt_oss"]
    text = template_text(chat_template)
    if "<tool_call>" not in text:
        return None
    return PARSERS["qwen3_coder"] if "<function=" in text and "<parameter=" in text else PARSERS["hermes"]


class _Joint:
    """The content's text with the whitespace between it and calls left out where the content begins or ends; between
    two pieces of content it stays as written (a call's text taken out of it). Trailing whitespace is held until text
    follows it (sent with it) or the answer ends after a call (dropped)."""

    def __init__(self) -> None:
        self._pending = ""
        self._said = False  # whether content (not only whitespace) has been said
        self._called = False  # whether a call came since the content last said

    def say(self, text: str) -> str:
        said = text.rstrip()
        if not said:
            self._pending += text
            return ""
        if self._said or not self._called:
            said = self._pending + said
        else:  # the content's first text, after a call
            said = said.lstrip()
        self._pending, self._said, self._called = text[len(text.rstrip()):], True, False
        return said

    def call(self) -> None:
        self._called = True

    def end(self) -> str:
        said, self._pending = ("" if self._called else self._pending), ""
        return said


def _joined(parts: list[CallPart]) -> list[CallPart]:
    """parts with each run of argument pieces one piece (a reader's pieces of one read: one delta of the answer)."""
    out: list[CallPart] = []
    for part in parts:
        if isinstance(part, ArgumentsPiece) and out and isinstance(out[-1], ArgumentsPiece):
            out[-1] = ArgumentsPiece(out[-1].text + part.text)
        else:
            out.append(part)
    return out


class ToolCallSplitter:
    """One answer's text, fed in order, sent on as (content delta, calls complete in it)."""

    def __init__(self, parser: ToolCallParser, tools: list[dict] | None = None, max_calls: int | None = None) -> None:
        """tools: the request's, as chat templates take them (qwen3_coder reads their parameters' types). max_calls:
        the calls kept, the first (OpenAI's parallel_tool_calls false: 1; the Responses API's max_tool_calls)."""
        self.parser = parser
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        self._max_calls = max_calls
        self._joint = _Joint()
        self._held = ""
        self._opened: str | None = None  # the tag that opened the call whose text is held, if any
        self._at_start = True  # nothing read yet
        self._block: BlockReader | None = None  # the parser's reader of the block read now, where it streams
        self.num_calls = 0  # calls sent so far

    @property
    def before_reasoning(self) -> bool:
        return self.parser.before_reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, list[FunctionCall]]:
        """The content and the calls of text, the answer's next delta; `final` with its last (nothing held back)."""
        parts = self.parts(text, final)
        return "".join(p for p in parts if isinstance(p, str)), [p.call if isinstance(p, ClosedCall) else p
                                                                 for p in parts if isinstance(p, (FunctionCall,
                                                                                                  ClosedCall))]

    def parts(self, text: str, final: bool = False) -> list[str | FunctionCall | OpenedCall | ArgumentsPiece |
                                                              ClosedCall]:
        """feed's content and calls in the order the answer has them: text (never empty), calls whole, and (a
        parser's that streams) a call opened, the pieces of its arguments, and it closed."""
        text, self._held = self._held + text, ""
        out: list[str | FunctionCall | OpenedCall | ArgumentsPiece | ClosedCall] = []
        starts, end = self.parser.starts, self.parser.end
        if self._at_start and text and self.parser.opening:
            if not final and any(tag.startswith(text) and tag != text for tag in self.parser.opening):
                self._held = text  # may yet open a call
                return []
            self._at_start = False
            if opened := next((tag for tag in self.parser.opening if text.startswith(tag)), None):
                self._opened, text = ("", text) if self.parser.keeps_opening else (opened, text[len(opened):])
        while True:
            if self._opened is None:
                if (found := first_tag(text, starts)) is None:
                    keep = held_back(text, starts, final)
                    out.append(self._joint.say(text[:len(text) - keep]))
                    self._held = text[len(text) - keep:]
                    break
                at, self._opened = found
                out.append(self._joint.say(text[:at]))
                text = text[at + len(self._opened):]
            if self.parser.reader is not None and (read := self._read_block(text, final)) is not None:
                streamed, text = read
                out += streamed
                if text is None:
                    break  # (the block still open, or the answer ended in it)
                continue  # the text after the block
            at = text.find(end) if end is not None else -1
            if at < 0 and not final:
                self._held = text  # the call's text so far, sent when it closes
                break
            block, closing = (text, "") if at < 0 else (text[:at], end)
            text, opened, self._opened = text[len(block) + len(closing):], self._opened, None
            found = self.parser.parse(block.strip(), self._schemas)
            if found is None:  # no call: the model's text, as it wrote it
                out.append(self._joint.say(opened + block + closing))
                continue
            kept = found if self._max_calls is None else found[:max(0, self._max_calls - self.num_calls)]
            out += kept
            self.num_calls += len(kept)
            self._joint.call()
        if final:
            out.append(self._joint.end())
        return [p for p in out if p]

    def _read_block(self, text: str, final: bool) -> tuple[list[CallPart], str | None] | None:
        """The parser's reader's parts of the block read now (its text so far, past its start tag) and the text after
        it (None while it is open, or where the answer ended in it); None where it holds no call the reader streams
        (read whole at its end)."""
        if self._block is None:
            room = None if self._max_calls is None else max(0, self._max_calls - self.num_calls)
            self._block = self.parser.reader(self._schemas, room)
        read = self._block.read(text, final)
        if read is None:
            self._block = None  # (it opened no call: it holds nothing of this block's)
            return None
        parts, rest = read
        for part in parts:
            if isinstance(part, OpenedCall):
                self.num_calls += 1
                self._joint.call()
        if rest is None and not final:
            self._held = text  # the block so far, read on with the next delta
        else:
            if self._block.called:  # (its calls past the room too: text around it is as around a call)
                self._joint.call()
            self._block = self._opened = None
        return _joined(parts), rest


# a forced harmony call (ForcedCallSplitter) as its text holds it: after an analysis message, or opening the answer
HARMONY_CALL, HARMONY_FIRST_CALL = "assistantcommentary to=functions.", "commentary to=functions."
_LISTED = re.compile(r"\s*,?\s*")  # what comes between a list's calls
# a list call's object up to its parameters' value: its name first, as the forced schema lists it
_LISTED_CALL = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
_JSON_STARTS = frozenset('{["-0123456789tfn')  # what a JSON value begins with
_JSON_START = f"[{re.escape(''.join(sorted(_JSON_STARTS)))}]"


class ForcedCallSplitter:
    """The answer of a request whose tool_choice forces calls, written under server/structured.py's forced_call_schema.

    - A named function: the answer is its arguments, sent as they come (as OpenAI streams a call's arguments), the
      call whole at the answer's end; an answer cut by max_tokens is a call with its arguments cut, as OpenAI's (one
      cut before its JSON begins, inside its reasoning, none).
    - "required": a list of {"name", "parameters"} (in that order, as the schema lists them), each call opened once its
      parameters' object or array begins, its arguments sent as they come and the call closed with its object (a
      call whose parameters are some other JSON value comes whole as its object closes); an answer cut by max_tokens
      in a call's arguments is that call with them cut, and what it holds after its last call and the comma after it
      otherwise (an object cut before its parameters; all of it where it made none) is content, as written.
    - harmony (gpt-oss, under a StructuredOutput's calls): a commentary message to one of these functions after the
      analysis, as the answer's text holds it ("...assistantcommentary to=functions.NAME json{...}"), read before the
      reasoning split (which takes the text before it: the reasoning's rewriting of harmony's message breaks would
      reach the arguments otherwise), its arguments sent as a named function's are; an answer cut before its
      arguments begin is content (and reasoning), as written."""

    def __init__(self, function: str | None, harmony: Sequence[str] = ()) -> None:
        self._function = function
        self.before_reasoning = bool(harmony)
        names = "|".join(re.escape(n) for n in sorted(harmony, key=len, reverse=True))  # (the longest name first)
        # the function a harmony call's header names, then <|constrain|>json (its text: "json"), then its arguments
        self._header = re.compile(rf"(?P<name>{names}) ?json(?={_JSON_START})") if harmony else None
        self._call_at: int | None = None  # where a harmony call's header begins (past "...to=functions.")
        self._said = 0  # the characters before a harmony call sent as text
        self._text = ""
        self._call: WrittenCall | None = None  # the call read now
        # the list's: where its last call ends (past its "[" before any), how far it is read, and the reader's state
        self._next: int | None = None
        self._read = 0
        self._nesting, self._element = _JsonNesting(), 0
        self._arguments_end: int | None = None  # where the open list call's arguments close, once they have
        self.num_calls = 0

    def parts(self, text: str, final: bool = False) -> list[str | FunctionCall | OpenedCall | ArgumentsPiece |
                                                              ClosedCall]:
        self._text += text
        return self._listed(final) if self._function is None and self._header is None else self._arguments(final)

    def _listed(self, final: bool) -> list[str | FunctionCall | OpenedCall | ArgumentsPiece | ClosedCall]:
        out: list[str | FunctionCall | OpenedCall | ArgumentsPiece | ClosedCall] = []
        if self._next is None:
            if not self._text.lstrip().startswith("["):
                return [self._text] if final and self._text else []
            self._next = self._read = self._text.index("[") + 1
        out += self._list_calls()
        if final and self._call is not None:  # cut in a call: that call, its arguments as far as they came
            self._close_listed(out, self._arguments_end or len(self._text), finished=False)
            return out
        rest = self._text[_LISTED.match(self._text, self._next).end():] if self.num_calls else self._text
        if final and rest.strip() and not re.fullmatch(r"\s*\]\s*", rest):
            out.append(rest)  # cut: what it holds after its last call (all of it, where it made none)
        return out

    def _list_calls(self) -> list[FunctionCall | OpenedCall | ArgumentsPiece | ClosedCall]:
        """The list's calls in the text read since the last delta, in one pass over it (a long call's arguments,
        read anew with each delta, took quadratic time): each opened where its parameters' object or array begins,
        its arguments sent as they come, closed with its object."""
        out, text = [], self._text
        for at in range(self._read, len(text)):
            moved, depth = self._nesting.read(text[at]), self._nesting.depth
            if moved > 0:
                self._element = at if depth == 1 else self._element
                if depth == 2 and self._call is None and (head := _LISTED_CALL.match(text, self._element)) \
                        and head.end() == at:
                    self._call = WrittenCall(out, json.loads(head["name"]), at)
                    self.num_calls += 1
            elif moved < 0:  # (the list's own "]", at depth 0, moves nothing)
                if depth == 1 and self._call is not None and self._arguments_end is None:
                    self._arguments_end = at + 1
                if depth == 0:
                    if self._call is not None:
                        self._close_listed(out, self._arguments_end, finished=True)
                    else:
                        value = json.loads(text[self._element:at + 1])
                        out.append(FunctionCall(value["name"], json_text(value["parameters"])))
                        self.num_calls += 1
                    self._next = at + 1
        self._read = len(text)
        if self._call is not None:
            self._call.send(out, text, self._arguments_end or len(text))
        return out

    def _close_listed(self, out: list[CallPart], end: int, finished: bool) -> None:
        self._call.close(out, self._text, end, finished)
        self._call, self._arguments_end = None, None

    def _arguments(self, final: bool) -> list[str | OpenedCall | ArgumentsPiece | ClosedCall]:
        out: list[str | OpenedCall | ArgumentsPiece | ClosedCall] = []
        if self._call is None:
            if self._header is not None:
                out += self._before_harmony_call(final)
            if (opening := self._opening()) is None:
                rest = self._text[self._said:]
                return out + ([rest] if final and rest else [])
            self._call, self.num_calls = WrittenCall(out, *opening), 1
        if final:  # the arguments as the model wrote them
            self._call.close(out, self._text, len(self._text))
        else:
            self._call.send(out, self._text, len(self._text))
        return out

    def _before_harmony_call(self, final: bool) -> list[str]:
        """The text before a harmony call, sent on as it comes (the reasoning's), but for what may begin the call's
        message; finds where the call's header begins."""
        text = self._text
        if self._call_at is None:
            if text.startswith(HARMONY_FIRST_CALL):  # the answer's first message
                self._call_at = len(HARMONY_FIRST_CALL)
            elif not final and HARMONY_FIRST_CALL.startswith(text):
                return []
            elif (found := text.find(HARMONY_CALL, self._said)) >= 0:
                said, self._said, self._call_at = text[self._said:found], found, found + len(HARMONY_CALL)
                return [said] if said else []
            else:
                end = len(text) - held_back(text[self._said:], (HARMONY_CALL,), final)
                said, self._said = text[self._said:end], end
                return [said] if said else []
        return []

    def _opening(self) -> tuple[str, int] | None:
        """(the function called, where its arguments begin), once the text has opened the call."""
        if self._header is not None:
            header = self._header.match(self._text, self._call_at) if self._call_at is not None else None
            return (header["name"], header.end()) if header else None
        # the call opens with its JSON (an object, as a function's parameters are; any JSON value, as a schema may
        # say): what the answer holds before it (the start of a reasoning tag that max_tokens cut) is content, and
        # whitespace waits for the JSON
        return (self._function, 0) if self._text.lstrip()[:1] in _JSON_STARTS else None
