"""What OpenAI and vLLM clients send beyond the basics: the first chat chunk comes with the first output (benchmark
clients time the first token from it), whole numbers as floats, vLLM's chat-template fields (the tokenizer's own
apply_chat_template is the oracle), text parts, CORS for browser clients, and vLLM sampling extensions refused."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.app import create_app
from tests.server.conftest import MODEL

CHAT = {"model": MODEL, "temperature": 0, "max_tokens": 8}


def _answer(oracle, ids, max_tokens=8) -> str:
    return oracle.generate([ids], SamplingParams(max_new_tokens=max_tokens))[0].text


def _local(app) -> TestClient:
    """A client of the app as one on this machine calls it (Host: localhost; a loopback server answers no other)."""
    return TestClient(app, base_url="http://localhost")


def test_the_first_chat_chunk_waits_for_the_first_output(server, monkeypatch):
    """vLLM's bench times the first token at the first chunk with choices: a role chunk sent on arrival made a prompt's
    prefill look free and put it in the first inter-token gap."""
    engine, first_output = server.engine, []
    real = engine.step

    def step():
        time.sleep(0.3)  # a long prefill
        result = real()
        if result.updated and not first_output:
            first_output.append(time.monotonic())
        return result

    monkeypatch.setattr(engine, "step", step)
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        arrived = time.monotonic()
        list(lines)
    assert '"role":"assistant"' in first.replace(" ", "")
    assert first_output and arrived >= first_output[0]


@pytest.mark.parametrize("field, value, ok", [("max_tokens", 6.0, True), ("seed", 42.0, True), ("n", 1.0, True),
                                              ("max_tokens", 6.5, False), ("max_tokens", "6", False)])
def test_whole_numbers_sent_as_floats_are_integers(server, field, value, ok):
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, field: value}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == (200 if ok else 400), r.text
    if ok and field == "max_tokens":
        assert r.json()["usage"]["completion_tokens"] == 6


def test_continue_final_message_goes_on_with_the_assistants_text(server, oracle):
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1, 2, 3"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    ids = oracle.tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == _answer(oracle, ids)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    new_turn = httpx.post(server.base_url + "/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
    assert new_turn.json()["usage"]["prompt_tokens"] == len(ids) + 1  # the template's generation prompt, ">"


def test_a_chat_template_and_its_kwargs_render_the_prompt_where_the_server_trusts_them(server, oracle):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if shout %}!{% endif %}"
    messages = [{"role": "user", "content": "hi"}]
    untrusted = httpx.post(server.base_url + "/chat/completions", timeout=60,
                           json={**CHAT, "messages": messages, "chat_template": template})
    assert untrusted.status_code == 400 and untrusted.json()["error"]["param"] == "chat_template"
    trusted = _local(create_app(server.loop, MODEL, trust_request_chat_template=True))
    for kwargs in ({}, {"shout": True}):
        body = {**CHAT, "messages": messages, "chat_template": template, "chat_template_kwargs": kwargs}
        r = trusted.post("/v1/chat/completions", json=body)
        ids = oracle.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                   add_generation_prompt=True, **kwargs)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids) == 4 + len(kwargs)
        assert r.json()["choices"][0]["message"]["content"] == _answer(oracle, ids)


def test_reasoning_effort_reaches_the_template_as_its_variable(server, oracle):
    """OpenAI's reasoning_effort is the chat template's variable of that name (gpt-oss's template writes it in its
    system message); chat_template_kwargs say it first where they do, as vLLM passes them."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if reasoning_effort is defined %}" \
               "{{ reasoning_effort }}{% endif %}"
    messages = [{"role": "user", "content": "hi"}]
    trusted = _local(create_app(server.loop, MODEL, trust_request_chat_template=True))
    for extra, effort in (({}, None), ({"reasoning_effort": "low"}, "low"),
                          ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high")):
        body = {**CHAT, "messages": messages, "chat_template": template, **extra}
        r = trusted.post("/v1/chat/completions", json=body)
        ids = oracle.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                   add_generation_prompt=True,
                                                   **({"reasoning_effort": effort} if effort else {}))
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids) == 4 + len(effort or "")
        assert r.json()["choices"][0]["message"]["content"] == _answer(oracle, ids)
        counted = trusted.post("/tokenize", json={k: v for k, v in body.items() if k != "max_tokens"})
        assert counted.status_code == 200 and counted.json()["tokens"] == ids, counted.text
    bogus = trusted.post("/v1/chat/completions", json={**CHAT, "messages": messages, "reasoning_effort": "lots"})
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "reasoning_effort"


