"""The adaptive draft length against its definition: keep K while tau(K) / t(K) >= 1 / t(0), measure
each side first, and run the other side once every probe_every steps, that interval doubling while plain probes
leave speculation ahead and coming back at any change of choice, and, while plain decoding wins, stretched so that
probes of speculation lose at most probe_budget of plain decoding's tokens; buckets decide independently."""

import pytest

from dflash_trt.engine.adaptive_draft import AdaptiveDraftLen, batch_bucket


def _warm(ctl: AdaptiveDraftLen, batch: int, k: int, spec_s: float, plain_s: float, tokens: int) -> None:
    for i in range(ctl.warmup):  # nothing measured: speculation first, `warmup` times
        assert ctl.choose(batch, k) == k
        ctl.observe(batch, k, spec_s * (5 if i == 0 else 1), [tokens] * batch)  # a slow first call, dropped
    for i in range(ctl.warmup):  # then plain steps
        assert ctl.choose(batch, k) == 0
        ctl.observe(batch, 0, plain_s * (5 if i == 0 else 1), [1] * batch)
    assert ctl._step_s[(batch_bucket(batch), k)] == pytest.approx(spec_s)
    assert ctl._step_s[(batch_bucket(batch), 0)] == pytest.approx(plain_s)


def test_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_speculation_is_turned_off_where_it_gives_fewer_tokens_per_second():
    # tau 1.2 at K=3 for a step 1.4x the plain one: 1.2 / 1.4 = 0.86 plain steps' worth
    ctl = AdaptiveDraftLen(probe_every=8)
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=1)  # tau 1 observed
    ctl.observe(1, 3, 0.014, [2])  # tau 2 once: the mean of 1, 1, 1, 2 is 1.25, 89 tokens/s against 100
    assert ctl._tau[3] == pytest.approx(1.25)
    picks = [ctl.choose(1, 3) for _ in range(30)]
    # K only as the every-8th probe, two steps long (the first catches up on the plain steps' features); no back-off
    # while tau rests on fewer than `settle` speculative steps: it is learned only from them
    assert [i for i, k in enumerate(picks) if k == 3] == [7, 8, 16, 17, 25, 26]


@pytest.mark.parametrize("budget, interval", [(0.011, 46), (0.021, 24), (0.001, 256)])
def test_probes_of_a_losing_speculation_are_spaced_by_what_they_lose(budget, interval):
    """K=3 at 2x a plain step's time with tau 1.75: each two-step probe commits 3.5 tokens where plain steps would have
    committed 4, so probes every n steps lose 0.5 / n of plain decoding's tokens; n keeps that within the budget
    (0.5 / 0.011 = 45.5 -> 46; capped at max_probe_every)."""
    ctl = AdaptiveDraftLen(probe_every=8, probe_budget=budget, settle=4)
    _warm(ctl, 1, 3, spec_s=0.020, plain_s=0.010, tokens=1)
    ctl.observe(1, 3, 0.020, [4])  # tau: the mean of 1, 1, 1, 4
    assert ctl._tau[3] == pytest.approx(1.75)
    picks = [ctl.choose(1, 3) for _ in range(2 * interval + 4)]
    assert [i for i, k in enumerate(picks) if k == 3] == [interval - 1, interval, 2 * interval, 2 * interval + 1]


def test_speculation_stays_on_where_it_pays_and_plain_steps_are_only_probes():
    ctl = AdaptiveDraftLen(probe_every=4)
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=4)  # every draft accepted: tau 4
    assert ctl._tau[3] == pytest.approx(4.0)
    picks = [ctl.choose(1, 3) for _ in range(64)]
    # plain probes only, each confirming speculation, so 4, 8, 16, 32 decisions apart
    assert [i for i, k in enumerate(picks) if k == 0] == [3, 11, 27, 59]


def test_probes_back_off_to_at_most_max_probe_every():
    ctl = AdaptiveDraftLen(probe_every=4, max_probe_every=8)
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=4)
    picks = [ctl.choose(1, 3) for _ in range(40)]
    assert [i for i, k in enumerate(picks) if k == 0] == [3, 11, 19, 27, 35]


def test_a_change_of_choice_brings_probes_back_to_probe_every():
    # tau follows the last step: a sudden change; probes of speculation cost no more than probe_every allows
    ctl = AdaptiveDraftLen(probe_every=4, tau_smoothing=1.0, probe_budget=1.0)
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=4)
    for _ in range(40):  # probes confirm speculation: the interval grows past 16
        k = ctl.choose(1, 3)
        ctl.observe(1, k, 0.014 if k else 0.010, [4] if k else [1])
    assert ctl._probe_interval[1] >= 16
    ctl.observe(1, 3, 0.014, [1])  # the text turns unpredictable: tau 1, plain wins
    picks = [ctl.choose(1, 3) for _ in range(12)]
    # speculation is probed every 4 decisions from the change on, not 16 or more: 2-step probes
    assert picks == [0, 0, 0, 3, 3, 0, 0, 0, 3, 3, 0, 0]


