"""StructuredOutput says what an answer must match, one way at a time; SamplingParams refuses the settings that
could leave a grammar no token to choose."""

import pytest

from dflash_trt import SamplingParams, StructuredOutput


@pytest.mark.parametrize("fields, kind", [
    (dict(json={"type": "object"}), "json"), (dict(json='{"type": "integer"}'), "json"), (dict(json=True), "json"),
    (dict(json_object=True), "json_object"), (dict(regex="a+"), "regex"), (dict(choice=("a", "b")), "choice"),
    (dict(grammar='start: "x"'), "grammar"), (dict(calls={"f": {"type": "object"}}, reasoning="gpt_oss"), "calls"),
])
def test_each_way_is_told_by_its_kind(fields, kind):
    assert StructuredOutput(**fields).kind == kind


@pytest.mark.parametrize("fields, says", [
    (dict(), "exactly one of .* got none"), (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json={"type": "object"}, json_object=True), "got json, json_object"),
    (dict(json="{nope"), "the JSON schema is no JSON"),
    (dict(json="[1]"), "the JSON schema must be an object, got list"),
    (dict(json=3), "the JSON schema must be an object, got int"), (dict(regex=""), "regex must be a non-empty string"),
    (dict(grammar=b"x"), "grammar must be a non-empty string"), (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice="ab"), "choice must be a non-empty list"), (dict(choice=["a", ""]), "non-empty strings"),
    (dict(json_object="yes"), "json_object must be True or False"),
    (dict(regex="a", any_whitespace=None), "any_whitespace must be True or False"),
    (dict(regex="a", reasoning="granite"), "reasoning must be one of deepseek_r1, qwen3, gpt_oss or None"),
    (dict(calls={"f": {}}), "calls are made in gpt_oss's form .* got reasoning None"),
    (dict(calls={"f": {}}, reasoning="qwen3"), "calls are made in gpt_oss's form .* got reasoning 'qwen3'"),
    (dict(calls={}, reasoning="gpt_oss"), "calls must be a non-empty object"),
    (dict(calls={"f": {}}, regex="a", reasoning="gpt_oss"), "got regex, calls"),
    (dict(calls={"get weather": {}}, reasoning="gpt_oss"), "a function's name is .* got 'get weather'"),
    (dict(calls={"f": [1]}, reasoning="gpt_oss"), "'f''s parameters' schema must be an object, got list"),
])
def test_malformed_ways_are_refused_naming_the_field(fields, says):
    with pytest.raises(ValueError, match=says):
        StructuredOutput(**fields)


@pytest.mark.parametrize("setting", [dict(ignore_eos=True), dict(min_tokens=2), dict(allowed_token_ids=[5, 6])])
def test_settings_that_could_leave_the_grammar_no_token_are_refused(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name} cannot be combined with structured output"):
        SamplingParams(structured=StructuredOutput(regex="a+"), **setting)


def test_structured_takes_a_structured_output_only():
    with pytest.raises(ValueError, match="structured must be a StructuredOutput, got dict"):
        SamplingParams(structured={"regex": "a+"})