def test_a_predicted_output_is_drafted_and_usage_counts_what_the_answer_repeated(server, oracle):
    """OpenAI's predicted outputs: the answer is the target's own whatever the prediction (greedy: its tokens); one
    that is the answer but for an edit is drafted (the answer takes fewer steps than without), and usage counts the
    prediction's tokens the answer repeated and the rest; a prediction of the wrong type is refused by name."""
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True}
    ids = oracle.encode_chat(body["messages"])
    answer = _answer(oracle, ids, 40)
    # (the character tokenizer: a character a token; the answer's special tokens write none)
    size = len(oracle.tokenizer.encode(answer, add_special_tokens=False))
    edited = answer[:12] + "".join(c for c in "abcdefghij" if c not in answer)[:3] + answer[15:]
    plain = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    for prediction, rejected in ((answer, 0), (edited, 3), ([{"type": "text", "text": edited[:20]},
                                                             {"type": "text", "text": edited[20:]}], 3)):
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={**body, "prediction": {"type": "content", "content": prediction}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == answer
        details = r.json()["usage"]["completion_tokens_details"]
        assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (size - rejected,
                                                                                                  rejected)
        assert r.json()["choices"][0]["acceptance"]["num_steps"] < plain["choices"][0]["acceptance"]["num_steps"] / 2
    assert "accepted_prediction_tokens" not in plain["usage"]["completion_tokens_details"]
    with httpx.stream("POST", server.base_url + "/chat/completions", timeout=60, json={
            **body, "prediction": {"type": "content", "content": edited}, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == answer
    assert events[-1]["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 3
    for prediction, param in (({"type": "audio", "content": "x"}, "prediction"),
                              ({"type": "content", "content": "x" * 300}, "prediction")):  # past the context's 256
        bad = httpx.post(server.base_url + "/chat/completions", timeout=60, json={**body, "prediction": prediction})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(param), bad.text
    assert "maximum context length" in bad.json()["error"]["message"]


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(server, oracle):
    parts = [{"type": "text", "text": "foo"}, {"type": "text", "text": "bar"}]
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**CHAT, "messages": [{"role": "user", "content": parts}]})
    ids = oracle.encode_chat([{"role": "user", "content": "foo\nbar"}])
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == _answer(oracle, ids)
    # vLLM's other text parts: plain strings, the Responses API's input_text / output_text, an assistant's refusal
    for parts in (["foo", "bar"], [{"type": "input_text", "text": "foo"}, {"type": "output_text", "text": "bar"}],
                  ["foo", {"type": "refusal", "refusal": "bar"}]):
        again = httpx.post(server.base_url + "/chat/completions", timeout=60,
                           json={**CHAT, "messages": [{"role": "user", "content": parts}]})
        assert again.status_code == 200 and again.json()["usage"] == r.json()["usage"], (parts, again.text)


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt left true
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # user last
    ({"echo": True}, "echo"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),  # vLLM's 0 is the prompt's own logprobs, not "off"
    ({"chat_template_kwargs": {"return_tensors": "pt"}}, "chat_template_kwargs"),  # the call's own options
    ({"chat_template_kwargs": {"sanitize_control_tokens": True}}, "chat_template_kwargs"),  # of later releases too
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
])
def test_what_would_change_the_answer_unseen_is_refused(server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**CHAT, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param, words", [
    # a list where a string or a list goes: the list's own fault, not that it is no string
    ({"stop": ["a"] * 257}, "stop", "at most 256 items"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", ""),
    ({"stop": 5}, "stop", "valid string"),  # neither branch's type: the first branch's word
])
def test_a_field_of_either_type_is_refused_for_what_is_wrong_with_the_value_sent(server, body, param, words):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**CHAT, "messages": [{"role": "user", "content": "hi"}], **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text


