"""PositionalUniforms: a request's uniforms indexed by output position, whatever order they are asked for in."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.layers.sampler import PositionalUniforms, known_flags, sampling_probs


def _reference(seed: int, n: int) -> np.ndarray:
    """The documented stream: PCG64 over SeedSequence(2 |seed| + [seed < 0]), float32 draws in order."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(2 * abs(seed) + int(seed < 0)))).random(
        n, dtype=np.float32)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(-(2**70), 2**70), asks=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 20)), max_size=12))
def test_each_position_gets_the_same_uniform_whatever_was_asked_before(seed, asks):
    u, want = PositionalUniforms(seed), _reference(seed, 300)
    for start, n in asks:
        assert np.array_equal(u.at(start, n).numpy(), want[start:start + n])


def test_the_whole_seed_counts_and_values_stay_below_one():
    # torch's CPU generator keeps a seed's low 32 bits: 1 and 2**32 + 1 would sample alike
    assert not np.array_equal(PositionalUniforms(1).at(0, 8).numpy(), PositionalUniforms(2**32 + 1).at(0, 8).numpy())
    for a, b in ((5, -5), (-5, 2**32 + 5), (-(2**40), 2**64 + 2**40)):  # padded word lists would collide these
        assert not np.array_equal(PositionalUniforms(a).at(0, 8).numpy(), PositionalUniforms(b).at(0, 8).numpy())
        assert PositionalUniforms(a).derived_seed() != PositionalUniforms(b).derived_seed()
    values = PositionalUniforms(0).at(0, 100_000)
    assert values.dtype.is_floating_point and float(values.min()) >= 0 and float(values.max()) < 1


def test_an_unseeded_stream_is_fresh():
    assert not np.array_equal(PositionalUniforms(None).at(0, 8).numpy(), PositionalUniforms(None).at(0, 8).numpy())


@pytest.mark.parametrize("seed", [0, 7, -3, 2**64 + 9])
def test_the_derived_seed_fits_a_torch_generator(seed):
    import torch

    u = PositionalUniforms(seed)
    s = u.derived_seed()
    assert 0 <= s < 2**63 and s == u.derived_seed() == PositionalUniforms(seed).derived_seed()
    torch.Generator().manual_seed(s)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(rows=st.lists(st.tuples(st.sampled_from([0.0, 1e-46, 0.5, 1.0]), st.sampled_from([0, 1, 5, 32, 40]),
                               st.sampled_from([1.0, 1.0 - 1e-9, 0.9, 0.5])), min_size=1, max_size=4))
def test_flags_known_on_the_host_give_the_distributions_read_from_the_tensors(rows):
    """known_flags decides truncation and greedy rows as sampling_probs' float32 tensors do (a temperature or top-p
    that rounds to 0 or 1 in float32 included), so passing them changes nothing."""
    temperature, top_k, top_p = (list(c) for c in zip(*rows))
    logits = torch.randn(len(rows), 3, 32, generator=torch.Generator().manual_seed(len(rows)))
    tensors = (torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k),
               torch.tensor(top_p, dtype=torch.float32))
    want = sampling_probs(logits, *tensors)
    assert torch.equal(sampling_probs(logits, *tensors, **known_flags(temperature, top_k, top_p, 32)), want)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.lists(st.tuples(st.sampled_from([0.0, 0.6, 1.0]), st.sampled_from([0, 3, 20]),
                               st.sampled_from([1.0, 0.8])), min_size=2, max_size=4))
def test_a_rows_distribution_depends_on_its_own_settings_alone(rows):
    """Each row of a batch gets the distribution it gets alone, to the bit, whatever the other rows truncate (the
    same request then samples the same tokens however it is batched). A wide, flat vocabulary, where a float32 cumsum
    reaches 1 before the last token."""
    temperature, top_k, top_p = (list(c) for c in zip(*rows))
    logits = 3 * torch.randn(len(rows), 2, 150_000, generator=torch.Generator().manual_seed(len(rows)))
    tensors = (torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p))
    batch = sampling_probs(logits, *tensors)
    for i in range(len(rows)):
        alone = sampling_probs(logits[i : i + 1], *(t[i : i + 1] for t in tensors))
        assert torch.equal(batch[i : i + 1], alone)


def test_a_top_p_below_float32s_least_value_keeps_the_most_likely_token():
    # 1e-46 reads as 0 in float32: no token stayed, and every sample was one fixed token, not the argmax
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    probs = sampling_probs(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1e-46, 1e-46]))
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_the_cdf_summed_in_double_as_off_the_cpu_is_the_cpus_own():
    """sample_from sums a CDF in double off the CPU (torch's CUDA cumsum adds float32 in float32) so that a seeded
    request draws the same tokens from plain, tree and Triton-verified steps; that is the CPU's float32 cumsum only
    while torch's CPU kernel adds in double, as here: a 152k-token vocabulary, where float32 sums drift."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 151_936, generator=g) * 3, dim=-1)
    assert torch.equal(probs.cumsum(-1), probs.cumsum(-1, dtype=torch.float64).float())
    in_float32 = torch.from_numpy(np.cumsum(probs.numpy(), axis=-1, dtype=np.float32))  # sequential float32 sums
    assert not torch.equal(in_float32, probs.cumsum(-1))  # the check's power: those do drift from it
