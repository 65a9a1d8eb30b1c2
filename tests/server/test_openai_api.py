"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server:
greedy answers equal the engine's generate() (alone and under concurrent load), disconnects free
their rows, bad input gets an OpenAI-style error and the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from dflash_trt.sampling_params import SamplingParams
from tests.server.conftest import MODEL, start_server, tiny_engine

PROMPTS = [f"prompt {i}: the quick brown fox {'jumps ' * (i % 5)}" for i in range(32)]


def expected(oracle, prompts, max_tokens, chat=False):
    ids = [oracle.encode(p, chat=chat) for p in prompts]
    return oracle.generate(ids, SamplingParams(max_new_tokens=max_tokens))


def test_completion_equals_generate_with_usage_and_acceptance(server, oracle, tiny_dirs):
    want = expected(oracle, PROMPTS[:1], 24)[0]
    drafted = expected(tiny_engine(tiny_dirs, max_batch_size=8), PROMPTS[:1], 24)[0]  # the server's own engine's twin
    assert drafted.token_ids == want.token_ids
    resp = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert resp.usage.completion_tokens == want.num_tokens
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    acc = choice.model_extra["acceptance"]
    # alone on the server, the request runs exactly the steps generate() ran
    assert acc["num_steps"] == len(drafted.acceptance_lengths) and acc["tau"] == pytest.approx(drafted.tau)
    assert acc["total_draft_tokens"] == sum(drafted.draft_lens)
    assert 0 <= acc["acceptance_rate"] <= 1


def test_streamed_completion_concatenates_to_the_same_text(server, oracle):
    want = expected(oracle, PROMPTS[1:2], 30)[0]
    chunks = list(server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.num_tokens
    assert all(c.usage is None for c in chunks[:-1])  # OpenAI: the last chunk alone carries usage


def test_chat_uses_the_chat_template_streaming_and_not(server, oracle):
    want = expected(oracle, ["hello there"], 20, chat=True)[0]
    client = server.client()
    messages = [{"role": "user", "content": "hello there"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          modalities=["text"], user="u1", metadata={"k": "v"})  # harmless fields
    assert resp.choices[0].message.content == want.text and resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.usage is None for c in chunks)  # usage only when stream_options.include_usage asks for it


def test_a_request_without_a_speculative_step_reports_no_tau(server, oracle):
    want = expected(oracle, PROMPTS[2:3], 1)[0]
    assert want.acceptance_lengths == []  # the prefill's token is the whole answer
    acc = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1,
                                             temperature=0).choices[0].model_extra["acceptance"]
    assert acc["num_steps"] == 0 and acc["tau"] is None and acc["acceptance_rate"] is None


def test_streamed_chunks_carry_no_usage_key_unless_asked(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as resp:
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)


def test_streamed_chunks_follow_openais_schema(server):
    """With stream_options.include_usage, OpenAI's chunks before the usage chunk carry `"usage": null`; a delta's
    role is a string when present (never null) and the last chunk's delta is empty."""
    for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi"})]:
        # Greedy: OpenAI's default temperature 1 samples, and a sampled end-of-text before 6 tokens failed this test
        body = {**body, "model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as resp:
            events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
        if path == "/chat/completions":
            deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
            assert all(None not in d.values() for d in deltas), deltas
            assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_its_chunks(server):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries its own choice's prompt
    and completion tokens so far; without include_usage it changes nothing."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]  # token ids: their lengths are the prompt counts
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    so_far = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i, usage = choice["index"], c["usage"]
        assert usage["prompt_tokens"] == len(prompts[i]) and usage["completion_tokens"] >= so_far[i]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        so_far[i] = usage["completion_tokens"]
        if choice["finish_reason"]:
            assert usage["completion_tokens"] == 5
    assert so_far == {0: 5, 1: 5} and chunks[-1]["usage"]["completion_tokens"] == 10
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=chat, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks and all("usage" not in c for c in chunks)


def test_stop_token_ids_end_the_answer_and_min_tokens_holds_them_off(server, oracle):
    want = expected(oracle, PROMPTS[5:6], 24)[0]
    i = next(i for i in range(2, len(want.token_ids)) if want.token_ids[i] not in want.token_ids[:i])
    stop_id = want.token_ids[i]
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id]})
    # vLLM: the answer stops at the id, which usage counts and the text leaves out (the stop token's text was kept)
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == i + 1
    assert resp.choices[0].stop_reason == stop_id  # vLLM's field: which stop ended it
    assert resp.choices[0].text == oracle.tokenizer.decode(want.token_ids[:i], skip_special_tokens=True)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=0, stream=True,
                                       extra_body={"stop_token_ids": [stop_id]})
    assert "".join(c.choices[0].text for c in stream if c.choices) == resp.choices[0].text
    resp = server.client().completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=10, temperature=0,
                                              extra_body={"min_tokens": 10, "ignore_eos": True})
    assert resp.usage.completion_tokens == 10
    # the stop id is masked until the answer holds i + 3 tokens (engine/test_logits_processors.py checks the tokens)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": i + 3})
    assert resp.usage.completion_tokens >= i + 3


