"""Structured output over HTTP: OpenAI's response_format (json_object, json_schema; the openai SDK's parse helper),
vLLM's guided_* fields and structured_outputs, and a tool_choice that forces calls. Every answer is the one the same
target gives decoding plainly under the same grammar (the engine's own tests hold that to transformers), and
matches what it was asked to."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pydantic
import pytest
import regex

from dflash_trt import SamplingParams, StructuredOutput
from dflash_trt.server.chat_answer import ChatAnswerSplitter
from dflash_trt.server.reasoning import reasoning_parser
from dflash_trt.server.tool_calls import tool_call_parser
from dflash_trt.server.structured import forced_call_schema
from tests.server.conftest import QUESTION, TOOLS, start_server, trained_to_answer

# bounded, so that a small target's answer closes within the tokens asked for
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["tag", "n"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CALLABLE = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
            {"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
                "additionalProperties": False}}}]


class Pick(pydantic.BaseModel):
    tag: Literal["red", "green", "blue"]
    n: int = pydantic.Field(ge=0, le=99)


def _engine(dirs, **cfg):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine.from_dirs(*dirs, EngineConfig(max_model_len=256, max_batch_size=4, **cfg))


@pytest.fixture(scope="module")
def plain(caller):
    """The oracle: the same target decoding plainly, one token at a time."""
    return _engine(caller, speculative=False)


@pytest.fixture(scope="module")
def served(caller):
    server = start_server(_engine(caller))
    yield server
    server.stop()


def _expected(plain, spec: StructuredOutput, messages=QUESTION, chat: bool = True, max_tokens: int = 80, **kw):
    prompt = plain.prompt_encoder.encode_chat(messages, **{"add_generation_prompt": True, **kw}) if chat else messages
    return plain.generate([prompt], SamplingParams(max_new_tokens=max_tokens, structured=spec))[0]


def _chat(served, **body) -> httpx.Response:
    return httpx.post(served.base_url + "/chat/completions", timeout=60,
                      json={"messages": QUESTION, "max_tokens": 80, "temperature": 0} | body)


def test_a_json_schema_answer_parses_into_the_sdks_model_and_is_the_plain_targets(served, plain):
    sent = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.read()))]})
    # the SDK's parse helper sends Pick's strict schema as response_format json_schema, and reads the answer back
    completion = served.client(http_client=http).chat.completions.parse(
        model="tiny-qwen3", messages=QUESTION, response_format=Pick, max_tokens=80, temperature=0)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pick) and completion.choices[0].finish_reason == "stop"
    schema = sent[0]["response_format"]["json_schema"]["schema"]
    assert message.content == _expected(plain, StructuredOutput(json=schema)).text


@pytest.mark.parametrize("body, spec, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}},
     StructuredOutput(json=SCHEMA), lambda t: set(json.loads(t)) == {"tag", "n"}),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True),
     lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": SCHEMA}, StructuredOutput(json=SCHEMA), lambda t: set(json.loads(t)) == {"tag", "n"}),
    ({"guided_regex": r"[a-c]{3}-[0-9]"}, StructuredOutput(regex=r"[a-c]{3}-[0-9]"),
     lambda t: regex.fullmatch(r"[a-c]{3}-[0-9]", t)),
    ({"guided_choice": ["sunny", "rain (light)"]}, StructuredOutput(choice=["sunny", "rain (light)"]),
     lambda t: t in ("sunny", "rain (light)")),
    ({"guided_grammar": 'start: "x" D D\nD: /[0-9]/'}, StructuredOutput(grammar='start: "x" D D\nD: /[0-9]/'),
     lambda t: regex.fullmatch("x[0-9]{2}", t)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, StructuredOutput(regex="(yes|no)!"),
     lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "disable_fallback": True}},
     StructuredOutput(json=SCHEMA, any_whitespace=False),
     lambda t: " " not in t and set(json.loads(t)) == {"tag", "n"}),
], ids=["json_schema", "json_object", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "structured_outputs", "no whitespace"])
def test_each_way_of_asking_gives_the_plain_targets_answer_under_that_grammar(served, plain, body, spec, check):
    want = _expected(plain, spec)
    choice = _chat(served, **body).json()["choices"][0]
    assert choice["message"]["content"] == want.text and check(want.text)
    assert choice["finish_reason"] == want.finish_reason == "stop"


def test_a_streamed_structured_answer_is_the_whole_one(served, plain):
    body = {"messages": QUESTION, "max_tokens": 80, "temperature": 0, "stream": True, "guided_json": SCHEMA}
    with httpx.stream("POST", served.base_url + "/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == _expected(plain, StructuredOutput(json=SCHEMA)).text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_take_structured_output_too(served, plain):
    prompt = plain.encode("The answer: ")
    want = _expected(plain, StructuredOutput(regex="[0-9]{4}"), messages=prompt, chat=False, max_tokens=10)
    r = httpx.post(served.base_url + "/completions", timeout=60, json={
        "prompt": "The answer: ", "max_tokens": 10, "temperature": 0, "guided_regex": "[0-9]{4}"})
    assert r.json()["choices"][0]["text"] == want.text and regex.fullmatch("[0-9]{4}", want.text)


def test_a_sampled_structured_answer_is_the_plain_targets_sample_by_seed(served, plain):
    spec = StructuredOutput(json=SCHEMA)
    prompt = plain.prompt_encoder.encode_chat(QUESTION, add_generation_prompt=True)
    for seed in range(3):
        want = plain.generate([prompt], SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed,
                                                       structured=spec))[0]
        got = _chat(served, temperature=1.0, seed=seed, guided_json=SCHEMA).json()["choices"][0]["message"]
        assert got["content"] == want.text and set(json.loads(want.text)) == {"tag", "n"}


# --- tool_choice that forces calls ------------------------------------------------------------------------------

def test_a_named_tool_choice_makes_the_answer_that_functions_call(served, plain):
    want = _expected(plain, StructuredOutput(json=WEATHER), tools=CALLABLE)
    choice = served.client().chat.completions.create(
        model="tiny-qwen3", messages=QUESTION, tools=CALLABLE, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", want.text)
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    # OpenAI's: a call the request forced by name "stop"s; no content beside it
    assert choice.finish_reason == "stop" and choice.message.content is None and call.id.startswith("call_")


def test_a_named_calls_arguments_stream_as_the_model_writes_them_and_a_cut_call_stays_a_call(served, plain):
    """As OpenAI's: the call's first delta names it, the next ones carry pieces of its arguments; an answer cut by
    max_tokens is the call with its arguments cut."""
    want = _expected(plain, StructuredOutput(json=WEATHER), tools=CALLABLE)
    body = {"model": "tiny-qwen3", "messages": QUESTION, "tools": CALLABLE, "max_tokens": 80, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    deltas = [c.choices[0].delta for c in served.client().chat.completions.create(stream=True, **body) if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert len(calls) > 2 and {t.index for t in calls} == {0} and not "".join(d.content or "" for d in deltas)
    assert (calls[0].id.startswith("call_"), calls[0].type, calls[0].function.name) == (True, "function",
                                                                                        "get_weather")
    assert all((t.id, t.type, t.function.name) == (None, None, None) for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == want.text
    with served.client().chat.completions.stream(**body) as stream:  # the SDK's helper puts them together
        (call,) = stream.get_final_completion().choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", want.text)
    cut = _expected(plain, StructuredOutput(json=WEATHER), tools=CALLABLE, max_tokens=6)
    choice = served.client().chat.completions.create(**body | {"max_tokens": 6}).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.arguments == cut.text


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_makes_calls_of_the_tools_streamed_and_not(served, plain, parallel):
    limit = None if parallel else 1
    want = _expected(plain, StructuredOutput(json=forced_call_schema(
        [t for t in CALLABLE], None, limit)), tools=CALLABLE)
    calls = [(c["name"], c["parameters"]) for c in json.loads(want.text)]
    assert 1 <= len(calls) <= (limit or 99)
    body = {"messages": QUESTION, "tools": CALLABLE, "tool_choice": "required", "max_tokens": 80, "temperature": 0,
            "parallel_tool_calls": parallel}
    choice = served.client().chat.completions.create(model="tiny-qwen3", **body).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    # streamed: each call's first delta names it, its arguments come in pieces (as OpenAI streams them); the SDK's
    # helper puts them together
    streamed = served.client().chat.completions.create(model="tiny-qwen3", stream=True, **body)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    pieces = [t for d in deltas for t in d.tool_calls or ()]
    sent = {}
    for t in pieces:
        name, arguments = sent.get(t.index, (None, ""))
        sent[t.index] = (name or t.function.name, arguments + (t.function.arguments or ""))
    assert [(name, json.loads(arguments)) for _, (name, arguments) in sorted(sent.items())] == calls
    assert len(pieces) > len(calls) and not "".join(d.content or "" for d in deltas)
    with served.client().chat.completions.stream(model="tiny-qwen3", **body) as stream:
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final] == calls


def test_the_responses_api_streams_required_calls_arguments_and_a_cut_one_is_incomplete(served, plain):
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in CALLABLE]
    body = {"input": QUESTION, "tools": tools, "tool_choice": "required", "max_output_tokens": 80, "temperature": 0}
    text = _expected(plain, StructuredOutput(json=forced_call_schema(CALLABLE, None, None)), tools=CALLABLE).text
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    with httpx.stream("POST", served.base_url + "/responses", timeout=60, json=body | {"stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    items = events[-1]["response"]["output"]
    assert [(i["name"], json.loads(i["arguments"]), i["status"]) for i in items] == [(n, a, "completed")
                                                                                     for n, a in want]
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > len(want) and "".join(e["delta"] for e in deltas) == "".join(i["arguments"] for i in items)
    # cut in the first call's arguments (a character a token): that call, incomplete, its arguments cut
    inside = text.index('"parameters"') + 16
    cut = httpx.post(served.base_url + "/responses", timeout=60, json=body | {"max_output_tokens": inside}).json()
    assert cut["status"] == "incomplete" and [(i["type"], i["status"]) for i in cut["output"]] == [
        ("function_call", "incomplete")]
    assert items[0]["arguments"].startswith(cut["output"][0]["arguments"])


def test_forced_calls_need_no_tool_call_parser_and_name_a_tool(served):
    r = _chat(served, tools=CALLABLE, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and "none of the tools" in r.json()["error"]["message"]
    r = _chat(served, tool_choice="required")
    assert r.status_code == 400 and "needs tools" in r.json()["error"]["message"]
    r = _chat(served, tools=TOOLS, tool_choice="required", guided_regex="a")
    assert r.status_code == 400 and "one structure at a time" in r.json()["error"]["message"]


def test_the_responses_api_takes_text_format_and_a_named_tool_choice(served, plain):
    form = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    r = httpx.post(served.base_url + "/responses", timeout=60, json={
        "input": QUESTION, "text": {"format": form}, "max_output_tokens": 80, "temperature": 0}).json()
    assert r["output"][0]["content"][0]["text"] == _expected(plain, StructuredOutput(json=SCHEMA)).text
    assert r["text"] == {"format": form} and r["status"] == "completed"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = httpx.post(served.base_url + "/responses", timeout=60, json={
        "input": QUESTION, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80, "temperature": 0}).json()
    want = _expected(plain, StructuredOutput(json=WEATHER), tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}])
    assert [(i["type"], i["name"], i["arguments"]) for i in r["output"]] == [("function_call", "get_weather",
                                                                                want.text)]
    with httpx.stream("POST", served.base_url + "/responses", timeout=60, json={
            "input": QUESTION, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 80, "temperature": 0, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == want.text  # as the model writes them
    assert [e["type"] for e in events if e["type"].startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"]
    (item,) = events[-1]["response"]["output"]

    def _unnamed(i: dict) -> dict:  # (each response names its items afresh)
        return {k: v for k, v in i.items() if k not in ("id", "call_id")}

    assert _unnamed(item) == _unnamed(r["output"][0]) and item["status"] == "completed"
    cut = httpx.post(served.base_url + "/responses", timeout=60, json={
        "input": QUESTION, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 6, "temperature": 0}).json()
    assert cut["status"] == "incomplete" and [(i["status"], i["arguments"]) for i in cut["output"]] == [
        ("incomplete", want.text[:len(cut["output"][0]["arguments"])])] and cut["output"][0]["arguments"]


# --- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, says", [
    ({"guided_regex": "[a-"}, "guided_regex", "the regex does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format", "does not compile"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar", "the grammar does not compile"),
], ids=["regex", "schema", "lark"])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(served, body, param, says):
    r = _chat(served, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"].startswith(f"{param}: ") and says in r.json()["error"]["message"]
    assert served.wait_idle()


@pytest.mark.parametrize("body, says", [
    ({"response_format": {"type": "yaml"}}, "type must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "json_schema must be an object holding the schema"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json and guided_regex: an answer takes one structure"),
    ({"guided_choice": []}, "choice must be a non-empty list"),
    ({"structured_outputs": {"structural_tag": {}}}, "structural_tag: not supported"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined with structured output"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens cannot be combined with structured output"),
])
def test_malformed_or_clashing_requests_are_400s(served, body, says):
    r = _chat(served, **body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_a_grammar_that_fails_while_decoding_is_that_requests_500_and_the_server_serves_on(served):
    r = _chat(served, guided_grammar='start: "a"+ start', max_tokens=40)
    assert r.status_code == 500 and r.json()["error"]["message"].startswith(
        "the request's grammar failed while decoding: parser error: Too many items")
    assert served.wait_idle() and _chat(served, max_tokens=4).status_code == 200


def test_responses_errors_name_text_format(served):
    r = httpx.post(served.base_url + "/responses", timeout=60, json={
        "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    assert r.json()["error"]["message"].startswith("text.format: the json does not compile")


# --- beside a reasoning parser: the model reasons freely, the structure holds its content ------------------------

THOUGHT = "I will look."
THINKING = f'<think>{THOUGHT}</think>{{"city": "Paris", "days": 2}}'


@pytest.fixture(scope="module")
def thinking_dirs(tmp_path_factory):
    """A target trained to think before its JSON."""
    return trained_to_answer(tmp_path_factory.mktemp("thinker"), QUESTION, THINKING)


@pytest.fixture(scope="module")
def thinker(thinking_dirs):
    """The thinking target served with qwen3's reasoning parser, and its plain oracle."""
    server = start_server(_engine(thinking_dirs), reasoning=reasoning_parser("qwen3"))
    yield server, _engine(thinking_dirs, speculative=False)
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_thinking_models_structured_answer_reasons_freely_and_its_content_matches(thinker, stream):
    served, plain = thinker
    want = _expected(plain, StructuredOutput(json=WEATHER, reasoning="qwen3"))
    assert want.text == THINKING  # its own answer, which the grammar allows
    form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    body = {"messages": QUESTION, "max_tokens": 80, "temperature": 0, "response_format": form}
    if stream:
        with httpx.stream("POST", served.base_url + "/chat/completions", json=body | {"stream": True}, timeout=60) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
        message = {k: "".join(d.get(k) or "" for d in deltas) for k in ("reasoning", "content")}
    else:
        message = _chat(served, response_format=form).json()["choices"][0]["message"]
    assert message["reasoning"] == THOUGHT and json.loads(message["content"]) == {"city": "Paris", "days": 2}
    # without the reasoning in its grammar the answer opens with "{": the content is then the structure alone
    alone = _expected(plain, StructuredOutput(json=WEATHER))
    assert alone.text.startswith("{") and alone.text != want.text