def test_neutral_vllm_extensions_pass(server):
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}], "bad_words": [], "allowed_token_ids": None,
            "echo": False, "add_generation_prompt": True, "stream_options": None, "n": 2,
            "prompt_logprobs": None, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).status_code == 200


def test_a_request_without_a_model_is_for_the_served_one_as_vllm_reads_it(server):
    chat = {k: v for k, v in CHAT.items() if k != "model"}
    for body in ({**chat, "messages": [{"role": "user", "content": "hi"}]},
                 {**chat, "model": None, "messages": [{"role": "user", "content": "hi"}]},
                 {**chat, "model": "", "messages": [{"role": "user", "content": "hi"}]}):
        r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


def test_tokenize_counts_as_the_completion_routes_do_and_detokenize_reverses_it(server, tiny_dirs):
    from transformers import AutoTokenizer

    from dflash_trt import __version__

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    text = "the quick brown fox"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    used = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                      timeout=60).json()["usage"]["prompt_tokens"]
    assert r["tokens"] == tok(text)["input_ids"] and r["count"] == used == len(r["tokens"])
    assert r["max_model_len"] == 256
    messages = [{"role": "user", "content": "hi there"}]
    # vLLM's TokenizeChatRequest reads no sampling field: one a chat completion would refuse is not read
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "temperature": 5}, timeout=30).json()
    used = httpx.post(server.base_url + "/chat/completions", json={"messages": messages, "max_tokens": 1},
                      timeout=60).json()["usage"]["prompt_tokens"]
    assert r["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]) and r["count"] == used
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok(text)["input_ids"]}, timeout=30)
    assert r.json() == {"prompt": text}
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": messages}, None),
                              ("/tokenize", {}, None),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model")):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_add_special_tokens_is_vllms_on_tokenize_completions_and_chat(tiny_dirs):
    """A tokenizer that writes a BOS (as Llama's): text prompts get it unless add_special_tokens is false;
    conversations (whose template writes it) get it a second time only where add_special_tokens is true."""
    from tokenizers import processors

    from dflash_trt.engine.prompt_encoder import PromptEncoder
    from tests.server.conftest import start_server, tiny_engine

    engine = tiny_engine(tiny_dirs, max_batch_size=2)
    engine.tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    engine.prompt_encoder = PromptEncoder(engine.tokenizer, engine.max_model_len)
    server = start_server(engine)
    try:
        def tokens(**body) -> list[int]:
            return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]

        def used(route: str, **body) -> int:
            r = httpx.post(f"{server.base_url}/{route}", json={**body, "max_tokens": 1}, timeout=60)
            return r.json()["usage"]["prompt_tokens"]

        text, chat = "the fox", [{"role": "user", "content": "hi"}]
        assert tokens(prompt=text) == [1, *tokens(prompt=text, add_special_tokens=False)]
        assert tokens(prompt=text)[1:] == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert used("completions", prompt=text, add_special_tokens=False) == used("completions", prompt=text) - 1
        assert tokens(messages=chat, add_special_tokens=True) == [1, *tokens(messages=chat)]
        assert used("chat/completions", messages=chat, add_special_tokens=True) == len(tokens(messages=chat)) + 1
    finally:
        server.stop()


