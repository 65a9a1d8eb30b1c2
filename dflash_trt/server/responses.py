"""OpenAI's Responses API (/v1/responses) on the chat path: a request's input items become a chat conversation (its
instructions a system message, function calls and their outputs the tool-calling turns chat templates render), and the
answer's reasoning, text and tool calls become output items, whole or as the API's stream of typed events.

Stateless: nothing is stored, so `previous_response_id` (and `conversation`, `background`) are refused, and a client
sends the conversation so far as input, as chat clients do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from dflash_trt.server.call_parts import FunctionCall
from dflash_trt.server.protocol import ReasoningEffort

# sampling fields of vLLM's ResponsesRequest beside OpenAI's, passed on as chat takes them
_EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
               "ignore_eos", "min_tokens", "logit_bias", "stop_token_ids", "acceptance")


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: ReasoningEffort | None = None


class ResponsesRequest(BaseModel):
    """What /v1/responses reads of a body beside the sampling fields the chat request checks."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    max_tool_calls: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool = False
    reasoning: ReasoningOptions | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, as chat takes them (Qwen3's enable_thinking)
    previous_response_id: str | None = None
    conversation: Any = None
    background: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    include: list[str] | None = None


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body as the chat completion body that answers it; ValueError naming what is not supported."""
    req = ResponsesRequest.model_validate(body)
    if req.previous_response_id is not None or req.conversation is not None:
        raise ValueError("previous_response_id and conversation are not supported: this server stores no responses; "
                         "send the conversation so far as input")
    if req.background:
        raise ValueError("background responses are not supported (nothing is stored to poll)")
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or ()):
        raise ValueError("logprobs are not supported on /v1/responses (chat completions return them)")
    chat: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.max_tool_calls is not None:
        chat["max_tool_calls"] = req.max_tool_calls
    if req.text is not None and req.text.get("format") is not None:
        chat["response_format"] = _response_format(req.text["format"])
    if req.tools:
        chat["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    if req.chat_template_kwargs is not None:
        chat["chat_template_kwargs"] = req.chat_template_kwargs
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    return chat | {k: body[k] for k in ("temperature", "top_p", *_EXTENSIONS) if body.get(k) is not None}


def _response_format(form: Any) -> dict[str, Any]:
    """text.format as chat's response_format, whose checks then apply (their errors named text.format by the app):
    json_schema's fields sit in the format itself."""
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    if "schema" not in form:  # (said here: chat's message would describe chat's nesting)
        raise ValueError("text.format: a json_schema format holds its schema: {\"type\": \"json_schema\", \"name\": "
                         "..., \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {k: form[k] for k in ("name", "schema", "strict") if k in form}}


def _chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice  # "auto", "none", "required": chat's own
    if choice.get("type") == "function":  # a function named: chat's shape of it
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"tool_choice: {choice.get('type')!r} is not supported (send \"auto\", \"none\", \"required\" "
                     "or a function)")


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools.{index}: only function tools are supported, got type {tool.get('type')!r}")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: an assistant's text, reasoning and calls of one turn in one message, as chat
    sends them back (and renders them), so a response's output sent back as input makes the prompt chat would."""
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    turn: dict[str, Any] | None = None  # the assistant turn the items read so far belong to
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") != "assistant":
            out.append({"role": item.get("role"), "content": item.get("content")})
            turn = None
            continue
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _tool_output(i, item)})
            turn = None
            continue
        if kind not in ("message", "function_call", "reasoning"):
            raise ValueError(f"input.{i}: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output, reasoning)")
        said = turn is not None and (turn["content"] is not None or "tool_calls" in turn)
        if turn is None or kind == "message" and said or kind == "reasoning" and (said or "reasoning" in turn):
            turn = {"role": "assistant", "content": None}  # the item begins an assistant turn of its own
            out.append(turn)
        if kind == "message":
            turn["content"] = item.get("content")
        elif kind == "function_call":
            turn.setdefault("tool_calls", []).append({"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}})
        else:
            turn["reasoning"] = _reasoning_text(i, item)
    return out


def _texts(where: str, parts: Any, kinds: tuple[str, ...]) -> str:
    """The text parts of an item's content (`kinds`), joined as chat joins a message's parts."""
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") in kinds
                                              and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"{where}: a list of parts of type {' or '.join(kinds)}, each with its text, is supported")
    return "\n".join(p["text"] for p in parts)


def _reasoning_text(index: int, item: dict[str, Any]) -> str:
    if item.get("content"):
        return _texts(f"input.{index}.content", item["content"], ("reasoning_text",))
    return _texts(f"input.{index}.summary", item.get("summary") or [], ("summary_text",))


def _tool_output(index: int, item: dict[str, Any]) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list):  # the API's text parts
        return _texts(f"input.{index}.output", output, ("input_text", "output_text"))
    return json.dumps(output)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [_part("reasoning", text)], "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [_part("message", text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: FunctionCall, arguments: str | None = None, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status if arguments is None else "in_progress"}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    # (cache_write_tokens: OpenAI's for tokens its cache is paid to keep; a prompt's rows here are kept unasked)
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseObject:
    """The response's fields that stay put while it is made: its id, time, model, and what the request set."""

    def __init__(self, model: str, body: dict[str, Any], chat: Any) -> None:
        self.id, self.created_at, self.model = _id("resp"), int(time.time()), model
        self._settings = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"), "metadata": body.get("metadata"),
            "parallel_tool_calls": chat.parallel_tool_calls, "temperature": chat.temperature, "top_p": chat.top_p,
            "tool_choice": body.get("tool_choice") or ("auto" if chat.tools else "none"),
            "tools": body.get("tools") or [], "previous_response_id": None, "reasoning": body.get("reasoning"),
            "text": body.get("text") or {"format": {"type": "text"}}, "store": False, "truncation": "disabled",
        }

    def dump(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None,
             usage: dict[str, Any] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        """status: in_progress while it is made; completed, or incomplete where max_output_tokens (or the context)
        cut it; failed, with the error."""
        incomplete = finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": "incomplete" if incomplete else status, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, **self._settings}


class ResponseEvents:
    """An answer's ordered parts (ChatAnswerSplitter.parts: reasoning, content, calls) as the Responses API's events:
    an item opened (output_item.added, content_part.added), its deltas, and closed (…done) before the next opens. A
    whole answer's response is the one its events end with, so streamed and not, its output items are the same."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self._open: dict[str, Any] | None = None  # the item its deltas go to: {"type", "id", "text"}
        self._calling = ""  # the id of the call item whose arguments come
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        created = self.response.dump("in_progress", [])
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def feed(self, parts: list[tuple[str, Any]], cut: bool = False) -> list[dict[str, Any]]:
        """The events of the answer's next parts; cut: its last, where max_tokens cut it (a call that closes in them
        as the answer ends, its arguments cut, is incomplete, as the response is; a whole call is complete)."""
        events = []
        for kind, value in parts:
            if kind == "call":
                events += self._close() + self._call_opened(value) + self._call_arguments(value.arguments)
                events += self._call_closed(value)
                continue
            if kind == "call_opened":
                events += self._close() + self._call_opened(value)
                continue
            if kind == "arguments":
                events += self._call_arguments(value)
                continue
            if kind in ("call_closed", "call_finished"):
                events += self._call_closed(value, "incomplete" if cut and kind == "call_closed" else "completed")
                continue
            kind = "reasoning" if kind == "reasoning" else "message"
            if self._open is None or self._open["type"] != kind:
                events += self._close() + self._opened(kind)
            self._open["text"] += value
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append(self._event(name, item_id=self._open["id"], output_index=len(self.output),
                                      content_index=0, delta=value,
                                      **({"logprobs": []} if kind == "message" else {})))
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        # the item the answer was cut in is incomplete, as the response is
        status = "incomplete" if finish_reason == "length" else "completed"
        events = self._close(status)
        if not self.output:  # an empty answer: an empty message (cut, where the answer was cut in held-back text)
            events += self._opened("message") + self._close(status)
        done = self.response.dump("completed", self.output, finish_reason, usage)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=done)]

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The events of a response that failed while it was made: the API's error event, then response.failed."""
        error = {"code": "server_error", "message": message}
        return [self._event("error", **error, param=None),
                self._event("response.failed", response=self.response.dump("failed", self.output, error=error))]

    def _call_opened(self, call: FunctionCall) -> list[dict[str, Any]]:
        self._calling = _id("fc")
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=call_item(self._calling, call, arguments=""))]

    def _call_arguments(self, piece: str) -> list[dict[str, Any]]:
        return [self._event("response.function_call_arguments.delta", item_id=self._calling,
                            output_index=len(self.output), delta=piece)] if piece else []

    def _call_closed(self, call: FunctionCall, status: str = "completed") -> list[dict[str, Any]]:
        item_id, index = self._calling, len(self.output)
        self.output.append(call_item(item_id, call, status=status))
        return [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=call.arguments, name=call.name),
                self._event("response.output_item.done", output_index=index, item=self.output[-1])]

    def _opened(self, kind: str) -> list[dict[str, Any]]:
        item_id, index = _id("rs" if kind == "reasoning" else "msg"), len(self.output)
        self._open = {"type": kind, "id": item_id, "text": ""}
        item = {**reasoning_item(item_id, "", "in_progress"), "content": []} if kind == "reasoning" else message_item(
            item_id, None, "in_progress")
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                            part=_part(kind, ""))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item_id, kind, text, index = self._open["id"], self._open["type"], self._open["text"], len(self.output)
        if kind == "reasoning":
            self.output.append(reasoning_item(item_id, text, status))
            events = [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=text)]
        else:
            self.output.append(message_item(item_id, text, status))
            events = [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                  text=text, logprobs=[])]
        self._open = None
        return events + [self._event("response.content_part.done", item_id=item_id, output_index=index,
                                     content_index=0, part=_part(kind, text)),
                         self._event("response.output_item.done", output_index=index, item=self.output[-1])]
