"""A chat answer's tool calls read out of its text, as `--tool-call-parser` does in vLLM (`--tool_parser` in
trtllm-serve): each call the model writes becomes an entry of the message's `tool_calls` (OpenAI's shape, arguments
as a JSON string), the text around them its `content`, and the choice finishes with "tool_calls".

- hermes (Qwen2.5, Qwen3, Hermes; TensorRT-LLM's `qwen3`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  ("parameters" for "arguments" too), or a list of such objects in one block;
- qwen3_coder (Qwen3-Coder; vLLM's `qwen3_xml` too): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`, each value read as the tool's schema types it (a string stays a string; numbers, booleans,
  objects and arrays as JSON);
- gpt_oss: harmony's commentary channel addressed to a function, as the answer's text holds it without harmony's
  special tokens (as the gpt_oss reasoning parser reads its channels): `<|start|>assistant<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` is "assistantcommentary to=functions.NAME json{...}",
  the answer's last message (`<|call|>` ends gpt-oss's turn). Read before the reasoning split, which then takes the
  text before it. The default for a gpt-oss target.

Like the reasoning split, it reads the text as the client gets it, delta by delta or whole, alike: text that may begin
a call is held back until the next delta says whether it does, and a call is sent whole once it closes (or the answer
ends). A block that does not parse as a call stays in the content as written, so nothing the model said is lost;
whitespace next to a call is dropped, the rest of the text outside calls is the content (None where there is none).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.server.reasoning import partial_tag

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# harmony's call as its text holds it: after an analysis message ("assistant" is the next message's header), or
# opening the answer; the recipient in the channel's header, as gpt-oss writes it, or in the role's, as gpt-oss's
# template writes past calls (at the answer's start the prompt holds the role: " to=functions.")
HARMONY_STARTS = ("assistantcommentary to=functions.", "commentary to=functions.", "assistant to=functions.",
                  " to=functions.")


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _arguments(value: Any) -> str | None:
    """A call's arguments as a JSON object's text, or None where they are no object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _hermes_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = _arguments(call.get("arguments", call.get("parameters", {})))
        if arguments is None:
            return None
        calls.append(FunctionCall(call["name"], arguments))
    return calls or None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)


def _typed(value: str, schema: dict | None) -> Any:
    """A qwen3_coder parameter's text as its schema types it: a string where the schema allows one (or says nothing
    of the parameter), else its JSON value (the text itself where it is none)."""
    types = (schema or {}).get("type", "string")
    types = set(types) if isinstance(types, list) else {types}
    if "string" in types and not (value == "null" and "null" in types):
        return value
    try:
        return json.loads(value)
    except ValueError:
        if "boolean" in types and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value


def _coder_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, inner = function.group(1).strip(), function.group(2)
    properties = (tools.get(name) or {}).get("properties") or {}
    arguments, at = {}, 0
    while at < len(inner):
        parameter = _PARAMETER.match(inner, at)
        if parameter is None:
            return None if inner[at:].strip() else [FunctionCall(name, json.dumps(arguments, ensure_ascii=False))]
        key, value = parameter.group(1).strip(), parameter.group(2)
        # the template writes each value on lines of its own: one newline either side is layout, not value
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key] = _typed(value, properties.get(key))
        at = parameter.end()
    return [FunctionCall(name, json.dumps(arguments, ensure_ascii=False))]


# what may follow a harmony call's function name before its arguments: the role-header form's channel, and the
# <|constrain|>json its text leaves as "json"
_HARMONY_SUFFIX = r"\s*(?:commentary)?\s*(?:json)?\s*"


def _harmony_calls(body: str, tools: dict[str, dict]) -> list[FunctionCall] | None:
    brace = body.find("{")
    if brace < 0:
        return None
    head = body[:brace].strip()
    # a function named in the request is read as named ("fetch_json", not "fetch_" and its constraint); others as
    # the shortest name the rest can follow
    known = [n for n in tools if head.startswith(n) and re.fullmatch(_HARMONY_SUFFIX, head[len(n):])]
    name = max(known, key=len) if known else (m.group(1) if (m := re.fullmatch(r"(\S+?)" + _HARMONY_SUFFIX, head))
                                              else None)
    try:
        arguments, end = json.JSONDecoder().raw_decode(body, brace)
    except ValueError:
        return None
    if not name or not isinstance(arguments, dict) or body[end:].strip():
        return None
    return [FunctionCall(name, json.dumps(arguments, ensure_ascii=False))]


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    trtllm_name: str | None  # trtllm-serve's --tool_parser for the same format (None: it reads it unasked)
    parse: Any  # (block's text, {tool name: its parameters' schema}) -> the calls, or None where it is no call
    starts: tuple[str, ...] = (CALL_START,)  # what opens a call
    end: str | None = CALL_END  # what closes it; None: the answer's end
    before_reasoning: bool = False  # read before the reasoning split (its calls are outside the reasoning's tags)