def test_tools_with_tool_choice_none_reach_the_chat_template_and_the_answer_is_text(tiny_dirs):
    """vLLM's reading: the template renders the tools (as transformers' apply_chat_template(tools=...) does), and
    nothing parses the answer for calls. The deprecated functions / function_call "none" say the same."""
    from tests.server.conftest import start_server, tiny_engine

    engine = tiny_engine(tiny_dirs, max_batch_size=2)
    engine.tokenizer.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.description }}]"
                                      "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m['content'] }}{% for c in "
                                      "m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
                                      "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}"
                                      "{% endfor %}>")
    engine.prompt_encoder.tokenizer = engine.tokenizer
    server = start_server(engine)
    try:
        messages = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": {}}}
        want = engine.tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
        assert engine.tokenizer.decode(want).startswith("[get_time:now]")  # the premise: the template reads tools
        r = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": [tool]}, timeout=30).json()
        assert r["tokens"] == list(want), r  # vLLM's /tokenize renders tools without a tool_choice
        for extra in ({"tools": [tool], "tool_choice": "none"},
                      {"functions": [tool["function"]], "function_call": "none"}):
            r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                           json={"messages": messages, "max_tokens": 3, **extra}).json()
            assert r["usage"]["prompt_tokens"] == len(want) and isinstance(r["choices"][0]["message"]["content"], str)
        # an agent's last turn: its history of calls and their results, answered in text
        call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
        as_template_takes = [*messages, {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
        want = engine.tokenizer.apply_chat_template(as_template_takes, tools=[tool], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
        assert "get_time(Oslo)" in engine.tokenizer.decode(want) and "#c1" in engine.tokenizer.decode(want)
        r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [tool]}, timeout=30).json()
        assert r["tokens"] == list(want), r
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"messages": history, "tools": [tool], "tool_choice": "none", "max_tokens": 3}).json()
        assert r["usage"]["prompt_tokens"] == len(want), r
        # the deprecated forms of that history: an assistant's function_call and a function's named answer
        deprecated = [*messages, {"role": "assistant", "content": None, "function_call": call["function"]},
                      {"role": "function", "name": "get_time", "content": "12:00"}]
        as_template_takes = [*messages, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "name": "get_time", "content": "12:00"}]  # templates know tools' answers, not functions'
        want = engine.tokenizer.apply_chat_template(as_template_takes, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
        assert "get_time(Oslo)" in engine.tokenizer.decode(want) and "<tool>12:00" in engine.tokenizer.decode(want)
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"messages": deprecated, "function_call": "none", "max_tokens": 3}).json()
        assert r["usage"]["prompt_tokens"] == len(want), r
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"messages": [*messages, {"role": "function", "content": "12:00"}], "max_tokens": 3})
        assert r.status_code == 400 and "name of the function" in r.json()["error"]["message"], r.text
    finally:
        server.stop()


def test_browsers_may_call_the_api_only_from_the_origins_allowed(server):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    closed = _local(create_app(server.loop, MODEL))
    assert "access-control-allow-origin" not in closed.options("/v1/chat/completions", headers=preflight).headers
    opened = _local(create_app(server.loop, MODEL, allowed_origins=("http://localhost:3000",)))
    r = opened.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = opened.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert opened.get("/v1/models", headers={"Origin": "http://localhost:3000"}).json()["data"][0]["id"] == MODEL


def test_logit_bias_and_allowed_token_ids_reach_the_runtime(server, tiny_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for extra in ({"logit_bias": {"40": 100}}, {"allowed_token_ids": [40]}):
        r = httpx.post(server.base_url + "/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode([40] * 4), (extra, r.text)


def test_penalties_reach_the_runtime(server, oracle):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty shape the answer as the runtime's
    generate under them (itself transformers' decoding under them: tests/engine/test_logits_processors.py)."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3}
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = httpx.post(server.base_url + "/completions", json={**body, **penalties}, timeout=60).json()
    plain = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    want = oracle.generate([oracle.encode(body["prompt"])], SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                                           **penalties))[0]
    assert got["choices"][0]["text"] == want.text != plain["choices"][0]["text"]


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_bodies_not_sent_as_json_are_refused(server, kind):
    """What a web page may send any server without a CORS preflight must not make this one generate (None: a body of
    no type, as a page's fetch of a Blob sends; it was read as JSON)."""
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL
    headers = {"content-type": kind} if kind else {}
    r = httpx.post(server.base_url + "/completions", content=body, headers=headers, timeout=60)
    assert "content-type" not in r.request.headers or kind
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    sent = httpx.post(server.base_url + "/completions", content=body,
                      headers={"content-type": "application/json; charset=utf-8"}, timeout=60)
    assert sent.status_code == 200


def test_a_broken_request_chat_template_is_named_and_messages_stay_template_input(server):
    trusted = _local(create_app(server.loop, MODEL, trust_request_chat_template=True))
    broken = trusted.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi"}],
                                                         "chat_template": "{% for %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**CHAT, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
