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
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value, kind):
    with pytest.raises(ValueError, match=re.escape(f"{field} must be {kind}, got {value!r}")):
        SamplingParams(**{field: value})


def test_numbers_of_any_numeric_type_are_taken():
    p = SamplingParams(max_new_tokens=np.int64(4), top_k=np.int32(2), seed=np.int64(3), temperature=np.float32(0.5),
                       top_p=1, logprobs=np.int8(1))
    assert p.max_new_tokens == 4 and p.top_k == 2
