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

from pydantic import BaseModel, ConfigDict, StrictBool

from dflash_trt.server.tool_calls import FunctionCall

# sampling fields of vLLM's ResponsesRequest beside OpenAI's, passed on as chat takes them
_EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
               "ignore_eos", "min_tokens", "logit_bias", "stop_token_ids", "acceptance")


class ResponsesRequest(BaseModel):
    """What /v1/responses reads of a body beside the sampling fields the chat request checks."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool = False
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: StrictBool | None = None


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body as the chat completion body that answers it; ValueError naming what is not supported."""
    req = ResponsesRequest.model_validate(body)
    if req.previous_response_id is not None or req.conversation is not None:
        raise ValueError("previous_response_id and conversation are not supported: this server stores no responses; "
                         "send the conversation so far as input")
    if req.background:
        raise ValueError("background responses are not supported (nothing is stored to poll)")
    if req.text and (req.text.get("format") or {}).get("type", "text") != "text":
        raise ValueError(f"text.format: only type 'text' is supported, got {req.text['format'].get('type')!r}")
    chat: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        # a function named: chat's shape of it (refused there, as it forces a call)
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if isinstance(
            choice, dict) else choice
    if req.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning and req.reasoning.get("effort") is not None:
        # gpt-oss's template reads it (its system message's "Reasoning: ..."); others ignore it
        chat["chat_template_kwargs"] = {"reasoning_effort": req.reasoning["effort"]}
    return chat | {k: body[k] for k in ("temperature", "top_p", *_EXTENSIONS) if body.get(k) is not None}


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools.{index}: only function tools are supported, got type {tool.get('type')!r}")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    thought = None  # a reasoning item's text, for the assistant turn it belongs to
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item.get("role"), "content": item.get("content")}
            if message["role"] == "assistant" and thought is not None:
                message["reasoning"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1].get("tool_calls") and thought is None:  # a turn's further call
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]}
                           | ({"reasoning": thought} if thought is not None else {}))
                thought = None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ValueError(f"input.{i}: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output, reasoning)")
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: FunctionCall, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress"}


def output_items(thought: str | None, content: str | None, calls: list[FunctionCall]) -> list[dict[str, Any]]:
    """A whole answer's output: its reasoning, its text (where it said any, or where it did nothing else), its
    calls."""
    items = [reasoning_item(_id("rs"), thought)] if thought is not None else []
    if content is not None or not (items or calls):
        items.append(message_item(_id("msg"), content or ""))
    return items + [call_item(_id("fc"), call) for call in calls]


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # (cache_write_tokens: OpenAI's for tokens its cache is paid to keep; a prompt's rows here are kept unasked)
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseObject:
    """The response's fields that stay put while it is made: its id, time, model, and what the request set."""

    def __init__(self, model: str, body: dict[str, Any], chat: Any) -> None:
        self.id, self.created_at, self.model = _id("resp"), int(time.time()), model
        self._settings = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata"), "parallel_tool_calls": chat.parallel_tool_calls,
            "temperature": chat.temperature, "top_p": chat.top_p,
            "tool_choice": body.get("tool_choice") or ("auto" if chat.tools else "none"),
            "tools": body.get("tools") or [], "previous_response_id": None, "reasoning": body.get("reasoning"),
            "text": {"format": {"type": "text"}}, "store": False, "truncation": "disabled", "error": None,
        }

    def dump(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None,
             usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """status: in_progress while it is made; completed, or incomplete where max_output_tokens (or the context)
        cut it."""
        incomplete = finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": "incomplete" if incomplete else status, "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, **self._settings}


class ResponseEvents:
    """A streamed answer's (reasoning, text, calls) deltas as the Responses API's events, in order: an item opened
    (output_item.added, for text also content_part.added), its deltas, and closed (…done) before the next opens."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self._open: dict[str, Any] | None = None  # the item its deltas go to: {"type", "id", "text"}
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        created = self.response.dump("in_progress", [])
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def feed(self, thought: str, text: str, calls: list[FunctionCall]) -> list[dict[str, Any]]:
        events = []
        for kind, delta in (("reasoning", thought), ("message", text)):
            if not delta:
                continue
            if self._open is None or self._open["type"] != kind:
                events += self._close() + self._opened(kind)
            self._open["text"] += delta
            index = len(self.output)
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append(self._event(name, item_id=self._open["id"], output_index=index, content_index=0,
                                      delta=delta, **({"logprobs": []} if kind == "message" else {})))
        for call in calls:
            events += self._close()
            item_id, index = _id("fc"), len(self.output)
            events += [self._event("response.output_item.added", output_index=index,
                                   item=call_item(item_id, call, arguments="")),
                       self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=call.arguments),
                       self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                   arguments=call.arguments, name=call.name)]
            self.output.append(call_item(item_id, call))
            events.append(self._event("response.output_item.done", output_index=index, item=self.output[-1]))
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        if not self.output:  # an empty answer: an empty message, as the whole answer has
            events += self._opened("message") + self._close()
        done = self.response.dump("completed", self.output, finish_reason, usage)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=done)]

    def _opened(self, kind: str) -> list[dict[str, Any]]:
        item_id, index = _id("rs" if kind == "reasoning" else "msg"), len(self.output)
        self._open = {"type": kind, "id": item_id, "text": ""}
        if kind == "reasoning":
            return [self._event("response.output_item.added", output_index=index,
                                item={**reasoning_item(item_id, ""), "content": [], "status": "in_progress"})]
        return [self._event("response.output_item.added", output_index=index,
                            item=message_item(item_id, None, "in_progress")),
                self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item_id, text, index = self._open["id"], self._open["text"], len(self.output)
        if self._open["type"] == "reasoning":
            self.output.append(reasoning_item(item_id, text))
            events = [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=text)]
        else:
            self.output.append(message_item(item_id, text))
            events = [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                  text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=self.output[-1]["content"][0])]
        self._open = None
        return events + [self._event("response.output_item.done", output_index=index, item=self.output[-1])]