def test_min_tokens_holds_off_stop_strings_that_end_in_their_text_streamed_or_not(server, oracle):
    from tests.engine.test_stop_check import _vllm_min_tokens_answer

    want = expected(oracle, PROMPTS[7:8], 40)[0]
    text = want.text
    stop = next(text[i:i + 2] for i in range(len(text))
                if text[i] != text[i + 1] and text.find(text[i:i + 2], i + 4) > 0)
    min_tokens = len(oracle.tokenizer.encode(text[:text.find(stop) + 2], add_special_tokens=False)) + 1
    ids, cut = _vllm_min_tokens_answer(oracle.tokenizer, want.token_ids, stop, min_tokens)
    assert len(cut) > text.find(stop)  # the premise: min_tokens holds the first occurrence
    client = server.client()
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 40, "temperature": 0, "stop": [stop]}
    resp = client.completions.create(**body, extra_body={"min_tokens": min_tokens})
    assert (resp.choices[0].text, resp.usage.completion_tokens, resp.choices[0].stop_reason) == (cut, len(ids), stop)
    assert client.completions.create(**body).choices[0].text == text[:text.find(stop)]  # without: the first one
    stream = list(client.completions.create(**body, stream=True, extra_body={"min_tokens": min_tokens}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == cut
    assert [c.choices[0].stop_reason for c in stream if c.choices[0].finish_reason] == [stop]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].stop_reason is None


def test_a_huge_top_k_keeps_every_token_and_fails_no_bystander(server):
    """top_k beyond the vocabulary is no top-k; it must not crash the engine step, which the other requests share."""
    client = server.client()
    bystander = iter(client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=60, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    next(bystander)  # it holds a row now
    for top_k in (2**63, 10**30):
        resp = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, seed=1, extra_body={"top_k": top_k})
        assert resp.usage.completion_tokens == 4 or resp.choices[0].finish_reason == "stop"
    rest = list(bystander)
    assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 60
    assert server.wait_idle()


def test_32_concurrent_streams_each_equal_generate(server, oracle):
    wants = expected(oracle, PROMPTS, 16)

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    start = time.monotonic()
    got = asyncio.run(run())
    assert time.monotonic() - start < 120
    assert got == [(w.text, w.finish_reason) for w in wants]
    assert server.wait_idle()


def test_a_server_that_drafts_trees_answers_like_generate(tiny_dirs, oracle):
    """Greedy streams under concurrent load equal plain greedy answers; a default (sampled, "match") request drafts
    trees too and comes back well-formed."""
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=8, max_draft_len=3, draft_tree={8: 5}))
    try:
        wants = expected(oracle, PROMPTS[:8], 16)

        async def one(client, prompt):
            resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            return resp.choices[0].text, resp.choices[0].model_extra["acceptance"]

        async def run():
            client = openai.AsyncOpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
            async with client:
                return await asyncio.gather(*(one(client, p) for p in PROMPTS[:8]))

        got = asyncio.run(run())
        assert [text for text, _ in got] == [w.text for w in wants]
        # 5 nodes a step (4 where the end of a request leaves one slot): more than K=3 chains would draft
        assert all(acc["total_draft_tokens"] > 3 * acc["num_steps"] for _, acc in got if acc["num_steps"] > 1)
        sampled = s.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, seed=3)
        assert sampled.usage.completion_tokens == 12 or sampled.choices[0].finish_reason == "stop"
        assert s.wait_idle()
    finally:
        s.stop()


@pytest.fixture
def slow_steps(server, monkeypatch):
    """At most ~20 speculative steps a second: an answer of 200 tokens surely still runs when its client leaves."""
    real = server.engine.runner.spec_step

    def slow(seqs, k):
        time.sleep(0.05)
        return real(seqs, k)

    monkeypatch.setattr(server.engine.runner, "spec_step", slow)


