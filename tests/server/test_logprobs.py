"""Logprobs over HTTP: OpenAI's chat and completions shapes, streamed and not, carry the target's log-probability of
every generated token (transformers' logits are the oracle, in fp32), and a split character's bytes add up to it."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.logprobs import TokenText
from tests.engine.test_logprobs import hf_logprobs
from tests.server.conftest import MODEL

PROMPT = "the quick brown fox jumps"


def _oracle(tiny_dirs, oracle, prompt_ids, max_tokens):
    """The greedy answer's ids (the engine's generate, itself equal to transformers' greedy: test_lossless) and
    transformers' log-softmax at each of its positions."""
    (want,) = oracle.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens))
    return want, hf_logprobs(tiny_dirs["qwen3"], prompt_ids, want.token_ids)


def _events(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_logprobs_are_the_targets_streamed_and_not(server, oracle, tiny_dirs):
    want, ref = _oracle(tiny_dirs, oracle, oracle.encode(PROMPT), 20)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logprobs": 3}
    lp = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    tok = oracle.tokenizer
    assert lp["tokens"] == [tok.decode([t]) for t in want.token_ids]
    chosen = ref.gather(1, torch.tensor(want.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), chosen, atol=1e-4, rtol=0)
    values, ids = ref.topk(3, dim=-1)
    for top, v, i, t, c in zip(lp["top_logprobs"], values, ids, want.token_ids, chosen):
        expect = {tok.decode([x]): float(y) for x, y in zip(i.tolist(), v)} | {tok.decode([t]): float(c)}
        assert top.keys() == expect.keys() and all(abs(top[k] - expect[k]) < 1e-4 for k in top)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j])) for j in range(len(lp["tokens"]))]

    chunks = _events(server, "/completions", {**body, "stream": True})
    streamed = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in lp}
    assert streamed == lp


def test_chat_logprobs_are_the_targets_through_the_openai_client(server, oracle, tiny_dirs):
    messages = [{"role": "user", "content": "hello there"}]
    want, ref = _oracle(tiny_dirs, oracle, oracle.encode_chat(messages), 16)
    client = server.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [e.token for e in content] == [oracle.tokenizer.decode([t]) for t in want.token_ids]
    assert all(e.bytes == list(e.token.encode()) for e in content)  # one character per token here
    chosen = ref.gather(1, torch.tensor(want.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in content]), chosen, atol=1e-4, rtol=0)
    values, _ = ref.topk(2, dim=-1)
    torch.testing.assert_close(torch.tensor([[t.logprob for t in e.top_logprobs] for e in content]), values,
                               atol=1e-4, rtol=0)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_a_stop_string_cuts_the_text_not_the_tokens_logprobs(server, oracle):
    """The answer's text ends before the stop string; usage and logprobs count every token generated."""
    want = oracle.generate([oracle.encode(PROMPT)], SamplingParams(max_new_tokens=20))[0]
    stop = want.text[5:7]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logprobs": 0, "stop": [stop]}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert stop not in r["choices"][0]["text"] and r["choices"][0]["finish_reason"] == "stop"
    assert len(r["choices"][0]["logprobs"]["tokens"]) == r["usage"]["completion_tokens"]
    chunks = _events(server, "/completions", {**body, "stream": True})
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == r["usage"]["completion_tokens"]


