"""Block verification rules against hand-computed cases and the target distribution."""

import torch

from dflash_trt.layers.sampler import sample_from, sampling_probs
from dflash_trt.spec.verifier import verify_greedy, verify_match, verify_rejection
from tests.stats import assert_matches, chi2_statistic, chi2_critical


def _one_hot_logits(tokens, vocab=6):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()[None] * 5


def test_greedy_accepts_the_matching_prefix_and_the_bonus_is_the_target_choice():
    # target argmax per block slot: 3 4 1 5; drafts 3 4 2 -> two accepted, bonus = argmax at slot 2 = 1
    r = verify_greedy(torch.tensor([[3, 4, 2]]), _one_hot_logits([3, 4, 1, 5]))
    assert r.num_accepted.tolist() == [2] and r.bonus.tolist() == [1]
    assert r.emitted(torch.tensor([[3, 4, 2]])) == [[3, 4, 1]]


def test_greedy_all_accepted_emits_k_plus_one_and_none_accepted_emits_one():
    logits = torch.cat([_one_hot_logits([1, 2, 3, 4]), _one_hot_logits([1, 2, 3, 4])])
    r = verify_greedy(torch.tensor([[1, 2, 3], [0, 2, 3]]), logits)
    assert r.num_accepted.tolist() == [3, 0]
    assert r.bonus.tolist() == [4, 1]


def test_a_later_match_after_a_mismatch_is_not_accepted():
    r = verify_greedy(torch.tensor([[9 % 6, 2, 3]]), _one_hot_logits([1, 2, 3, 4]))
    assert r.num_accepted.tolist() == [0]


def _gens(n, seed):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_sampler_follows_temperature_top_k_top_p_in_zlab_order():
    import pytest

    ref = pytest.importorskip("dflash.model")
    logits = torch.randn(3, 2, 50)
    for t, k, p in [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 10, 0.6)]:
        got = sampling_probs(logits, torch.full((3,), t), torch.full((3,), k, dtype=torch.long), torch.full((3,), p))
        want = ref._sampling_probs(logits, t, p, k)
        assert torch.allclose(got, want, atol=1e-6), (t, k, p)


def test_zero_probability_tokens_are_never_sampled():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4000, -1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    assert set(sample_from(probs, u).tolist()) == {1, 3}


def _rule_samples(rule, n=6000, vocab=5, seed=0):
    """Emitted first token of a K=1 block, n independent rows sharing p and q."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(1, 2, vocab, generator=g) * 1.5, -1).expand(n, -1, -1)
    q = torch.softmax(torch.randn(1, 1, vocab, generator=g) * 1.5, -1).expand(n, -1, -1)
    gens = _gens(n, seed + 100)
    if rule == "rejection":
        u = torch.stack([torch.rand(1, generator=x) for x in _gens(n, seed + 10_000)])
        draft = sample_from(q, u)
        r = verify_rejection(draft, q, p, gens)
    else:
        draft = q.argmax(-1)
        r = verify_match(draft, p, gens)
    first = torch.where(r.num_accepted > 0, draft[:, 0], r.bonus)
    return first.tolist(), p[0, 0], r


def test_rejection_sampling_preserves_the_target_distribution():
    samples, p0, r = _rule_samples("rejection")
    assert 0 < r.num_accepted.float().mean() < 1  # both branches are exercised
    assert_matches(samples, {i: float(p0[i]) for i in range(5)})


def test_target_sample_and_match_preserves_the_target_distribution():
    samples, p0, r = _rule_samples("match")
    assert 0 < r.num_accepted.float().mean() < 1
    assert_matches(samples, {i: float(p0[i]) for i in range(5)})


def test_the_statistical_check_can_fail():
    """Emitting the draft distribution instead of the target's must be caught by the same bound."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(5, generator=g) * 1.5, -1)
    u = torch.rand(6000, generator=torch.Generator().manual_seed(1))
    wrong = sample_from(q.expand(6000, -1), u).tolist()
    stat, df = chi2_statistic(wrong, {i: float(p[i]) for i in range(5)})
    assert stat > chi2_critical(df)
