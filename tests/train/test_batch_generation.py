"""BatchGenerator: greedy rows equal transformers' own greedy generation (the oracle) whatever the other rows' prompt
lengths; sampled rows draw from the target's tempered distribution; records through generate_responses."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.train.batch_generation import BatchGenerator
from dflash_trt.train.prompts import Prompt
from dflash_trt.train.responses import generate_responses, read_records
from tests.conftest import EOS, make_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target") / "t", arch="llama", seed=5)


@pytest.fixture(scope="module")
def engine(target_dir):
    return LLMEngine.from_dirs(target_dir, None, EngineConfig(max_batch_size=4, speculative=False, dtype="float32"))


def test_greedy_rows_equal_transformers_greedy_at_any_prompt_length(target_dir, engine):
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
    stops = [None, None, [41, 57], None, None]  # a row that stops early beside rows that do not
    params = [SamplingParams(max_new_tokens=m, stop_token_ids=s) for m, s in zip((24, 10, 24, 5, 24), stops)]
    got = BatchGenerator(engine).generate(prompts, params)
    for p, sp, out in zip(prompts, params, got):
        stop = sp.stop_token_ids or [EOS]
        ref = hf.generate(torch.tensor([p]), max_new_tokens=sp.max_new_tokens, do_sample=False, eos_token_id=stop,
                          pad_token_id=0)[0, len(p):].tolist()
        if any(t in stop for t in ref):  # the oracle pads after its stop token
            ref = ref[: next(i for i, t in enumerate(ref) if t in stop) + 1]
        assert out.token_ids == ref


def test_a_hybrid_targets_greedy_rows_equal_transformers_greedy_at_any_prompt_length(tmp_path):
    """Qwen3.5 (recurrent states): rows of 3 and 40 prompt tokens in one padded prefill, each then decoding from its
    own length, as transformers decodes it alone."""
    from transformers import Qwen3_5ForCausalLM

    from tests.models.test_qwen3_5 import make_qwen3_5

    d = make_qwen3_5(tmp_path / "t")
    hf = Qwen3_5ForCausalLM.from_pretrained(d).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 40, 22)]
    hybrid = LLMEngine.from_dirs(d, None, EngineConfig(max_batch_size=4, speculative=False, dtype="float32"))
    got = BatchGenerator(hybrid).generate(prompts, [SamplingParams(max_new_tokens=12, stop_token_ids=[999])] * 3)
    for p, out in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert out.token_ids == ref


def test_sampled_rows_follow_the_tempered_distribution(target_dir, engine):
    """One sampled token from 6,000 copies of a prompt: its frequencies against softmax(logits / T) of transformers'
    model, in total variation (expected ~0.5 * sum sqrt(p (1 - p) / N) < 0.05 here)."""
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt, temperature, n = [5, 17, 33, 8], 1.5, 6000
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
    out = BatchGenerator(engine).generate([prompt] * n, [SamplingParams(max_new_tokens=1, temperature=temperature,
                                                                        seed=3)] * n)
    freq = torch.bincount(torch.tensor([o.token_ids[0] for o in out]), minlength=p.numel()).float() / n
    assert 0.5 * (freq - p).abs().sum() < 0.06


def test_it_refuses_what_it_cannot_do(engine):
    gen = BatchGenerator(engine)
    with pytest.raises(ValueError, match="top_k"):
        gen.generate([[5, 6]], [SamplingParams(temperature=1.0, top_k=5)])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        gen.generate([[5], [6]], [SamplingParams()])
    with pytest.raises(ValueError, match="prompt token ids"):
        gen.generate([[5, 10_000]], [SamplingParams()])


def test_generate_responses_writes_the_engines_records_through_it(engine, tmp_path):
    prompts = [Prompt(f"question {i}: what is {w}?", "test") for i, w in enumerate(["red", "blue", "tea"])]
    by_engine = generate_responses(engine, prompts, tmp_path / "a.jsonl", max_new_tokens=8, sampled_variants=0)
    by_batch = generate_responses(BatchGenerator(engine), prompts, tmp_path / "b.jsonl", max_new_tokens=8,
                                  sampled_variants=1, batch_size=8)
    greedy = {r["id"]: r for r in by_batch if r["mode"] == "greedy"}
    assert {r["id"]: r for r in by_engine} == greedy
    assert sorted(r["id"] for r in read_records(tmp_path / "b.jsonl")) == sorted(
        f"{i}:{m}" for i in range(3) for m in ("greedy", "sample0"))
