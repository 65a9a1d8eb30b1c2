"""IncrementalDetokenizer: the streamed deltas add up to the tokenizer's own decode of all the ids (the oracle),
however the ids arrive (one at a time, or several per step as speculative decoding commits them), while only
a window of the last ids is decoded per update; stop strings and incomplete characters are held back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_trt.engine.detokenizer import IncrementalDetokenizer, tokens_writing


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> str:
    out, n = [], 0
    for size in chunks:
        n = min(len(ids), n + size)
        out.append(detok.delta(ids[:n]))
        if n == len(ids):
            break
    if n < len(ids):
        out.append(detok.delta(ids))
    return "".join(out)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=120),
       chunks=st.lists(st.integers(1, 8), min_size=1, max_size=60))
def test_deltas_add_up_to_the_whole_decode(tokenizer, text, chunks):
    ids = tokenizer(text)["input_ids"]
    want = tokenizer.decode(ids, skip_special_tokens=True)
    assert stream(IncrementalDetokenizer(tokenizer), ids, chunks) == want.rstrip("\ufffd")


@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=80), chunks=st.lists(st.integers(1, 8), min_size=1, max_size=80))
def test_arbitrary_ids_never_stream_text_the_whole_decode_lacks(tokenizer, ids, chunks):
    """Model output need not be valid UTF-8 (byte tokens, special tokens): what streams is still a prefix of the
    whole text, and once a complete character follows, all of it."""
    got = stream(IncrementalDetokenizer(tokenizer), ids, chunks)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    assert want.startswith(got)
    assert got == want or want.endswith("\ufffd")


@SETTINGS
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60), data=st.data())
def test_the_tokens_writing_a_texts_first_characters_are_the_fewest_whose_decode_is_that_long(tokenizer, text, data):
    """A reasoning's tokens: the oracle reads every prefix of the ids (the binary search reads a few)."""
    ids = tokenizer(text)["input_ids"]
    whole = len(tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd"))
    chars = data.draw(st.integers(0, whole + 2))
    lengths = [len(tokenizer.decode(ids[:m], skip_special_tokens=True).rstrip("\ufffd")) for m in range(len(ids) + 1)]
    want = next((m for m, n in enumerate(lengths) if n >= chars), len(ids))
    assert tokens_writing(tokenizer, ids, chars) == want


def test_only_a_window_is_decoded_per_update(tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"]
    lengths = []

    class Counting:
        def decode(self, window, **kw):
            lengths.append(len(window))
            return tokenizer.decode(window, **kw)

    detok = IncrementalDetokenizer(Counting())
    text = "".join(detok.delta(ids[:n]) for n in range(1, len(ids) + 1))
    assert text == tokenizer.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 2


def test_a_partial_stop_string_is_held_back_and_the_final_text_settles_it(tokenizer):
    ids = tokenizer("Hi\n\nthere")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\n"])
    sent = [detok.delta(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(sent) == "Hi"  # "\n" waits: it may start the stop string, and it does
    assert detok.delta(ids, final_text="Hi") == ""


def test_a_metaspace_tokenizer_keeps_the_spaces_a_lone_token_would_lose():
    """SentencePiece-style decoders (Llama, Mistral) drop the leading space of a decode's first token: a window
    that started at the newest id would glue the words together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the cat sat on the mat", "a dog ran after the cat", "on and on the words go"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    ids = fast("the cat ran on the mat and the dog sat")["input_ids"]
    assert fast.decode(ids[3:4]) != " " + fast.decode(ids[3:4]).lstrip()  # the premise: a lone token loses its space
    detok = IncrementalDetokenizer(fast)
    assert "".join(detok.delta(ids[:n]) for n in range(1, len(ids) + 1)) == fast.decode(ids)


@settings(max_examples=600, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=40), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=20),
                                                                   max_size=3))
def test_the_text_held_back_is_the_longest_suffix_a_stop_string_starts_with_or_holds(text, stops):
    def held(stop: str) -> int:  # every suffix tried, longest first
        if stop in text:
            return len(text) - text.find(stop)
        return next((n for n in range(min(len(stop) - 1, len(text)), 0, -1) if stop.startswith(text[-n:])), 0)

    assert IncrementalDetokenizer(None, stops)._stop_prefix_len(text) == max(map(held, stops), default=0)


def test_a_long_stop_string_is_compared_whole_only_where_the_answers_tail_begins_as_it_does():
    """Every suffix of the answer that began with a stop's first character was compared with all of it, on the
    server's event loop at every streamed update: 256 stops of 4,000 characters that began with a space took 122 ms
    an update against a 5,600-character answer, and /health waited up to 0.9 s. (Counted here, not timed.)"""
    compared = []

    class Stop(str):
        def startswith(self, prefix, *args):
            compared.append(len(prefix))
            return str.startswith(self, prefix, *args)

    text = " ".join(["word"] * 1000) + " qq"
    stop = Stop(" " + "q" * 4000)
    assert IncrementalDetokenizer(None, [stop])._stop_prefix_len(text) == 3
    assert sum(compared) <= 64, compared[:10]  # characters compared: the last few suffixes, each under 8 long
