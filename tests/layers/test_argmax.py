"""argmax_last is torch.argmax over the last dimension: the first maximal index, a NaN counting as maximal."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.argmax import argmax_last

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler for the CPU kernels")
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# Lengths around the 16-lane vectors: shorter than one, whole ones, a tail, and the SmolLM2 vocabulary.
VOCABS = st.sampled_from([1, 5, 15, 16, 17, 31, 32, 33, 100, 1024 + 7, 49_152])


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), vocab=VOCABS, dtype=DTYPES, levels=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_equals_torch_argmax_with_ties(lead, vocab, dtype, levels, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (*lead, vocab), generator=g).to(dtype) - levels  # few values: ties everywhere
    assert torch.equal(argmax_last(x), x.argmax(-1))


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(vocab=VOCABS, dtype=DTYPES, seed=st.integers(0, 2**16), specials=st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from([float("nan"), float("inf"), float("-inf")])),
    max_size=3))
def test_nan_and_infinities_like_torch(vocab, dtype, seed, specials):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, vocab, generator=g).to(dtype)
    for where, value in specials:
        x[0, int(where * vocab)] = value
    x[1] = float("-inf")  # every value equal to -inf: index 0
    assert torch.equal(argmax_last(x), x.argmax(-1))


def test_logits_shape_and_dtype():
    x = torch.randn(2, 3, 49_152, dtype=torch.bfloat16)
    out = argmax_last(x)
    assert out.shape == (2, 3) and out.dtype == torch.long
    assert torch.equal(out, x.argmax(-1))


def test_non_contiguous_rows():
    x = torch.randn(4, 3, 300).transpose(0, 1)
    assert torch.equal(argmax_last(x), x.argmax(-1))
