"""The engine's stop-string check and final text: the text a client gets, decoded once however many stop strings a
request sends, and never holding the U+FFFD that stands for a character whose bytes have not all come yet."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_trt import SamplingParams
from dflash_trt.engine.detokenizer import IncrementalDetokenizer
from dflash_trt.engine.llm_engine import LLMEngine, _holds_stop
from dflash_trt.engine.sequence import Sequence


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, *args, **kwargs) -> str:
        self.calls += 1
        return self.tokenizer.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_a_stop_string_is_found_in_the_decoded_text_with_one_decode_for_all_strings(tokenizer):
    ids = tokenizer.encode("The answer is 42.\n\nNext")
    counting = CountingTokenizer(tokenizer)
    stops = [f"never {i}" for i in range(1000)] + ["\n\n"]
    assert _holds_stop(counting, ids, stops) and counting.calls == 1
    assert not _holds_stop(counting, ids, stops[:1000]) and counting.calls == 2


def test_half_a_character_does_not_match_a_stop_string_holding_a_replacement_character(tokenizer):
    ids = tokenizer.encode("hi 😀")
    half = next(ids[:n] for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assert not _holds_stop(tokenizer, half, ["\ufffd"])
    assert _holds_stop(tokenizer, ids, ["😀"]) and not _holds_stop(tokenizer, half, ["😀"])


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
