"""The engine's stop-string check and final text: the text a client gets, decoded once however many stop strings a
request sends, and never holding the U+FFFD that stands for a character whose bytes have not all come yet."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from dflash_trt import SamplingParams
from dflash_trt.engine.detokenizer import IncrementalDetokenizer
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine, _holds_stop
from dflash_trt.engine.sequence import Sequence


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, *args, **kwargs) -> str:
        self.calls += 1
        return self.tokenizer.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_a_stop_string_is_found_in_the_decoded_text_with_one_decode_for_all_strings(tokenizer):
    ids = tokenizer.encode("The answer is 42.\n\nNext")
    counting = CountingTokenizer(tokenizer)
    stops = [f"never {i}" for i in range(1000)] + ["\n\n"]
    assert _holds_stop(counting, ids, stops, 64) and counting.calls == 1
    assert not _holds_stop(counting, ids, stops[:1000], 64) and counting.calls == 2


def test_half_a_character_does_not_match_a_stop_string_holding_a_replacement_character(tokenizer):
    ids = tokenizer.encode("hi 😀")
    half = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assert not _holds_stop(tokenizer, half, ["\ufffd"], 64)
    assert _holds_stop(tokenizer, ids, ["😀"], 64) and not _holds_stop(tokenizer, half, ["😀"], 64)


def test_a_decoded_tail_that_starts_inside_a_character_does_not_match_a_replacement_character(tokenizer):
    """Past `tail` tokens only the last ones are decoded: where they began inside a character (each of these emoji
    is 3 tokens), its bytes decoded as U+FFFD and a stop string of one ended the answer at 65 tokens."""
    ids = tokenizer.encode("\U0001f44f" * 40)
    assert "\ufffd" not in tokenizer.decode(ids) and len(ids) == 120
    assert not any(_holds_stop(tokenizer, ids[:n], ["\ufffd", "\ufffd\U0001f44f"], 64) for n in range(1, 121))
    assert _holds_stop(tokenizer, ids[:100], ["\U0001f44f"], 64)  # still found in a window that starts mid-character


def test_an_answer_cut_mid_character_ends_before_it_as_its_stream_does(tokenizer):
    """max_tokens may fall between the bytes of one character: the final text, like the streamed one, leaves the
    half character out (it decodes to U+FFFD)."""
    ids = tokenizer.encode("love 😀🎉")
    half = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    seq = Sequence([1], SamplingParams(max_new_tokens=len(half)))
    seq.output_ids = list(half)
    engine = SimpleNamespace(tokenizer=tokenizer, drafter=None, max_draft_len=0)
    text = LLMEngine.make_output(engine, seq).text
    streamed = IncrementalDetokenizer(tokenizer).delta(half)
    assert text == streamed and not text.endswith("\ufffd") and text.startswith("love 😀")


def _vllm_min_tokens_answer(tokenizer, ids: list[int], stop: str, min_tokens: int) -> tuple[list[int], str]:
    """vLLM's rule, token by token (its detokenizer's stop_check_offset): from the token past min_tokens on, the
    first stop string that ends past the text of the first min_tokens tokens ends the answer there."""
    held = len(tokenizer.decode(ids[:min_tokens], skip_special_tokens=True))
    for n in range(min_tokens + 1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        starts = [i for i in range(len(text) - len(stop) + 1) if text.startswith(stop, i) and i + len(stop) > held]
        if starts:
            return ids[:n], text[:starts[0]]
    raise AssertionError("the stop string never ends past min_tokens' text: pick another")


@pytest.mark.parametrize("drafting", [dict(speculative=False), dict(max_draft_len=3),
                                      dict(max_draft_len=3, draft_tree={1: 6})], ids=["plain", "chain", "tree"])
def test_with_min_tokens_a_stop_string_counts_only_where_it_ends_past_their_text_as_vllms(tiny_dirs, drafting):
    from tests.engine.test_lossless import _prompts, hf_greedy

    prompt = _prompts(3)[2]  # its answer repeats pieces of text, not only one character
    want = hf_greedy(tiny_dirs["qwen3"], prompt, new=120)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    text = tokenizer.decode(want, skip_special_tokens=True)
    # a stop string of two characters, seen again later: min_tokens holds its first occurrence
    stop = next(text[i:i + 2] for i in range(len(text))
                if text[i] != text[i + 1] and text.find(text[i:i + 2], i + 4) > 0)
    min_tokens = text.find(stop) + 3
    ids, cut = _vllm_min_tokens_answer(tokenizer, want, stop, min_tokens)
    assert text.find(stop) + len(stop) <= len(cut)  # the premise: the answer keeps an earlier occurrence
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"],
                                 EngineConfig(max_batch_size=1, max_model_len=256, **drafting))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=120, ignore_eos=True, stop=[stop],
                                                   min_tokens=min_tokens))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (ids, cut, "stop")
    # streamed, the occurrence min_tokens holds goes out before the answer ends (it is not held back as a stop)
    detok = IncrementalDetokenizer(tokenizer, [stop], min_tokens)
    streamed = "".join(detok.delta(ids[:n]) for n in range(1, len(ids)))
    assert cut.startswith(streamed) and len(streamed) >= text.find(stop) + len(stop)
    assert streamed + detok.delta(ids, final_text=out.text) == cut


@pytest.mark.parametrize("stop_ids, ignore_eos, last, reason", [
    (None, False, 2, None),  # the model's eos: no stop reason, as vLLM's
    ([2, 40], False, 40, 40),  # a stop token id the request sent
    ([40], True, 2, None),  # ignore_eos: eos is a token like any other (here the answer ran out of length)
    ([2], True, 2, 2),  # ... unless the request named it
])
def test_the_stop_reason_is_the_stop_token_id_a_request_sent_never_the_models_eos(tiny_dirs, stop_ids, ignore_eos,
                                                                                  last, reason):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    params = SamplingParams(max_new_tokens=3, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    seq = Sequence([1], params, eos_token_ids=(2,))
    seq.append([50, 51, last], max_model_len=100)
    engine = SimpleNamespace(tokenizer=tokenizer, drafter=None, max_draft_len=0, eos_token_ids=(2,))
    out = LLMEngine.make_output(engine, seq)
    assert out.stop_reason == reason and out.finish_reason == ("stop" if reason or not ignore_eos else "length")


def test_an_eos_only_generation_config_names_ends_the_answer_as_in_transformers(tiny_dirs, tmp_path):
    """Qwen2.5-Instruct's config.json names one eos and its generation_config.json two; transformers' generate (the
    oracle) stops at either."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.test_lossless import _prompts, hf_greedy

    prompt = _prompts(3)[2]
    free = hf_greedy(tiny_dirs["qwen3"], prompt, new=40)
    extra = next(t for t in free[5:] if t not in free[:5])  # a token the answer reaches after a few
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra]}))
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert want.tolist()[-1] == extra and len(want) < 40  # the premise: transformers stops there
    engine = LLMEngine.from_dirs(target, tiny_dirs["qwen3_drafter"], EngineConfig(max_batch_size=1, max_draft_len=3,
                                                                                  max_model_len=256))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=40))[0]
    assert out.token_ids == want.tolist() and out.finish_reason == "stop" and out.stop_reason is None
