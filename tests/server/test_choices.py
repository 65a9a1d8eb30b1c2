"""OpenAI's n: n answers of each prompt, in OpenAI's order, each sampled with a seed of its own (the first keeps the
request's seed, so it is the n=1 answer), streamed with a role chunk per choice; usage counts each prompt once."""

from __future__ import annotations

import json

import httpx

from dflash_trt.sampling_params import SamplingParams, choice_seed
from tests.server.conftest import MODEL

PROMPTS = ["the quick brown fox", "pack my box with five"]


def _alone(oracle, prompt, seed, chat=False):
    ids = oracle.encode(prompt, chat=chat)
    return oracle.generate([ids], SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed, ignore_eos=True))[0]


def test_n_answers_per_prompt_each_with_a_seed_of_its_own(server, oracle):
    body = {"model": MODEL, "prompt": PROMPTS, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    for k, prompt in enumerate(PROMPTS):
        texts = [r["choices"][3 * k + j]["text"] for j in range(3)]
        assert texts == [_alone(oracle, prompt, choice_seed(5, j)).text for j in range(3)]
        assert len(set(texts)) == 3
    single = httpx.post(server.base_url + "/completions", json={**body, "n": 1}, timeout=60).json()
    assert [c["text"] for c in single["choices"]] == [r["choices"][0]["text"], r["choices"][3]["text"]]
    assert r["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"] == sum(len(oracle.encode(p)) for p in PROMPTS)
    assert r["usage"]["completion_tokens"] == 6 * 12


def test_streamed_chat_choices_each_open_with_their_role_and_match_the_whole_answers(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 10,
            "temperature": 1.0, "seed": 9, "ignore_eos": True}
    whole = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    with httpx.stream("POST", server.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    texts, first = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c["choices"]:
            first.setdefault(choice["index"], choice["delta"])
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert first == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert texts[0] != texts[1]


def test_greedy_answers_are_alike_and_more_than_the_server_holds_is_refused_naming_n(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 2, "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == r["choices"][1]["text"]
    capacity = server.engine.scheduler.capacity
    too_many = httpx.post(server.base_url + "/completions", json={**body, "n": capacity + 1}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert f"x n={capacity + 1} answers" in too_many.json()["error"]["message"]


def test_best_of_equal_to_n_is_n_and_more_is_refused(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3}
    same = httpx.post(server.base_url + "/completions", json={**body, "best_of": 2}, timeout=60).json()
    plain = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert [c["text"] for c in same["choices"]] == [c["text"] for c in plain["choices"]]
    more = httpx.post(server.base_url + "/completions", json={**body, "best_of": 3}, timeout=60)
    assert more.status_code == 400 and more.json()["error"]["param"] == "best_of"


def test_every_sampling_field_reaches_the_engine_as_the_targets_own_sample(server, oracle):
    """A seeded answer under top_k, top_p, min_p or a penalty is the plain-decoding target's sample with that field,
    which is another answer than without it: each field really reaches the sampler, unchanged."""
    ids = oracle.encode(PROMPTS[1])
    base = {"max_new_tokens": 16, "temperature": 1.3, "seed": 11, "ignore_eos": True}

    def target(**field) -> str:
        return oracle.generate([ids], SamplingParams(**base, **field))[0].text

    def served(**field) -> str:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 1.3, "seed": 11,
                "ignore_eos": True, **field}
        r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    plain = target()
    for name, value in {"top_k": 8, "top_p": 0.6, "min_p": 0.1, "presence_penalty": 1.0, "frequency_penalty": 1.0,
                        "repetition_penalty": 1.5}.items():
        want = target(**{name: value})
        assert want != plain, name  # the field changes this answer: the check below can tell it was dropped
        assert served(**{name: value}) == want, name
