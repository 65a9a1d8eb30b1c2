"""/v1/responses: OpenAI's Responses API answered as the chat completion its input makes, its shapes and events as
the openai SDK's types define them."""

from __future__ import annotations

import json

import httpx
import pytest

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.tool_calls import tool_call_parser
from tests.server.conftest import ANSWER, CALLS, MODEL, QUESTION, TOOLS, start_server, tiny_engine


def _events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + "/responses", json={**body, "stream": True}, timeout=60) as r:
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert names == [e["type"] for e in events]  # each event named on its own line too, as OpenAI sends them
    return events


def _checked(events: list[dict]):
    """Every event as the SDK's types read it (validated, not only parsed), in sequence."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [adapter.validate_python(e) for e in events]


@pytest.fixture(scope="module")
def server(tiny_dirs):
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4))
    yield server
    server.stop()


def test_a_response_is_the_targets_own_answer_whole_and_streamed(server, oracle):
    from openai.types.responses import Response

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "tell me 3 things"}]
    want = oracle.generate([oracle.prompt_encoder.encode_chat(messages, add_generation_prompt=True)],
                           SamplingParams(max_new_tokens=12))[0]
    body = {"model": MODEL, "instructions": "Be brief.", "input": "tell me 3 things", "max_output_tokens": 12,
            "temperature": 0}
    raw = httpx.post(server.base_url + "/responses", json=body, timeout=60).json()
    whole = Response.model_validate(raw)
    assert whole.output_text == want.text and whole.status == ("incomplete" if want.finish_reason == "length"
                                                               else "completed")
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (tokenized["count"], want.num_tokens)

    events = _checked(_events(server, body))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    final = events[-1].response
    assert final.output_text == want.text and events[-1].type == f"response.{final.status}"

    # the SDK's own accumulation of the stream (which checks each event against what it has put together)
    with server.client().responses.stream(**body) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == want.text


def test_an_answer_cut_by_max_output_tokens_is_incomplete(server):
    raw = httpx.post(server.base_url + "/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=60).json()
    assert raw["status"] == "incomplete" and raw["incomplete_details"] == {"reason": "max_output_tokens"}
    assert raw["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("extra, says", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format: type must be 'text', 'json_object' or 'json_schema'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format: a json_schema format holds its schema"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0: items of type 'image_generation_call'"),
    ({"tools": [{"type": "function", "name": "f"}]}, "--tool-call-parser"),  # no parser on this server
    ({"temperature": 3}, "temperature"),
    ({"input": 5}, "input"),
    ({"text": {"format": "json_object"}}, "text.format"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": None}]}]}, "input.0.summary"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.0.output"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"metadata": "x"}, "metadata"),
    ({"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ({"top_logprobs": 2}, "logprobs are not supported"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice: 'allowed_tools'"),
])
def test_what_this_server_does_not_do_is_refused_naming_it(server, extra, says):
    r = httpx.post(server.base_url + "/responses", json={"input": "hi", **extra}, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_function_calls_come_back_as_output_items_and_go_back_as_input_items(caller):
    """The target writes two calls (the `caller` fixture): they are function_call items beside the message; sent back
    with their outputs, they are the conversation's tool-calling turn."""
    from openai.types.responses import Response

    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_dirs(*caller, EngineConfig(max_model_len=256, max_batch_size=4))
    server = start_server(engine, tool_parser=tool_call_parser("hermes"))
    try:
        tools = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n, _ in CALLS]
        body = {"input": QUESTION, "tools": tools, "max_output_tokens": 200, "temperature": 0}
        whole = Response.model_validate(httpx.post(server.base_url + "/responses", json=body, timeout=60).json())
        assert [o.type for o in whole.output] == ["message", "function_call", "function_call"]
        assert whole.output_text == "I will look." and whole.status == "completed"
        calls = [o for o in whole.output if o.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS

        events = _checked(_events(server, body))
        streamed = events[-1].response
        assert [(o.type, getattr(o, "name", None)) for o in streamed.output] == [
            (o.type, getattr(o, "name", None)) for o in whole.output]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.name, json.loads(e.arguments)) for e in done] == CALLS
        with server.client().responses.stream(model=MODEL, **body) as stream:
            final = stream.get_final_response()
        assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
            (o.type, getattr(o, "arguments", None)) for o in whole.output]

        # without the parser's reading, the answer is the calls' text
        text = httpx.post(server.base_url + "/responses", json={**body, "tool_choice": "none"}, timeout=60).json()
        assert Response.model_validate(text).output_text == ANSWER

        # the output sent back with the calls' outputs (an agent's loop): the turn renders as chat renders it, its
        # text and calls one assistant message
        history = [*QUESTION, *(o.model_dump(exclude_none=True) for o in whole.output),
                   *({"type": "function_call_output", "call_id": c.call_id, "output": output}
                     for c, output in zip(calls, ["sunny", [{"type": "input_text", "text": "sunny"}]]))]
        again = httpx.post(server.base_url + "/responses", json={**body, "input": history, "max_output_tokens": 4},
                           timeout=60)
        assert again.status_code == 200, again.text
        chat = [*QUESTION, {"role": "assistant", "content": "I will look.", "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]}, *({"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls)]
        counted = httpx.post(server.url + "/tokenize", json={"messages": chat, "tools": TOOLS}, timeout=30).json()
        assert again.json()["usage"]["input_tokens"] == counted["count"]
        as_chat = server.client().chat.completions.create(model=MODEL, messages=chat, tools=TOOLS, max_tokens=4,
                                                          temperature=0)
        assert Response.model_validate(again.json()).output_text == as_chat.choices[0].message.content

        one = httpx.post(server.base_url + "/responses", json={**body, "max_tool_calls": 1}, timeout=60).json()
        assert [o["name"] for o in one["output"] if o["type"] == "function_call"] == ["get_weather"]
    finally:
        server.stop()


