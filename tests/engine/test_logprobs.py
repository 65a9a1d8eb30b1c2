"""Logprobs: every emitted token carries the target's own log-probability at its position, and the likeliest
alternatives there, on every path (plain, chains, trees, sampled by either rule): transformers' logits are the
oracle, in fp32."""

import pytest
import torch

from dflash_trt import SamplingParams
from tests.engine.test_lossless import NEW, _engine, _prompts, hf_greedy, hf_model
from tests.forced_drafts import force_drafts, force_tree_drafts


def hf_logprobs(target_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log-softmax at the positions that chose each output token."""
    hf = hf_model(target_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], dim=-1)


def assert_target_logprobs(target_dir, prompt, out, top: int) -> None:
    ref = hf_logprobs(target_dir, prompt, out.token_ids)
    assert [x.token_id for x in out.logprobs] == out.token_ids
    got = torch.tensor([x.logprob for x in out.logprobs])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4, rtol=0)
    values, ids = ref.topk(top, dim=-1)
    for x, v, i in zip(out.logprobs, values, ids):
        assert [t for t, _ in x.top] == i.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in x.top]), v, atol=1e-4, rtol=0)


def _truth(tiny_dirs, prompts):
    return {i: p + hf_greedy(tiny_dirs["qwen3"], p) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_each_greedy_token_carries_the_targets_log_probability(tiny_dirs, path):
    """Rows that ask (top 3, top 0) get one entry per token, rows that do not get none; drafts are forced true
    most of the time, so steps emit several tokens (accepted drafts and the bonus) whose positions differ."""
    prompts = _prompts(4)
    if path == "plain":
        engine = _engine(tiny_dirs, "qwen3", 3, speculative=False)
    elif path == "chain":
        engine = _engine(tiny_dirs, "qwen3", 3)
        force_drafts(engine, _truth(tiny_dirs, prompts), error_rate=0.1)
    else:
        engine = _engine(tiny_dirs, "qwen3", 3, draft_tree={4: 6})
        force_tree_drafts(engine, _truth(tiny_dirs, prompts))
    tops = [3, None, 0, 3]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=t))
            for p, t in zip(prompts, tops)]
    while engine.has_unfinished():
        engine.step()
    for p, s, top in zip(prompts, seqs, tops):
        out = engine.make_output(s)
        assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
        if top is None:
            assert out.logprobs is None
        else:
            assert_target_logprobs(tiny_dirs["qwen3"], p, out, top)
    if path != "plain":
        assert max(len(s.stats.acceptance_lengths) and max(s.stats.acceptance_lengths) for s in seqs) > 2


@pytest.mark.parametrize("acceptance, tree", [("match", True), ("match", False), ("rejection", False)])
def test_sampled_tokens_carry_the_targets_raw_log_probability(tiny_dirs, acceptance, tree):
    """Raw log-probabilities: the model's own, before the request's temperature and top-p shaped what it sampled."""
    prompts = _prompts(2)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 5} if tree else {})
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3,
                            acceptance=acceptance, logprobs=2)
    for p, out in zip(prompts, engine.generate(prompts, params)):
        assert len(out.token_ids) == NEW
        assert_target_logprobs(tiny_dirs["qwen3"], p, out, 2)


def test_a_stop_mid_step_keeps_the_logprobs_of_the_tokens_kept(tiny_dirs):
    """A step emits several tokens and the stop token comes first: the tokens past it and their logprobs go."""
    prompt = _prompts(1)[0]
    ref = hf_greedy(tiny_dirs["qwen3"], prompt)
    stop = ref[6]
    engine = _engine(tiny_dirs, "qwen3", 7, rows=1)
    force_drafts(engine, {0: prompt + ref}, error_rate=0.0)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop], logprobs=1))
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    assert_target_logprobs(tiny_dirs["qwen3"], prompt, out, 1)


@pytest.mark.parametrize("n", [-1, 21])
def test_logprobs_outside_0_to_20_are_refused(n):
    with pytest.raises(ValueError, match="logprobs must be in 0..20"):
        SamplingParams(logprobs=n)


@pytest.mark.parametrize("chunk, head_slice", [(8, 256), (512, 256), (512, 7)])
def test_prompt_tokens_carry_the_targets_log_probability_however_the_prompt_is_chunked(tiny_dirs, monkeypatch, chunk,
                                                                                       head_slice):
    """Prompt logprobs (OpenAI's echo): each prompt token after the first, from the prefill forward whose position
    before it chose it, across chunk boundaries and the slices the head computes them in."""
    monkeypatch.setattr("dflash_trt.engine.model_runner.PROMPT_LOGPROB_SLICE", head_slice)
    prompt = _prompts(4)[3]  # 30 tokens: four chunks of 8
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, max_prefill_tokens=chunk)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=4, prompt_logprobs=2))
    hf = hf_model(tiny_dirs["qwen3"])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    assert [x.token_id for x in out.prompt_logprobs] == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([x.logprob for x in out.prompt_logprobs]), want, atol=1e-4, rtol=0)
    assert [[t for t, _ in x.top] for x in out.prompt_logprobs] == ref.topk(2, dim=-1).indices.tolist()
    assert out.logprobs is None