PARSERS = {p.name: p for p in (ToolCallParser("hermes", "qwen3", _hermes_calls),
                               ToolCallParser("qwen3_coder", "qwen3_coder", _coder_calls),
                               # trtllm-serve reads a gpt-oss target's harmony itself
                               ToolCallParser("gpt_oss", None, _harmony_calls, HARMONY_STARTS, None, True))}
ALIASES = {"qwen3": "hermes", "qwen3_xml": "qwen3_coder", "openai": "gpt_oss"}  # TensorRT-LLM's and vLLM's names


def tool_call_parser(name: str | None) -> ToolCallParser | None:
    """The parser named (vLLM's or TensorRT-LLM's name); None for None."""
    if name is None:
        return None
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted([*PARSERS, *ALIASES]))}")
    return PARSERS[key]


def default_tool_parser(target) -> ToolCallParser | None:
    """The parser a target's calls take whatever the server is told: gpt-oss's (its chat format is harmony's); None
    for others, whose format the server cannot tell."""
    from dflash_trt.models.gpt_oss import GptOssForCausalLM

    return PARSERS["gpt_oss"] if isinstance(target, GptOssForCausalLM) else None


class _Joint:
    """The content's text with the whitespace next to each call left out: trailing whitespace is held until text
    follows it (sent with it) or a call does (dropped)."""

    def __init__(self) -> None:
        self._pending = ""
        self._after_call = False

    def say(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._pending + text
        said = text.rstrip()
        self._pending = text[len(said):]
        return said

    def call(self) -> None:
        self._pending, self._after_call = "", True

    def end(self) -> str:
        said, self._pending = self._pending, ""
        return said


class ToolCallSplitter:
    """One answer's text, fed in order, sent on as (content delta, calls complete in it)."""

    def __init__(self, parser: ToolCallParser, tools: list[dict] | None = None, parallel: bool = True) -> None:
        """tools: the request's, as chat templates take them (qwen3_coder reads their parameters' types). parallel:
        OpenAI's parallel_tool_calls; false keeps the first call only."""
        self.parser = parser
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        self._parallel = parallel
        self._joint = _Joint()
        self._held = ""
        self._opened: str | None = None  # the tag that opened the call whose text is held, if any
        self.num_calls = 0  # calls sent so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[FunctionCall]]:
        """The content and the calls of text, the answer's next delta; `final` with its last (nothing held back)."""
        text, self._held = self._held + text, ""
        said: list[str] = []
        calls: list[FunctionCall] = []
        starts, end = self.parser.starts, self.parser.end
        while True:
            if self._opened is None:
                found = [(at, -len(tag), tag) for tag in starts if (at := text.find(tag)) >= 0]
                if not found:
                    keep = 0 if final else max(partial_tag(text, tag) for tag in starts)
                    said.append(self._joint.say(text[:len(text) - keep]))
                    self._held = text[len(text) - keep:]
                    break
                at, _, self._opened = min(found)  # the first, and of those at one place the longest
                said.append(self._joint.say(text[:at]))
                text = text[at + len(self._opened):]
            at = text.find(end) if end is not None else -1
            if at < 0 and not final:
                self._held = text  # the call's text so far, sent when it closes
                break
            block, closing = (text, "") if at < 0 else (text[:at], end)
            text, opened, self._opened = text[len(block) + len(closing):], self._opened, None
            found = self.parser.parse(block.strip(), self._schemas)
            if found is None:  # no call: the model's text, as it wrote it
                said.append(self._joint.say(opened + block + closing))
                continue
            kept = found if self._parallel else found[:max(0, 1 - self.num_calls)]
            calls += kept
            self.num_calls += len(kept)
            self._joint.call()
        if final:
            said.append(self._joint.end())
        return "".join(said), calls

    def split(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """A whole answer's (content, calls): content None where the answer made calls and said nothing else, its
        text as it is where it made none."""
        content, calls = self.feed(text, final=True)
        return (content or None) if calls else content, calls
