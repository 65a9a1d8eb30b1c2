"""The adaptive draft length against its definition: keep K while tau(alpha, K) / t(K) >= 1 / t(0), measure
each side first, and run the other side once every probe_every steps; buckets decide independently."""

import pytest

from dflash_trt.engine.adaptive_draft import AdaptiveDraftLen, batch_bucket
from dflash_trt.spec.acceptance_model import tau_from_acceptance


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
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=1)  # tau 1 observed, alpha 0
    ctl.observe(1, 3, 0.014, [2])  # tau 2 once: alpha > 0 in the running mean, but not enough
    assert tau_from_acceptance(ctl.alpha, 3) / 0.014 < 1 / 0.010
    picks = [ctl.choose(1, 3) for _ in range(16)]
    assert picks.count(3) == 2 and picks.count(0) == 14  # K only as the every-8th probe
    assert [i for i, k in enumerate(picks) if k == 3] == [7, 15]  # every 8th decision


def test_speculation_stays_on_where_it_pays_and_plain_steps_are_only_probes():
    ctl = AdaptiveDraftLen(probe_every=4)
    _warm(ctl, 1, 3, spec_s=0.014, plain_s=0.010, tokens=4)  # every draft accepted: alpha 1, tau 4
    assert ctl.alpha == pytest.approx(1.0, abs=1e-6)
    picks = [ctl.choose(1, 3) for _ in range(8)]
    assert picks == [3, 3, 3, 0, 3, 3, 3, 0]  # every 4th decision is a plain probe


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
