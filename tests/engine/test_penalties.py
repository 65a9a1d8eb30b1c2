"""Penalties keep speculation lossless: greedy output under repetition / frequency / presence penalties equals
transformers' model decoding one token at a time under the same penalties (its RepetitionPenaltyLogitsProcessor, and
a count-by-count reference for OpenAI's two), on plain, chain and tree steps; seeded samples under penalties are the
same tokens plain decoding draws, in fp32."""

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from dflash_trt import SamplingParams
from tests.engine.test_lossless import _engine, _prompts
from tests.forced_drafts import force_drafts, force_tree_drafts

NEW = 30
PENALTIES = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.8, presence_penalty=0.4),
             dict(repetition_penalty=1.2, presence_penalty=-0.5)]
_hf: dict = {}


def hf_penalized_greedy(target_dir, prompt: list[int], penalties: dict, new: int = NEW) -> list[int]:
    """One token at a time through transformers' model, penalties applied to each step's logits by the reference."""
    hf = _hf.setdefault(str(target_dir), AutoModelForCausalLM.from_pretrained(target_dir).eval())
    rep = RepetitionPenaltyLogitsProcessor(penalties.get("repetition_penalty", 1.0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
            logits = rep(torch.tensor([ids]), logits)[0]
            out = ids[len(prompt):]
            for t in set(out):
                logits[t] -= penalties.get("frequency_penalty", 0.0) * out.count(t) + penalties.get("presence_penalty", 0.0)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_greedy_under_penalties_equals_transformers_decoding_under_them(tiny_dirs, penalties, path):
    prompts = _prompts(3)
    refs = [hf_penalized_greedy(tiny_dirs["qwen3"], p, penalties) for p in prompts]
    if path == "plain":
        engine = _engine(tiny_dirs, "qwen3", 3, rows=3, speculative=False)
    elif path == "chain":
        engine = _engine(tiny_dirs, "qwen3", 3, rows=3)
        force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.1)
    else:
        engine = _engine(tiny_dirs, "qwen3", 3, rows=3, draft_tree={3: 6})
        force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, **penalties))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
    if path != "plain":
        assert max(max(o.acceptance_lengths) for o in outs) > 2  # steps kept several tokens past drafts penalized


def test_a_batch_mixing_penalized_and_plain_rows_keeps_each_exact(tiny_dirs):
    prompts = _prompts(2)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 5})
    plain, penalized = SamplingParams(max_new_tokens=NEW, ignore_eos=True), SamplingParams(
        max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.5)
    outs = engine.generate(prompts, [plain, penalized])
    assert outs[0].token_ids == hf_penalized_greedy(tiny_dirs["qwen3"], prompts[0], {})
    assert outs[1].token_ids == hf_penalized_greedy(tiny_dirs["qwen3"], prompts[1], dict(repetition_penalty=1.5))


@pytest.mark.parametrize("acceptance, tree", [("match", True), ("match", False), ("rejection", False)])
def test_seeded_samples_under_penalties_are_plain_decodings(tiny_dirs, acceptance, tree):
    """Under the match rule every token is the target's own sample with its position's uniform, so speculation draws
    the tokens plain decoding draws; the rejection rule's tokens depend on the drafts, so there the check is that
    penalized sampling runs and differs from unpenalized."""
    prompts = _prompts(2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=4, acceptance=acceptance,
                            repetition_penalty=1.4, frequency_penalty=0.3)
    spec = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 5} if tree else {}).generate(prompts, params)
    if acceptance == "match":
        plain = _engine(tiny_dirs, "qwen3", 3, rows=2, speculative=False).generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    else:
        unpenalized = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=4,
                                     acceptance=acceptance)
        other = _engine(tiny_dirs, "qwen3", 3, rows=2).generate(prompts, unpenalized)
        assert [o.token_ids for o in spec] != [o.token_ids for o in other]