def test_reasoning_is_a_reasoning_item_and_a_cut_item_is_incomplete(tiny_dirs, oracle):
    """deepseek_r1 reads an answer without </think> as reasoning from its start: one reasoning item, cut by
    max_output_tokens, incomplete as the response is; its text the target's own."""
    from openai.types.responses import Response

    from dflash_trt.server.reasoning import PARSERS

    want = oracle.generate([oracle.prompt_encoder.encode_chat([{"role": "user", "content": "hi"}],
                                                               add_generation_prompt=True)],
                           SamplingParams(max_new_tokens=6))[0]
    assert "</think>" not in want.text and want.finish_reason == "length"
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4), reasoning=PARSERS["deepseek_r1"])
    try:
        body = {"input": "hi", "max_output_tokens": 6, "temperature": 0}
        whole = Response.model_validate(httpx.post(server.base_url + "/responses", json=body, timeout=60).json())
        events = _checked(_events(server, body))
        for response in (whole, events[-1].response):
            assert [(o.type, o.status, o.content[0].text) for o in response.output] == [
                ("reasoning", "incomplete", want.text)]
            assert response.status == "incomplete"
        kinds = [e.type for e in events]
        assert kinds.index("response.content_part.added") < kinds.index("response.reasoning_text.delta") < kinds.index(
            "response.content_part.done")
    finally:
        server.stop()


def test_a_stream_that_fails_ends_with_the_apis_error_and_failed_events(server, monkeypatch):
    from dflash_trt.server.chat_answer import ChatAnswerSplitter

    def broken(self, text, final=False):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ChatAnswerSplitter, "parts", broken)
    with httpx.stream("POST", server.base_url + "/responses", json={"input": "hi", "max_output_tokens": 4,
                                                                    "stream": True}, timeout=60) as r:
        lines = list(r.iter_lines())
    events = _checked([json.loads(line[6:]) for line in lines if line.startswith("data: ")])
    assert [e.type for e in events[-2:]] == ["error", "response.failed"] and events[-1].response.status == "failed"
    assert events[-2].message == "internal error: a bug" and "data: [DONE]" not in lines
    monkeypatch.undo()
    assert server.wait_idle() and httpx.get(server.url + "/health", timeout=10).status_code == 200