def test_each_batch_bucket_decides_from_its_own_step_times():
    ctl = AdaptiveDraftLen(probe_every=100)
    _warm(ctl, 1, 3, spec_s=0.012, plain_s=0.010, tokens=3)  # one row: K=3 costs 1.2x, tau ~3 -> pays
    for _ in range(3):
        ctl.observe(8, 3, 0.080, [3] * 8)  # eight rows: compute-bound, K=3 costs 4x
        ctl.observe(8, 0, 0.020, [1] * 8)
    assert ctl.choose(1, 3) == 3
    assert ctl.choose(8, 3) == 0  # tau ~3 for a 4x step: plain decoding wins at this batch size
    assert ctl.choose(6, 3) == 0  # same bucket as 8


def test_a_step_the_schedule_runs_without_drafts_stays_without():
    ctl = AdaptiveDraftLen()
    assert ctl.choose(4, 0) == 0


def test_catch_up_steps_count_for_acceptance_but_not_for_step_time():
    ctl = AdaptiveDraftLen()
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=1)  # tau 1
    seen = dict(ctl._seen)
    ctl.observe(1, 3, 0.050, [4], catch_up=True)  # a slow step injecting a plain stretch's features, all accepted
    assert ctl._step_s[(1, 3)] == pytest.approx(0.014) and ctl._seen == seen
    assert ctl._tau[3] == pytest.approx((1 + 1 + 1 + 4) / 4)  # its tau counts: the mean of the four steps


def test_a_paying_drafter_stays_on_when_each_return_from_plain_steps_is_slow():
    """The regression: probes from plain mode timed with their catch-up looked slow and kept speculation off."""
    ctl = AdaptiveDraftLen(probe_every=4)
    for _ in range(ctl.warmup):
        ctl.choose(1, 2)
        ctl.observe(1, 2, 0.012, [1])  # a bad start: nothing accepted, so plain wins for now
    for _ in range(ctl.warmup):
        ctl.choose(1, 2)
        ctl.observe(1, 0, 0.010, [1])
    picks = []
    for _ in range(40):  # from here every block is accepted (tau 3 at 1.2x a plain step's cost)
        k = ctl.choose(1, 2)
        picks.append(k)
        catch_up = k > 0 and picks[-2:-1] == [0]
        ctl.observe(1, k, (0.020 if catch_up else 0.012) if k else 0.010, [3] if k else [1], catch_up)
    assert picks[:5] == [0, 0, 0, 2, 2]  # the probe: a catch-up step, then a steady one
    assert picks[-8:].count(2) >= 6  # speculation back on, plain only as probes


def test_tau_is_the_mean_of_the_measured_steps_not_a_geometric_reading_of_their_mean_rate():
    """Steps of tau 1 and 3 at K=2 average to 2 (2 / 1.8 = 1.11 plain steps' worth per step time); their per-step
    acceptance rates, 0 and 1, average to 0.5, which the geometric model reads as tau 1.75 (0.97: plain wins)."""
    ctl = AdaptiveDraftLen(probe_every=1000)
    for i in range(ctl.warmup):
        assert ctl.choose(1, 2) == 2
        ctl.observe(1, 2, 0.018, [1 if i % 2 else 3])
    for _ in range(ctl.warmup):
        assert ctl.choose(1, 2) == 0
        ctl.observe(1, 0, 0.010, [1])
    picks = []
    for i in range(40):
        picks.append(ctl.choose(1, 2))
        ctl.observe(1, picks[-1], 0.018 if picks[-1] else 0.010, [1 if i % 2 else 3] if picks[-1] else [1])
    assert ctl._tau[2] == pytest.approx(2.0, abs=0.1)
    assert picks == [2] * 40


def test_an_unlucky_start_is_probed_again_at_probe_every_whatever_the_budget():
    """Three speculative steps accepting nothing make plain decoding look better and a probe look costly (0.4 tokens
    a row, 40 steps at the default budget); until tau rests on `settle` steps, probes still come every probe_every,
    so a drafter that pays is back within them."""
    ctl = AdaptiveDraftLen()
    _warm(ctl, 1, 3, spec_s=0.012, plain_s=0.010, tokens=1)
    picks = []
    for _ in range(40):  # from here every block is accepted (tau 4 at 1.2x a plain step's cost)
        k = ctl.choose(1, 3)
        picks.append(k)
        ctl.observe(1, k, 0.012 if k else 0.010, [4] if k else [1], catch_up=k > 0 and picks[-2:-1] == [0])
    assert picks.index(3) == ctl.probe_every - 1
    after = picks[ctl.probe_every + 1:]  # speculation back on after the probe, plain steps only as its probes
    assert after.count(0) <= 1 and after[0] == 3


def test_a_probe_budget_must_be_positive():
    with pytest.raises(ValueError, match="probe_budget must be > 0, got 0"):
        AdaptiveDraftLen(probe_budget=0)