def test_a_burst_of_disconnects_leaves_no_row_in_use(server, slow_steps):
    disconnects = 'dflash_request_errors_total{status="499"}'
    before = scrape(server).get(disconnects, 0)
    client = server.client()
    streams = []
    for p in PROMPTS[:12]:  # 8 rows: 8 run, 4 wait
        s = client.completions.create(model=MODEL, prompt=p, max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        streams.append(s)
    for s in streams[:6]:
        next(iter(s))  # the first token arrived: the request holds a row
    for s in streams:
        s.close()
    assert server.wait_idle(15), "rows still in use after every client disconnected"
    deadline = time.monotonic() + 5
    while scrape(server).get(disconnects, 0) < before + 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(server).get(disconnects, 0) == before + 12  # each counted as an unstreamed request's is
    # and it keeps serving
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=4, temperature=0).choices[0].text is not None


def test_non_streaming_disconnect_frees_its_row(server, slow_steps):
    aborted = 'dflash_requests_total{finish_reason="abort"}'
    before = scrape(server).get(aborted, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", timeout=1.5,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    assert server.wait_idle(15)
    deadline = time.monotonic() + 5  # the row is freed first, then the loop reports the abort
    while scrape(server).get(aborted, 0) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(server)[aborted] == before + 1  # cancelled, not run to the end


BAD = [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),  # beyond max_model_len=256
    ({"model": MODEL, "prompt": "x" * 300, "max_tokens": 4}, 400, "prompt"),  # 300 chars = 300 tokens > 256
    ({"model": MODEL, "prompt": "x" * 2_000_000}, 400, "prompt"),  # refused before it is tokenized
    ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 999]}, 400, "prompt"),  # token id beyond the vocabulary (96)
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", 1]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop"),  # would match before any text
    ({"model": MODEL, "prompt": "hi", "stop": ["\n", ""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(257)]}, 400, "stop"),  # each is looked for
    ({"model": MODEL, "prompt": "hi", "stop": ["q" * 4000, "q" * 97]}, 400, "stop"),  # 4,097 characters together
    ({"model": "m" * 100_000, "prompt": "hi"}, 404, "model"),  # its 100,000 characters not echoed in full
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),  # strict: no truthy strings
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": "0.7"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": True}, 400, "top_p"),
    # features that would change the answer, refused instead of silently ignored
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # OpenAI's and vLLM's limit: 20
    ({"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),  # completions take a count
    ({"model": MODEL, "prompt": "hi", "top_logprobs": 3}, 400, "top_logprobs"),  # chat's field
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # a digit to isdigit()
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 2, "stop_token_ids": [40], "allowed_token_ids": [40]}, 400,
     "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": [1000000]}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": [5, -1]}, 400, "allowed_token_ids.1"),
    # min_tokens masks the stop tokens: with every token one, nothing could be chosen (it stopped at once)
    ({"model": MODEL, "prompt": "hi", "min_tokens": 5, "stop_token_ids": list(range(96))}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    # vLLM's sampling extensions that benchmark tools pass through, unless neutral
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),  # OpenAI's [-2, 2]
    ({"model": MODEL, "prompt": "hi", "min_tokens": 8, "max_tokens": 4, "ignore_eos": True}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [96]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ({"model": MODEL, "prompt": "hi", "skip_special_tokens": False}, 400, "skip_special_tokens"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a"}, 400, "guided_regex"),
    # OpenAI and vLLM: stream_options only with stream=true (a usage chunk asked for that never comes)
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # tools are for a chat template
    ({"model": MODEL, "prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "none"}, 400, "tools"),
]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD_CHAT = [
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),  # OpenAI: only with logprobs=true
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # tool_choice "auto"
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools.0.function.name"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),  # OpenAI would answer with an audio object too
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    # the chat request has no `prompt`: a conversation too long for the context is the messages' fault
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages"),
    # the deprecated spelling of tools
    ({**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({**CHAT, "functions": [{"name": "f", "parameters": {}}], "function_call": "auto"}, "functions"),
    ({**CHAT, "function_call": {"name": "f"}}, "function_call"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls.0.function"),  # a call names its function
    ({**CHAT, "messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]}, "messages.1.content"),
    ({**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
]


def test_each_bad_input_gets_its_error_and_the_server_keeps_serving(server):
    for body, status, param in BAD:
        r = httpx.post(server.base_url + "/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"], err
        assert len(err["message"]) < 1100  # what a client sent is quoted cut (a 10 MB field came back in full)
    r = httpx.post(server.base_url + "/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    # nested deeper than the parser recurses: still the client's malformed body, not a server error
    r = httpx.post(server.base_url + "/completions", content=b"[" * 100_000 + b"]" * 100_000, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    # an integer of more digits than Python converts: JSON all the same, refused as the body's fault
    r = httpx.post(server.base_url + "/completions", content=b'{"prompt": "hi", "max_tokens": 1%s}' % (b"0" * 5000),
                   timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"], r.text
    # Python's parser takes JavaScript's Infinity; no penalty may be infinite
    r = httpx.post(server.base_url + "/completions", content=b'{"prompt": "hi", "repetition_penalty": Infinity}',
                   timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    # JSON's \ud800 escape is valid JSON and decodes to a lone surrogate, which is no text a tokenizer takes: the
    # field is named, and the connection stays open for the next request
    with httpx.Client(base_url=server.base_url, timeout=30) as kept_alive:
        for path, body, param in (
                ("/completions", '{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 4}', "prompt"),
                ("/completions", '{"model": "%s", "prompt": ["ok", "\\ud800"], "max_tokens": 4}', "prompt.1"),
                ("/completions", '{"model": "%s", "prompt": "hi", "stop": "\\ud800", "max_tokens": 4}', "stop"),
                ("/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}',
                 "messages.0.content")):
            r = kept_alive.post(path, content=(body % MODEL).encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert "lone surrogate" in r.json()["error"]["message"]
        after = kept_alive.post("/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert after.status_code == 200
    r = httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for body, param in BAD_CHAT:
        r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        if len(str(body["messages"])) > 300:  # too long for the context: OpenAI's code for it
            assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3, temperature=0).usage.completion_tokens >= 1
    assert server.wait_idle()


def scrape(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_max_tokens_past_what_the_prompt_leaves_is_refused_in_vllms_words(server):
    """vLLM's serve answers 400 where prompt + max_tokens passes max_model_len, in words clients parse to ask again
    for what the context leaves (its _validate_input); what fits exactly is served."""
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 250, "ignore_eos": True, "temperature": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    prompt = len(server.engine.encode(PROMPTS[4]))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 250. This model's maximum context length is 256 "
        f"tokens and your request has {prompt} input tokens (250 > 256 - {prompt}).")
    r = httpx.post(server.base_url + "/completions", json={**body, "max_tokens": 256 - prompt}, timeout=60)
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 256, r.text
    assert choice["finish_reason"] == "length"


def test_null_fields_take_their_defaults(server):
    """OpenAI clients send null for what they leave unset."""
    body = {"model": MODEL, "prompt": PROMPTS[4], "temperature": None, "top_p": None, "n": None, "stream": None,
            "stop": None, "seed": None, "presence_penalty": None, "logprobs": None, "stream_options": None,
            "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # the completions default
    # but a null max_tokens means no limit: up to the context (256 here), as vLLM reads it
    r = httpx.post(server.base_url + "/completions", json={**body, "max_tokens": None}, timeout=60)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 256


def test_a_request_with_more_prompts_than_the_server_holds_is_a_400_not_a_retry(tiny_dirs):
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=1, max_queue_len=1))
    try:
        r = httpx.post(s.base_url + "/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 2" in r.text
        r = httpx.post(s.base_url + "/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2,
                                                          "temperature": 0}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        s.stop()


def test_models_health_and_metrics(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.head(server.url + "/health").status_code == 200
    before = scrape(server)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    after = scrape(server)
    gen = "dflash_generation_tokens_total"
    assert after[gen] - before.get(gen, 0) == resp.usage.completion_tokens
    assert after["dflash_prompt_tokens_total"] - before.get("dflash_prompt_tokens_total", 0) == resp.usage.prompt_tokens
    reason = resp.choices[0].finish_reason
    key = f'dflash_requests_total{{finish_reason="{reason}"}}'
    assert after[key] - before.get(key, 0) == 1
    acceptance = resp.choices[0].model_extra["acceptance"]
    steps = acceptance["num_steps"]
    assert after["dflash_acceptance_length_count"] - before.get("dflash_acceptance_length_count", 0) == steps
    for name, want in (("num_drafts", steps), ("num_draft_tokens", acceptance["total_draft_tokens"]),
                       ("num_accepted_tokens", acceptance["total_accepted_draft_tokens"])):
        key = f'vllm:spec_decode_{name}_total{{engine="0",model_name="{MODEL}"}}'
        assert after[key] - before.get(key, 0) == want, name
    assert after["dflash_draft_seconds_count"] >= steps and after["dflash_batch_size_count"] >= steps
    assert after["dflash_queue_depth"] == 0 and after["dflash_running_requests"] == 0


def test_usage_counts_the_prompt_tokens_a_freed_row_held_as_cached(tiny_dirs):
    """The next turn of a chat starts with the last one's prompt: the whole 16-token chunks that prompt left in its
    row are not computed again, and usage says how many (OpenAI's prompt_tokens_details.cached_tokens)."""
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=1, max_prefill_tokens=16))
    try:
        client = s.client()
        first = list(range(5, 45))  # chunks [0, 16), [16, 32), [32, 40)
        resp = client.completions.create(model=MODEL, prompt=first, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        following = first + [7] * 10
        before = scrape(s)
        resp = client.completions.create(model=MODEL, prompt=following, max_tokens=6, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
        assert resp.usage.prompt_tokens == 50 and resp.usage.prompt_tokens_details.cached_tokens == 32
        # /metrics counts every answer's prompt: the second answer ran in the row the first left, 48 of its 50 held
        after, key = scrape(s), "dflash_cached_prompt_tokens_total"
        assert after[key] - before[key] == 32 + 48
        hits = f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}}'
        assert after[hits] == after[key]
    finally:
        s.stop()


def test_a_streams_usage_counts_each_prompts_reuse_whichever_answer_finishes_first(tiny_dirs):
    """Two prompts, two answers each, streamed: usage's cached_tokens is what the first answer of each prompt
    reused (as without streaming), not what the answers that happened to finish first did. Sampled answers that stop
    at random tokens finish in an order each seed sets."""
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=4, max_prefill_tokens=16))
    try:
        client, orders = s.client(), set()
        for seed in range(6):
            reused = [1 + seed, *range(10, 50)]  # its own per seed: 40 tokens, two whole chunks to reuse
            fresh = [60 + seed, *range(50, 70)]  # a whole chunk, which its second answer copies from the first
            client.completions.create(model=MODEL, prompt=reused, max_tokens=1, temperature=0)
            alone = client.completions.create(model=MODEL, prompt=reused, max_tokens=1, temperature=0)
            assert alone.usage.prompt_tokens_details.cached_tokens == 32
            stream = client.completions.create(model=MODEL, prompt=[reused, fresh], n=2, max_tokens=12, temperature=1,
                                               seed=seed, stream=True, stream_options={"include_usage": True},
                                               extra_body={"stop_token_ids": list(range(0, 96, 3))})
            chunks = list(stream)
            orders.add(tuple(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason))
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32, (seed, orders)
        assert len(orders) > 1  # the answers finished in more than one order
    finally:
        s.stop()


def test_a_server_whose_engine_loop_failed_says_why_on_health_and_to_each_request(tiny_dirs):
    """A loop that ended on its own bug answered /health "not running" and every request "the server is shutting
    down", which it was not: a supervisor or client could not tell a stop from a failure, nor what failed."""
    engine = tiny_engine(tiny_dirs, max_batch_size=1)
    s = start_server(engine)
    try:
        engine.has_unfinished = lambda: 1 / 0  # a bug outside any step: the idle loop asks it within 0.5 s
        s.loop._thread.join(10)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "ZeroDivisionError" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert r.json()["error"]["message"] == "the engine loop failed: ZeroDivisionError: division by zero"
    finally:
        s.stop()


def test_more_answers_than_the_server_holds_are_refused_before_any_prompt_is_tokenized(tiny_dirs, monkeypatch):
    """The count alone decides it: 200,000 prompts of "a" were tokenized first, 56 s of a core, before this 400."""
    from dflash_trt.engine.prompt_encoder import PromptEncoder

    calls = []
    for method in ("encode", "encode_chat"):
        real = getattr(PromptEncoder, method)
        monkeypatch.setattr(PromptEncoder, method, lambda *a, _real=real, **k: (calls.append(a), _real(*a, **k))[1])
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=1, max_queue_len=1))
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 3, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "3 prompts" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "n": 3, "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert not calls
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 2, "max_tokens": 1})
        assert r.status_code == 200 and len(calls) == 2  # as many as it holds: as ever
    finally:
        s.stop()


def test_detokenizing_a_bodys_worth_of_ids_runs_on_the_big_prompts_lane(server, monkeypatch):
    """On the small prompts' lane, which every request's prompt waits on, 5M ids held a 4-token chat 2.7 s."""
    import threading

    from dflash_trt.server.prompt_lanes import BIG_PROMPT_CHARS

    tokenizer = server.engine.tokenizer
    threads = []
    real = type(tokenizer).decode
    monkeypatch.setattr(type(tokenizer), "decode",
                        lambda *a, **k: (threads.append(threading.current_thread().name), real(*a, **k))[1])
    for n in (3, BIG_PROMPT_CHARS + 1):
        r = httpx.post(server.url + "/detokenize", json={"tokens": [5] * n}, timeout=60)
        assert r.status_code == 200
    assert threads[0].startswith("dflash-tokenize_") and threads[-1].startswith("dflash-tokenize-big"), threads


def test_a_full_queue_answers_503_and_recovers(tiny_dirs):
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=1, max_queue_len=0))
    try:
        client = s.client()
        busy = client.completions.create(model=MODEL, prompt="busy", max_tokens=200, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
        next(iter(busy))  # the only row is taken
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="late", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        assert e.value.response.headers["retry-after"] == "1"
        busy.close()
        assert s.wait_idle(15)
        assert client.completions.create(model=MODEL, prompt="late", max_tokens=4, temperature=0).choices
    finally:
        s.stop()


def test_answers_that_do_not_all_fit_are_refused_with_none_of_them_queued(tiny_dirs):
    """n answers are queued all or none: with one row free and no queue, n=2 is a 503 that started nothing (it used
    to queue the first answer, then abort it)."""
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=2, max_queue_len=0))
    try:
        client = s.client()
        busy = iter(client.completions.create(model=MODEL, prompt="busy", max_tokens=200, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
        next(busy)  # one of the two rows is taken
        before = scrape(s)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="late", max_tokens=4, n=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        for _ in range(5):  # steps go by: an aborted answer would be counted in one of them
            next(busy)
        key = 'dflash_requests_total{finish_reason="abort"}'
        assert scrape(s).get(key, 0) == before.get(key, 0)
        assert s.engine.scheduler.num_running == 1 and s.engine.scheduler.num_waiting == 0
    finally:
        s.stop()


def test_an_engine_failure_fails_its_requests_not_the_server(tiny_dirs):
    engine = tiny_engine(tiny_dirs, max_batch_size=2)
    real = engine.runner.spec_step
    calls = {"n": 0}

    def flaky(seqs, k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(seqs, k)

    engine.runner.spec_step = flaky
    s = start_server(engine)
    try:
        client = s.client()
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.completions.create(model=MODEL, prompt="a", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
        assert s.wait_idle()
        stream = client.completions.create(model=MODEL, prompt="b", max_tokens=5, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) is not None
        r = httpx.get(s.url + "/health")
        assert r.status_code == 200
    finally:
        s.stop()


def test_a_stream_that_fell_behind_gets_its_last_tokens_before_the_engines_error(tiny_dirs, monkeypatch):
    """A reader holds only each choice's newest update: an error that replaced an unread one dropped the text of the
    tokens between them (each update carries all tokens so far; the error was streamed alone)."""
    from dflash_trt.server import app as app_module

    engine = tiny_engine(tiny_dirs, max_batch_size=1, dtype="float32")
    real, calls = engine.runner.spec_step, []

    def flaky(seqs, k):
        calls.append(k)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real(seqs, k)

    class Behind(app_module.LatestUpdates):
        async def get(self):  # the reader reads nothing until the engine has failed the request
            while not any(u.finished for u in self._latest.values()):
                await asyncio.sleep(0.01)
            return await super().get()

    engine.runner.spec_step = flaky
    monkeypatch.setattr(app_module, "LatestUpdates", Behind)
    s = start_server(engine)
    try:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=30) as r:
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and "injected fault" in chunks[-1]["error"]["message"]
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text, chunks  # the first two steps' tokens, then the error
    finally:
        s.stop()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGHUP, the terminal closed", "SIGINT twice"])
def test_serve_cli_binds_localhost_and_stops_on_sigterm(tiny_dirs, tmp_path, stop, hangup_not_ignored,
                                                        ctrl_c_reaches_python):
    """SIGHUP (the terminal closed) killed the server outright, its streams cut, and once handled, the stop failed
    writing to the closed terminal (EIO); a second Ctrl-C printed the traceback of uvicorn's cancelled lifespan task."""
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys

    from tests.server.conftest import free_port

    hangup = stop.startswith("SIGHUP")
    terminal, child_side = pty.openpty() if hangup else (None, None)
    port, seen = free_port(), []
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "serve", "--target", str(tiny_dirs["qwen3"]),
                             "--drafter", str(tiny_dirs["qwen3_drafter"]), "--port", str(port),
                             "--served-model-name", MODEL, "--max-model-len", "512"],
                            stdout=child_side if hangup else subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def output() -> str:
        if not hangup:
            return proc.stdout.read().decode()
        while select.select([terminal], [], [], 0.2)[0]:
            seen.append(os.read(terminal, 65536).decode(errors="replace"))
        return "".join(seen)

    try:
        if hangup:
            os.close(child_side)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, output()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30).json()
        assert body["usage"]["completion_tokens"] >= 1
        # A stream in flight at SIGTERM ends with an error event and [DONE], not cut off mid-answer.
        long = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=30) as resp:
            lines = resp.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            if hangup:
                out = output()
                os.close(terminal)  # every write to it fails from now on
            proc.send_signal(signal.SIGINT if stop == "SIGINT twice" else getattr(signal, stop.split(",")[0]))
            if stop == "SIGINT twice":  # quits without waiting: the stream may be cut
                time.sleep(0.05)
                proc.send_signal(signal.SIGINT)
            with contextlib.suppress(*(httpx.RemoteProtocolError,) * (stop == "SIGINT twice")):
                events += [line for line in lines if line.startswith("data: ")]
        if stop != "SIGINT twice":  # (the second may come before the engine's step in flight ends: not waited for)
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2][len("data: "):])
            assert last == {"error": {"message": "server shutting down", "type": "server_error", "param": None,
                                      "code": "shutting_down"}}
        assert proc.wait(20) in ((0, 130) if stop == "SIGINT twice" else (0,))
        if not hangup:
            out = output()
        assert f"http://127.0.0.1:{port}/v1" in out
        assert "Traceback" not in out and "Event loop is closed" not in out and "graceful shutdown" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_cuts_the_connections_of_clients_that_stopped_reading_without_tracebacks(tiny_dirs):
    """A client that stops reading a long stream leaves its handler waiting on full socket buffers: at SIGTERM
    uvicorn's grace ran out, logged an ERROR, and cancelled the handler with a CancelledError traceback. The server
    cuts such connections itself once the answered requests have had their time to drain, and exits quietly."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from tests.server.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "serve", "--target", str(tiny_dirs["qwen3"]),
                             "--drafter", str(tiny_dirs["qwen3_drafter"]), "--port", str(port),
                             "--served-model-name", MODEL, "--max-model-len", "512", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    stalled = socket.socket()
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        # about 5 MB of events (8 answers of 480 tokens with 20 logprobs each) into a 2 KB receive window: more than
        # the server's socket buffers hold
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                           "stream": True, "logprobs": 20, "n": 8}).encode()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1)
        while "dflash_running_requests 0.0" not in httpx.get(url + "/metrics", timeout=5).text:  # all generated
            assert time.monotonic() < deadline + 60, "the request did not finish"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        out = proc.stdout.read().decode()
        assert "Traceback" not in out and "ERROR" not in out and "graceful shutdown" not in out, out
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_under_nohup_keeps_a_hangup_ignored(hangup_not_ignored):
    """What nohup asks: a server started under it goes on when the terminal closes."""
    import signal

    import uvicorn

    from dflash_trt.server import cli

    server = cli._uvicorn_server_class()(uvicorn.Config(app=None))
    for before, handled in ((signal.SIG_IGN, False), (signal.SIG_DFL, True)):
        signal.signal(signal.SIGHUP, before)
        with server.capture_signals():
            assert (signal.getsignal(signal.SIGHUP) == server.handle_exit) == handled
        assert signal.getsignal(signal.SIGHUP) == before


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_server_answers_others_while_a_prompt_is_tokenized(server, oracle, monkeypatch, route):
    # A 12 MB prompt took 7 s to tokenize on the event loop, and /health and every stream waited for it.
    import threading

    name = "encode" if route == "completions" else "encode_chat"
    encoder = server.engine.prompt_encoder
    tokenize, started, release = getattr(encoder, name), threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        started.set()
        release.wait(30)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(encoder, name, slow)
    body = ({"prompt": PROMPTS[4]} if route == "completions"
            else {"messages": [{"role": "user", "content": PROMPTS[4]}]})
    with httpx.Client(timeout=60) as client:
        pending = threading.Thread(target=lambda: client.post(
            f"{server.base_url}/{'completions' if route == 'completions' else 'chat/completions'}",
            json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body}))
        pending.start()
        try:
            assert started.wait(30)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # while the prompt tokenizes
        finally:
            release.set()
            pending.join(60)


def test_a_request_the_stop_ends_is_answered_as_shutting_down_not_an_internal_error(tiny_dirs):
    # a non-streamed request in flight at the stop got 500 server_error
    import threading

    s = start_server(tiny_engine(tiny_dirs, max_batch_size=2))
    try:
        answered = []
        pending = threading.Thread(target=lambda: answered.append(httpx.post(
            s.base_url + "/completions", timeout=60,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True})))
        pending.start()
        deadline = time.monotonic() + 30
        while not s.loop.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        s.loop.stop()
        pending.join(60)
        assert answered[0].status_code == 503, answered[0].text
        assert answered[0].json()["error"]["code"] == "shutting_down"
    finally:
        s.stop()


def test_a_request_after_the_engine_stopped_is_refused_as_shutting_down_not_an_internal_error(tiny_dirs):
    # a kept-alive connection can still send one while the server stops: 503, no traceback
    s = start_server(tiny_engine(tiny_dirs, max_batch_size=2))
    try:
        s.loop.stop()
        r = httpx.post(s.base_url + "/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
    finally:
        s.stop()


def test_a_big_prompt_being_tokenized_holds_no_small_request(tiny_dirs, monkeypatch):
    """Prompts of over BIG_PROMPT_CHARS characters are tokenized on a lane of their own: one that takes seconds (held
    here until the small request is answered) keeps no other request waiting behind it."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_trt.engine.prompt_encoder import PromptEncoder
    from dflash_trt.server.prompt_lanes import BIG_PROMPT_CHARS

    gate, entered = threading.Event(), threading.Event()

    class Held(PromptEncoder):
        def encode(self, prompt, *args, **kwargs):
            entered.set()
            gate.wait(60)
            return super().encode(prompt, *args, **kwargs)

    monkeypatch.setattr(PromptEncoder, "copy", lambda self: Held(self.tokenizer, self.max_model_len))
    running = start_server(tiny_engine(tiny_dirs))
    try:
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(httpx.post, running.base_url + "/completions", timeout=60,
                              json={"model": MODEL, "prompt": "x" * (BIG_PROMPT_CHARS + 1), "max_tokens": 2})
            assert entered.wait(30)
            small = httpx.post(running.base_url + "/completions", timeout=30,
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert small.status_code == 200 and not big.done()
            gate.set()
            assert big.result().json()["error"]["code"] == "context_length_exceeded"
    finally:
        gate.set()
        running.stop()


def test_a_body_past_the_limit_or_cut_short_is_the_clients_doing_and_the_server_keeps_serving(tiny_dirs):
    """A larger body than max_request_bytes is refused (413) unread, whether it declares its length or comes in
    chunks; a client that goes away while sending one is counted as the other disconnects are (499), not as a
    server error, and leaves no traceback."""
    import socket

    server = start_server(tiny_engine(tiny_dirs, max_batch_size=2), max_request_bytes=1000)
    try:
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        big = {**small, "prompt": "x" * 2000}
        assert httpx.post(server.base_url + "/completions", json=small, timeout=30).status_code == 200
        r = httpx.post(server.base_url + "/completions", json=big, timeout=30)
        assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"], r.text
        chunked = httpx.post(server.base_url + "/completions", content=iter([json.dumps(big).encode()]), timeout=30,
                             headers={"content-type": "application/json"})  # an iterator: sent chunked, no length
        assert chunked.status_code == 413, chunked.text
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"pro")
        deadline = time.monotonic() + 10
        while scrape(server).get('dflash_request_errors_total{status="499"}', 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = scrape(server)
        assert errors.get('dflash_request_errors_total{status="499"}') == 3
        assert 'dflash_request_errors_total{status="500"}' not in errors
        assert httpx.post(server.base_url + "/completions", json=small, timeout=30).status_code == 200
        assert httpx.head(server.base_url + "/models", timeout=30).status_code == 200
    finally:
        server.stop()
