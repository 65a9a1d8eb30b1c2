"""SamplingParams refuses values of the wrong type by name, before a request reaches an engine (a float count went
on as a draft length of 0.5, a string failed a comparison with a TypeError)."""

import re

import numpy as np
import pytest

from dflash_trt.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value, kind", [
    ("max_new_tokens", 1.5, "an integer"), ("max_new_tokens", "64", "an integer"),
    ("max_new_tokens", True, "an integer"),
    ("top_k", 2.0, "an integer"), ("seed", "7", "an integer"), ("logprobs", 1.0, "an integer"),
    ("prompt_logprobs", "2", "an integer"), ("temperature", "0.7", "a number"), ("top_p", None, "a number"),
    ("presence_penalty", "1", "a number"), ("repetition_penalty", [1.1], "a number"),
    ("stop", [1], "a string or a list of strings"), ("stop", b"x", "a string or a list of strings"),
    ("stop_token_ids", 2, "a list of token ids"), ("allowed_token_ids", 5, "a list of token ids"),
    ("ignore_eos", "no", "True or False"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value, kind):
    with pytest.raises(ValueError, match=re.escape(f"{field} must be {kind}, got {value!r}")):
        SamplingParams(**{field: value})


def test_stop_token_ids_are_token_ids_within_the_vocabulary():
    from dflash_trt.sampling_params import ParamError

    for bad in (["a"], [-1], [True]):
        with pytest.raises(ValueError, match="stop_token_ids token ids must be integers >= 0"):
            SamplingParams(stop_token_ids=bad)
    with pytest.raises(ParamError, match=re.escape("stop_token_ids token ids must be in 0..99, got [100]")):
        SamplingParams(stop_token_ids=[3, 100]).check_token_ids(100, [0])  # it would never stop the answer
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_numbers_of_any_numeric_type_are_taken():
    p = SamplingParams(max_new_tokens=np.int64(4), top_k=np.int32(2), seed=np.int64(3), temperature=np.float32(0.5),
                       top_p=1, logprobs=np.int8(1))
    assert p.max_new_tokens == 4 and p.top_k == 2


def test_more_stop_strings_or_characters_than_a_request_may_send_are_refused():
    """Each stop string is looked for at every step of the engine every request shares, and a streamed answer's end
    compared with each on the server's event loop at every update, at up to the square of its length: 256 stops of
    80,000 characters stalled every client 24 s."""
    from dflash_trt.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS
    with pytest.raises(ValueError, match=f"stop holds {MAX_STOP_STRINGS + 1} strings, more than the"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert SamplingParams(stop="x" * MAX_STOP_CHARS).stop == ["x" * MAX_STOP_CHARS]
    with pytest.raises(ValueError, match=f"stop strings hold {MAX_STOP_CHARS + 1} characters together"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS - 1), "yy"])
