"""Logits processors keep speculation lossless: greedy output under repetition / frequency / presence penalties
equals transformers' model decoding one token at a time under the same penalties (its RepetitionPenaltyLogitsProcessor,
and a count-by-count reference for OpenAI's two), and under min_tokens, logit_bias and allowed_token_ids transformers'
generate with min_new_tokens, sequence_bias and prefix_allowed_tokens_fn, on plain, chain and tree steps; seeded
samples under them are the same tokens plain decoding draws, in fp32."""

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from dflash_trt import SamplingParams
from tests.engine.conftest import V
from tests.engine.test_lossless import _engine, _prompts, hf_model
from tests.forced_drafts import force_drafts, force_tree_drafts

NEW = 30
PENALTIES = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.8, presence_penalty=0.4),
             dict(repetition_penalty=1.2, presence_penalty=-0.5)]
def hf_penalized_greedy(target_dir, prompt: list[int], penalties: dict, new: int = NEW) -> list[int]:
    """One token at a time through transformers' model, penalties applied to each step's logits by the reference."""
    hf = hf_model(target_dir)
    rep = RepetitionPenaltyLogitsProcessor(penalties.get("repetition_penalty", 1.0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
            logits = rep(torch.tensor([ids]), logits)[0]
            out = ids[len(prompt):]
            for t in set(out):
                frequency, presence = penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0)
                logits[t] -= frequency * out.count(t) + presence
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def _engine_on(tiny_dirs, path, prompts, truths):
    """A 3-row engine whose steps are plain, chains or trees; speculative ones draft `truths` (prompt + answer)."""
    if path == "plain":
        return _engine(tiny_dirs, "qwen3", 3, rows=3, speculative=False)
    if path == "chain":
        engine = _engine(tiny_dirs, "qwen3", 3, rows=3)
        force_drafts(engine, {i: p + t for i, (p, t) in enumerate(zip(prompts, truths))}, error_rate=0.1)
        return engine
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, draft_tree={3: 6})
    force_tree_drafts(engine, {i: p + t for i, (p, t) in enumerate(zip(prompts, truths))})
    return engine


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_greedy_under_penalties_equals_transformers_decoding_under_them(tiny_dirs, penalties, path):
    prompts = _prompts(3)
    refs = [hf_penalized_greedy(tiny_dirs["qwen3"], p, penalties) for p in prompts]
    engine = _engine_on(tiny_dirs, path, prompts, refs)
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


@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_greedy_under_min_tokens_equals_transformers_generate_with_min_new_tokens(tiny_dirs, path):
    """The stop tokens are the ones the target chooses second and fourth without min_tokens, and drafts proposing
    them early (the unconstrained answer's) must be refused until the output holds min_tokens tokens."""
    prompts, minimum = _prompts(3), 12
    free = [hf_penalized_greedy(tiny_dirs["qwen3"], p, {}) for p in prompts]
    stops = sorted({f[1] for f in free} | {f[3] for f in free})
    hf = hf_model(tiny_dirs["qwen3"])
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=minimum, do_sample=False,
                        eos_token_id=stops, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(r) > minimum for r in refs) and any(len(r) < NEW for r in refs)  # min_tokens held, then a stop
    engine = _engine_on(tiny_dirs, path, prompts, free)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=stops,
                                                   min_tokens=minimum))
    assert [o.token_ids for o in outs] == refs
    assert all(o.finish_reason == ("stop" if len(r) < NEW else "length") for o, r in zip(outs, refs))


def test_seeded_samples_under_min_tokens_never_stop_early_and_are_plain_decodings(tiny_dirs):
    prompt = _prompts(1)[0]
    first = hf_penalized_greedy(tiny_dirs["qwen3"], prompt, {}, new=1)[0]  # the likeliest first token: a stop now

    def sample(engine, minimum):
        params = [SamplingParams(max_new_tokens=4, temperature=0.5, seed=s, stop_token_ids=[first], ignore_eos=True,
                                 min_tokens=minimum) for s in range(40)]
        return [o.token_ids for o in engine.generate([prompt] * 40, params)]

    free = sample(_engine(tiny_dirs, "qwen3", 3, rows=4, speculative=False), 0)
    assert sum(ids[0] == first for ids in free) > 4  # without min_tokens it often stops at once
    held = sample(_engine(tiny_dirs, "qwen3", 3, rows=4, speculative=False), 3)
    assert all(first not in ids[:3] and len(ids) >= 3 for ids in held)
    assert sample(_engine(tiny_dirs, "qwen3", 3, rows=4, draft_tree={4: 5}), 3) == held


def test_min_tokens_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens must be in 0..max_new_tokens \(4\), got 5"):
        SamplingParams(max_new_tokens=4, min_tokens=5)