def test_the_bytes_of_a_character_split_across_tokens_add_up_to_it(smollm2_dir):
    """SmolLM2's byte-level BPE splits the emoji over two tokens, each decoding alone to U+FFFD."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = TokenText(tokenizer)
    ids = tokenizer.encode(" héllo 😀 wörld")
    assert any(text.text(t).endswith("\ufffd") for t in ids)
    assert bytes(b for t in ids for b in text.bytes(t)) == " héllo 😀 wörld".encode()


@pytest.mark.parametrize("body, listed", [({"logprobs": 2}, 2), ({"logprobs": 0}, 0), ({"logprobs": False}, None),
                                          ({}, None)])
def test_completions_take_logprobs_as_a_count_or_leave_them_out(server, body, listed):
    """0 is a count (each token's own logprob, as OpenAI's), not "off"."""
    r = httpx.post(server.base_url + "/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body})
    lp = r.json()["choices"][0]["logprobs"]
    if listed is None:
        assert lp is None
    else:  # the top ones, and the chosen one where it is not among them
        assert len(lp["tokens"]) == 3 and all(len(top) in (listed, listed + 1) for top in lp["top_logprobs"])


def test_echo_scores_the_prompt_as_lm_eval_asks(server, oracle, tiny_dirs):
    """lm-evaluation-harness's loglikelihood request (`local-completions`): echo, logprobs 1, one new token. The
    prompt's tokens after the first carry transformers' log-probabilities; the first has none, as OpenAI's."""
    prompt_ids = oracle.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "seed": 1234}
    choice = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]
    (want,) = oracle.generate([prompt_ids], SamplingParams(max_new_tokens=1))
    assert choice["text"] == PROMPT + want.text
    lp = choice["logprobs"]
    ids = prompt_ids + want.token_ids
    assert lp["tokens"] == [oracle.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(tiny_dirs["qwen3"], prompt_ids[:1], ids[1:])
    want_lp = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want_lp, atol=1e-4, rtol=0)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j])) for j in range(len(ids))]
    # token ids as the prompt: echoed decoded, scored alike
    by_ids = httpx.post(server.base_url + "/completions", json={**body, "prompt": prompt_ids}, timeout=60).json()
    assert by_ids["choices"][0]["text"] == choice["text"] and by_ids["choices"][0]["logprobs"] == lp
    # without logprobs, echo is the text alone
    plain = httpx.post(server.base_url + "/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["text"] == choice["text"] and plain["choices"][0]["logprobs"] is None
    streamed = httpx.post(server.base_url + "/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "echo"
    # max_tokens 0: the prompt alone, scored the same, nothing generated (vLLM's echo without generation)
    alone = httpx.post(server.base_url + "/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    (only,) = alone["choices"]
    assert only["text"] == PROMPT and only["finish_reason"] == "length"
    assert only["logprobs"] == {key: value[:len(prompt_ids)] for key, value in lp.items()}
    assert alone["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                              "total_tokens": len(prompt_ids), "prompt_tokens_details": {"cached_tokens": 0}}
    refused = httpx.post(server.base_url + "/completions", json={**body, "max_tokens": 0, "echo": False}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_an_echoed_prompts_special_tokens_take_their_place_in_the_text_an_answers_do_not(smollm2_dir):
    """Offsets index the choice's text: an echoed prompt holds the special tokens it was written with (a chat
    template's markers), and not one the tokenizer added unwritten (a BOS); an answer's text leaves its specials out
    (an EOS)."""
    from dflash_trt.engine.logprobs import TokenLogprob
    from dflash_trt.server.logprobs import completion_logprobs

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = "<|im_start|>user\nHi there<|im_end|>\n"
    answer, eos = tokenizer.encode("Hello!"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    unwritten = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for prompt_ids in (tokenizer.encode(prompt), [unwritten, *tokenizer.encode(prompt)]):
        ids = [*prompt_ids, *answer, eos]
        entries = [TokenLogprob(t, -1.0, ()) for t in ids[1:]]
        lp = completion_logprobs(entries, TokenText(tokenizer), echoed=prompt_ids, echoed_text=prompt)
        text = prompt + tokenizer.decode(answer)  # the choice's text
        names = [tokenizer.decode([t]) for t in ids]
        starts = [o for o, t in zip(lp.text_offset, ids) if t != unwritten]
        assert all(text.startswith(name, o) for o, name, t in zip(lp.text_offset, names, ids[:-1]) if t != unwritten)
        assert starts == sorted(starts) and lp.text_offset[-1] == len(text)  # the EOS: past the answer's text
        assert text[lp.text_offset[len(prompt_ids)]:] == "Hello!"


def test_completion_offsets_and_names_hold_where_characters_split_across_tokens(smollm2_dir):
    """Each token's text_offset is where it starts in the text (the tokenizer's own decoding of the tokens before it,
    less a character they leave unfinished); a piece of a character is named by its bytes, as OpenAI's legacy API
    names it, so two pieces never share a top_logprobs key."""
    from dflash_trt.engine.logprobs import TokenLogprob
    from dflash_trt.server.logprobs import completion_logprobs

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = "Héllo wörld, 日本語 🙂 café"
    ids = tokenizer.encode(text)
    entries = [TokenLogprob(t, -1.0, ((t, -1.0), (ids[0], -2.0))) for t in ids[1:]]
    lp = completion_logprobs(entries, TokenText(tokenizer), echoed=ids)
    assert lp.text_offset == [len(tokenizer.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids))]
    pieces = [name for name in lp.tokens if name.startswith("bytes:")]
    assert len(pieces) >= 2 and not any("\ufffd" in name for name in lp.tokens)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])  # the chosen piece and the first token: two keys
    whole = [name for name in lp.tokens if not name.startswith("bytes:")]
    assert all(text[o:].startswith(name) for o, name in zip(lp.text_offset, lp.tokens) if name in whole)


def test_an_answers_offsets_count_none_for_every_token_its_text_leaves_out(smollm2_dir):
    """SmolLM2's <repo_name>, <filename>, ... are special to its tokenizer (the answer's text skips them) but are not
    among its all_special_ids: they count no characters either (each moved every later offset on by its name's)."""
    from dflash_trt.engine.logprobs import TokenLogprob
    from dflash_trt.server.logprobs import completion_logprobs

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    filename = tokenizer.convert_tokens_to_ids("<filename>")
    assert filename not in tokenizer.all_special_ids
    ids = [filename, *tokenizer.encode("setup.py"), filename, *tokenizer.encode(" ok")]
    lp = completion_logprobs([TokenLogprob(t, -1.0, ()) for t in ids], TokenText(tokenizer))
    assert lp.text_offset == [len(tokenizer.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids))]
