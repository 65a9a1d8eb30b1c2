"""process_logits against transformers' RepetitionPenaltyLogitsProcessor and a count-by-count reference of OpenAI's
frequency and presence penalties, at positions that count different drafts as output."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from dflash_trt.layers.logits_processors import process_logits
from dflash_trt.layers.sampler import sampling_probs
from dflash_trt.sampling_params import SamplingParams

PROMPT, OUTPUT = [3, 5, 5, 9], [7, 5, 7, 11]
EXTRAS = [[], [12], [12, 7], [12, 7, 3]]  # a chain's drafts before each of its positions


def test_repetition_matches_transformers_over_prompt_and_output_and_the_drafts_before_each_position():
    logits = torch.randn(len(EXTRAS), 16, generator=torch.Generator().manual_seed(0)) * 3
    got = process_logits(logits, SamplingParams(repetition_penalty=1.7), PROMPT, OUTPUT, EXTRAS)
    for j, extra in enumerate(EXTRAS):
        ids = torch.tensor([PROMPT + OUTPUT + extra])
        want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[j:j + 1].clone())[0]
        torch.testing.assert_close(got[j], want)


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.3), (-0.4, 1.1)])
def test_frequency_and_presence_count_the_output_only(presence, frequency):
    logits = torch.randn(len(EXTRAS), 16, generator=torch.Generator().manual_seed(1))
    got = process_logits(logits, SamplingParams(presence_penalty=presence, frequency_penalty=frequency), PROMPT, OUTPUT,
                   EXTRAS)
    for j, extra in enumerate(EXTRAS):
        want = logits[j].clone()
        for t in set(OUTPUT + extra):
            want[t] -= frequency * (OUTPUT + extra).count(t) + presence
        torch.testing.assert_close(got[j], want)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                                {"repetition_penalty": float("inf")}])
def test_penalties_out_of_range_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize("r", [1e-38, 1e38])
def test_an_extreme_repetition_penalty_still_gives_a_distribution(r):
    # past float32's range the seen tokens' logits were inf (or every logit -inf): NaN probabilities, garbage samples
    sign = 1.0 if r < 1 else -1.0
    logits = sign * (torch.rand(1, 16, generator=torch.Generator().manual_seed(2)) * 20 + 1)
    prompt = list(range(16)) if r > 1 else PROMPT
    got = process_logits(logits, SamplingParams(repetition_penalty=r), prompt, OUTPUT, [[]])
    assert torch.isfinite(got).all()
    probs = sampling_probs(got[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[0, 0]
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    if r < 1:  # the mass is on the tokens the penalty raised, the prompt's and the output's
        assert float(probs[sorted(set(PROMPT + OUTPUT))].sum()) > 1 - 1e-5


def test_logit_bias_and_allowed_tokens_match_transformers_processors():
    from transformers import PrefixConstrainedLogitsProcessor, SequenceBiasLogitsProcessor

    logits = torch.randn(len(EXTRAS), 16, generator=torch.Generator().manual_seed(1)) * 3
    bias = {3: 2.5, 7: -100.0, 15: 0.25}
    got = process_logits(logits, SamplingParams(logit_bias=bias), PROMPT, OUTPUT, EXTRAS)
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    for j, extra in enumerate(EXTRAS):
        ids = torch.tensor([PROMPT + OUTPUT + extra])
        torch.testing.assert_close(got[j], ref(ids, logits[j:j + 1].clone())[0])
    allowed = [2, 5, 11]
    got = process_logits(logits, SamplingParams(allowed_token_ids=allowed, logit_bias={5: 1.0}), PROMPT, OUTPUT, EXTRAS)
    only = PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    for j in range(len(EXTRAS)):
        want = only(torch.tensor([PROMPT]), logits[j:j + 1].clone())[0]
        want[5] += 1.0
        torch.testing.assert_close(got[j], want)


@pytest.mark.parametrize("kw, words", [(dict(logit_bias={3: 101.0}), "logit_bias values must be numbers in"),
                                       (dict(logit_bias={3: float("nan")}), "logit_bias values must be numbers in"),
                                       (dict(logit_bias={3: "1"}), "logit_bias values must be numbers in"),
                                       (dict(logit_bias={5.7: 1.0}), "token ids must be integers >= 0"),
                                       (dict(logit_bias={True: 1.0}), "token ids must be integers >= 0"),
                                       (dict(allowed_token_ids=[]), "must not be empty"),
                                       (dict(allowed_token_ids=[40.9]), "token ids must be integers >= 0"),
                                       (dict(allowed_token_ids=[-1]), "token ids must be integers >= 0"),
                                       (dict(min_tokens=2.5), "min_tokens must be an integer"),
                                       (dict(min_tokens=True), "min_tokens must be an integer")])
def test_bad_biases_and_allowed_lists_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_token_sets_built_once_serve_every_step_alike():
    import numpy as np

    from dflash_trt.layers.logits_processors import TokenSets

    params = SamplingParams(logit_bias={np.int64(3): 2.0, 9: -1.5}, allowed_token_ids=[3, 9, 12], min_tokens=6,
                            repetition_penalty=1.3)
    logits = torch.randn(len(EXTRAS), 16, generator=torch.Generator().manual_seed(2))
    sets = TokenSets.of(params, {12, 99}, 16, torch.device("cpu"))  # 99: past the vocabulary, no token
    # by hand: the biases, transformers' repetition penalty, everything but 3, 9 and 12 out, and stop token 12 out
    # where 4 output tokens + 0..3 drafts are under min_tokens 6 (positions 0 and 1)
    want = logits.clone()
    want[:, 3] += 2.0
    want[:, 9] -= 1.5
    for j, extra in enumerate(EXTRAS):
        want[j] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([PROMPT + OUTPUT + extra]), want[j:j + 1])[0]
    want[:, [t for t in range(16) if t not in (3, 9, 12)]] = -torch.inf
    want[:2, 12] = -torch.inf
    for _ in range(2):  # the sets serve step after step
        torch.testing.assert_close(process_logits(logits, params, PROMPT, OUTPUT, EXTRAS, sets=sets), want)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (0.7, 0.3), (1.6, 0.05)])
def test_min_p_keeps_what_transformers_min_p_warper_keeps_after_the_temperature(temperature, min_p):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(len(EXTRAS), 64, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, min_p=min_p)
    got = sampling_probs(process_logits(logits, params, PROMPT, OUTPUT, EXTRAS)[None],
                         torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]))[0]
    ids = torch.tensor([PROMPT])
    warped = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits.clone()))
    torch.testing.assert_close(got, torch.softmax(warped, -1), atol=1e-6, rtol=0)
    assert (got == 0).any()  # it cut something
    greedy = process_logits(logits, SamplingParams(min_p=min_p), PROMPT, OUTPUT, EXTRAS)
    torch.testing.assert_close(greedy, logits)  # greedy: the argmax is kept anyway, so nothing is touched