@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_greedy_under_logit_bias_and_allowed_tokens_equals_transformers_generate(tiny_dirs, path):
    prompts = _prompts(3)
    hf = hf_model(tiny_dirs["qwen3"])
    free = [hf_penalized_greedy(tiny_dirs["qwen3"], p, {}) for p in prompts]
    # push away the tokens the target chose first and second, and pull one it did not choose
    bias = {**{f[0]: -100.0 for f in free}, **{f[1]: -3.0 for f in free}, 40: 4.0}
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                        sequence_bias={(t,): b for t, b in bias.items()})[0, len(p):].tolist() for p in prompts]
    assert all(r != f for r, f in zip(refs, free))
    engine = _engine_on(tiny_dirs, path, prompts, free)  # drafts of the unbiased answers: some must be refused
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logit_bias=bias))
    assert [o.token_ids for o in outs] == refs
    allowed = sorted({t for r in refs for t in r[::2]})
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                        prefix_allowed_tokens_fn=lambda batch, ids: allowed)[0, len(p):].tolist() for p in prompts]
    outs = _engine_on(tiny_dirs, path, prompts, free).generate(
        prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, allowed_token_ids=allowed))
    assert [o.token_ids for o in outs] == refs and all(set(r) <= set(allowed) for r in refs)


def test_seeded_samples_under_logit_bias_are_plain_decodings_and_ids_past_the_vocabulary_are_refused(tiny_dirs):
    prompts = _prompts(2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=4,
                            logit_bias={40: 3.0, 41: -2.0}, allowed_token_ids=list(range(20, 60)))
    spec = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 5}).generate(prompts, params)
    plain = _engine(tiny_dirs, "qwen3", 3, rows=2, speculative=False).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(20 <= t < 60 for o in spec for t in o.token_ids)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, speculative=False)
    vocab = engine.target.config.vocab_size
    for kw in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[1, vocab + 5])):
        with pytest.raises(ValueError, match=rf"token ids must be in 0..{vocab - 1}"):
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, **kw))


def test_allowed_tokens_that_min_tokens_masks_all_are_refused(tiny_dirs):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, speculative=False)
    with pytest.raises(ValueError, match="allowed_token_ids are all stop tokens, which min_tokens masks"):
        engine.generate(_prompts(1), SamplingParams(max_new_tokens=4, stop_token_ids=[40, 41],
                                                    allowed_token_ids=[41, 40], min_tokens=2))
    out = engine.generate(_prompts(1), SamplingParams(max_new_tokens=4, stop_token_ids=[40], min_tokens=2,
                                                      allowed_token_ids=[40, 41]))[0]
    assert out.token_ids[:2] == [41, 41]  # the one token left to choose until min_tokens


def test_min_tokens_takes_a_row_off_the_argmax_path_only_while_it_holds_a_stop_token():
    """A greedy row's plain argmax (the head's int8 screen, for its whole batch) is lost only while min_tokens masks
    something: never with no stop token to hold (ignore_eos, as benchmark clients send it), and not once the answer is
    that long."""
    from dflash_trt.engine.sequence import Sequence

    held = Sequence([5, 6], SamplingParams(max_new_tokens=8, min_tokens=3), eos_token_ids=(2,))
    assert not held.plain_greedy
    held.output_ids = [7, 8, 9]
    assert held.plain_greedy
    free = Sequence([5, 6], SamplingParams(max_new_tokens=8, min_tokens=8, ignore_eos=True), eos_token_ids=(2,))
    assert free.stop_ids == set() and free.plain_greedy
    biased = Sequence([5, 6], SamplingParams(max_new_tokens=8, logit_bias={3: 1.0}), eos_token_ids=(2,))
    biased.output_ids = [7] * 7
    assert not biased.plain_greedy


def _exact_joint_min_p(target_dir, prompt, temperature, min_p, vocab, new=4):
    """P(x_1..x_new | prompt) under the target with transformers' temperature and min-p warpers, by enumeration."""
    import itertools

    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seqs = list(itertools.product(range(vocab), repeat=new))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1: -1].float()
    flat = logits.reshape(-1, vocab)
    warped = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temperature)(ids, flat)).reshape(logits.shape)
    picked = torch.softmax(warped, -1).gather(-1, ids[:, len(prompt):, None])[..., 0]
    return {s: float(p) for s, p in zip(seqs, picked.prod(-1))}


@pytest.mark.parametrize("rule, tree", [("rejection", {}), ("match", {1500: 5})], ids=["rejection-chain", "match-tree"])
def test_sampled_output_under_min_p_follows_the_target_distribution_under_it(small_vocab, rule, tree):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
    from dflash_trt.models.dflash import load_drafter
    from dflash_trt.models.registry import load_target
    from tests.stats import assert_matches

    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint_min_p(t, prompt, 1.5, 0.5, V)
    assert sum(p == 0 for p in expected.values()) > len(expected) / 2  # min_p rules out most outcomes
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config),
                       EngineConfig(max_batch_size=1500, max_draft_len=3, draft_tree=tree))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=1.5, min_p=0.5, seed=s, acceptance=rule, ignore_eos=True)
              for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 10  # drafts accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)
