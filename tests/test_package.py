"""The package's Python entry points: `import dflash_trt` stays light, and the engine an engine directory opens
generates from text as from its token ids, equal to transformers' greedy continuation."""

import subprocess
import sys

import numpy as np
import pytest

from dflash_trt.build import build_engine
from tests.engine.test_lossless import hf_greedy
from tests.test_build import write_config


def test_importing_the_package_loads_no_torch():
    code = "import sys, dflash_trt; print('torch' in sys.modules); dflash_trt.SamplingParams(max_new_tokens=4)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_open_engine_generates_from_text_as_from_its_ids(tiny_dirs, tmp_path):
    import dflash_trt
    from dflash_trt import SamplingParams, open_engine

    engine_dir = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"]),
                              tmp_path / "engine", progress=False)
    llm = open_engine(engine_dir)
    assert isinstance(llm, dflash_trt.LLMEngine)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    by_text, by_ids = llm.generate(["hello there", llm.encode("hello there")], params)
    assert by_text.token_ids == by_ids.token_ids == hf_greedy(tiny_dirs["qwen3"], llm.encode("hello there"), 12)
    # one prompt alone, as text or as its ids, is one prompt (not one per character or id)
    (alone,) = llm.generate("hello there", params)
    (alone_ids,) = llm.generate(llm.encode("hello there"), params)
    (as_tuple,) = llm.generate(tuple(llm.encode("hello there")), params)
    (as_numpy,) = llm.generate([list(np.array(llm.encode("hello there")))], params)  # numpy's int64s
    assert alone.token_ids == alone_ids.token_ids == as_tuple.token_ids == as_numpy.token_ids == by_text.token_ids
    assert llm.generate([], params) == []
    for bad, words in (([["a"]], r"prompts\[0\] must be a string or a list of token ids"),
                       (7, "prompts must be a string, a list of token ids or a list of those, got int")):
        with pytest.raises(TypeError, match=words):
            llm.generate(bad, params)
    assert by_text.tau is not None and open_engine(engine_dir, speculative=False).generate("hi", params)[0].tau is None


def test_a_stop_string_alone_is_one_stop_string_not_one_per_character():
    from dflash_trt import SamplingParams

    assert SamplingParams(stop="Haven").stop == ["Haven"]
    assert SamplingParams(stop=["Haven", "end"]).stop == ["Haven", "end"]


def test_every_name_the_package_exports_is_there():
    import dflash_trt

    for name in dflash_trt.__all__:
        assert getattr(dflash_trt, name).__name__ == name