def test_a_response_cut_inside_its_reasoning_tag_is_an_incomplete_empty_message(thinker):
    served, _ = thinker
    r = httpx.post(served.base_url + "/responses", timeout=60, json={"input": QUESTION, "max_output_tokens": 7,
                                                                    "temperature": 0}).json()
    assert r["status"] == "incomplete" and [(i["type"], i["status"]) for i in r["output"]] == [
        ("message", "incomplete")]


def test_a_thinking_models_forced_call_follows_its_reasoning(thinker):
    served, plain = thinker
    want = _expected(plain, StructuredOutput(json=WEATHER, reasoning="qwen3"), tools=CALLABLE)
    choice = served.client().chat.completions.create(
        model="tiny-qwen3", messages=QUESTION, tools=CALLABLE, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert want.text.startswith(f"<think>{choice.message.reasoning}</think>")
    assert call.function.arguments == want.text.split("</think>", 1)[1] and choice.message.content is None


def test_a_prompt_that_closed_the_reasoning_leaves_the_answer_content_held_by_the_structure(thinking_dirs):
    """deepseek_r1's reasoning is the prompt's to open; a continued assistant message that closed it (as a template
    that turns thinking off writes it) leaves the answer content, as vLLM reads the prompt's last tag."""
    server = start_server(_engine(thinking_dirs), reasoning=reasoning_parser("deepseek_r1"))
    try:
        messages = QUESTION + [{"role": "assistant", "content": f"<think>{THOUGHT}</think>"}]
        form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        r = _chat(server, messages=messages, continue_final_message=True, add_generation_prompt=False,
                  response_format=form)
        plain = _engine(thinking_dirs, speculative=False)
        want = _expected(plain, StructuredOutput(json=WEATHER), messages=messages, add_generation_prompt=False,
                         continue_final_message=True)
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == want.text and json.loads(want.text) == {"city": "Paris", "days": 2}
        assert "reasoning" not in choice["message"] and choice["finish_reason"] == "stop"
    finally:
        server.stop()


# --- gpt-oss: forced calls in harmony's own form ---------------------------------------------------------------------

HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>")
HARMONY_ARGUMENTS = '{"city": "Oslo", "days": 3}'
HARMONY_CALL = ("<|channel|>analysis<|message|>I will look.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.get_weather <|constrain|>json<|message|>{HARMONY_ARGUMENTS}<|call|>")


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """A target trained to call as gpt-oss does, in harmony's special tokens, served with gpt-oss's parsers (a
    gpt-oss target's defaults); its plain oracle."""
    dirs = trained_to_answer(tmp_path_factory.mktemp("harmony"), QUESTION, HARMONY_CALL, HARMONY_TOKENS)
    server = start_server(_engine(dirs), reasoning=reasoning_parser("gpt_oss"), tool_parser=tool_call_parser("gpt_oss"))
    yield server, _engine(dirs, speculative=False)
    server.stop()


@pytest.mark.parametrize("tool_choice, finish", [({"type": "function", "function": {"name": "get_weather"}}, "stop"),
                                                 ("required", "tool_calls")], ids=["named", "required"])
def test_a_gpt_oss_forced_call_is_harmonys_commentary_message_to_the_function(harmony, tool_choice, finish):
    """gpt-oss is trained to call a function in a commentary message addressed to it, after its analysis: a forced
    call is held to that form (not JSON in its final channel), and the target's own call is the answer."""
    served, plain = harmony
    names = ["get_weather"] if finish == "stop" else ["get_weather", "get_time"]
    spec = StructuredOutput(calls={t["function"]["name"]: t["function"]["parameters"] for t in CALLABLE
                                   if t["function"]["name"] in names}, reasoning="gpt_oss")
    want = _expected(plain, spec, tools=CALLABLE, max_tokens=160)
    assert want.finish_reason == "stop"  # its own call, which the grammar allows, whole:
    assert want.token_ids == _expected(plain, None, tools=CALLABLE, max_tokens=160).token_ids
    body = {"model": "tiny-qwen3", "messages": QUESTION, "tools": CALLABLE, "max_tokens": 160, "temperature": 0,
            "tool_choice": tool_choice}
    choice = served.client().chat.completions.create(**body).choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", HARMONY_ARGUMENTS)
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == ("I will look.", None, finish)
    # streamed: the reasoning, then the call named in its first delta, its arguments in the next ones
    deltas = [c.choices[0].delta for c in served.client().chat.completions.create(stream=True, **body) if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "I will look."
    assert [t.function.name for t in calls if t.function.name] == ["get_weather"] and len(calls) > 2
    assert "".join(t.function.arguments for t in calls) == HARMONY_ARGUMENTS
    assert not "".join(d.content or "" for d in deltas)


def test_a_gpt_oss_forced_call_cut_short_is_a_cut_call_and_the_responses_api_makes_it_a_function_call(harmony):
    served, plain = harmony
    body = {"model": "tiny-qwen3", "messages": QUESTION, "tools": CALLABLE, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    n = len(plain.tokenizer.encode(HARMONY_CALL, add_special_tokens=False)) - 5  # cut inside the arguments
    choice = served.client().chat.completions.create(max_tokens=n, **body).choices[0]
    assert choice.finish_reason == "length" and HARMONY_ARGUMENTS.startswith(
        choice.message.tool_calls[0].function.arguments) and choice.message.tool_calls[0].function.arguments
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = httpx.post(served.base_url + "/responses", timeout=60, json={
        "input": QUESTION, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 160, "temperature": 0}).json()
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in r["output"]] == [
        ("reasoning", None, None), ("function_call", "get_weather", HARMONY_ARGUMENTS)]


def test_a_function_name_harmony_cannot_address_keeps_the_json_form(harmony):
    """harmony's recipient holds letters, digits, '_', '.' and '-': a tool named otherwise ("get weather") is called
    in JSON in the final channel, as without harmony's form (it was a 500)."""
    served, plain = harmony
    tools = [{"type": "function", "function": {"name": "get weather", "parameters": WEATHER}}]
    r = httpx.post(served.base_url + "/chat/completions", timeout=60, json={
        "messages": QUESTION, "tools": tools, "tool_choice": "required", "max_tokens": 160, "temperature": 0})
    want = _expected(plain, StructuredOutput(json=forced_call_schema(tools, None, None), reasoning="gpt_oss"),
                     tools=tools, max_tokens=160)
    assert r.status_code == 200, r.text
    # the answer is plain decoding's under the JSON form (here it reasons on till max_tokens: away from its training)
    message = r.json()["choices"][0]["message"]
    thought, content, _ = ChatAnswerSplitter(reasoning_parser("gpt_oss"), None).split(want.text)
    assert (message.get("reasoning"), message["content"]) == (thought, content)


def test_a_gpt_oss_call_the_model_chooses_streams_its_arguments_as_it_writes_them(harmony):
    """tool_choice auto: the call is the answer's last message, running to its end; its arguments come in pieces as
    the model writes them (they came whole with the answer's last delta), the whole answer's call the same."""
    served, plain = harmony
    body = {"model": "tiny-qwen3", "messages": QUESTION, "tools": CALLABLE, "max_tokens": 160, "temperature": 0}
    assert _expected(plain, None, tools=CALLABLE, max_tokens=160).finish_reason == "stop"
    choice = served.client().chat.completions.create(**body).choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", HARMONY_ARGUMENTS)]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == ("I will look.", None,
                                                                                       "tool_calls")
    deltas = [c.choices[0].delta for c in served.client().chat.completions.create(stream=True, **body) if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in calls if t.function.name] == ["get_weather"] and len(calls) > 2
    assert "".join(t.function.arguments for t in calls) == HARMONY_ARGUMENTS
