"""The CPU kernels (dflash_trt/kernels/cpu_ops.c) against torch: RMSNorm against transformers' LlamaRMSNorm,
cached attention against SDPA over exactly the keys each query may see."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.attention import AttentionMetadata, cached_attention

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler (the torch ops run instead)")


def _within_one_ulp(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    # bf16 keeps 8 significant bits: a sum taken in another order may round the last one the other way.
    return bool(((ours.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7 + 1e-30).all())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), dim=st.sampled_from([8, 64, 576, 1000]), scale=st.sampled_from([1e-3, 1.0, 600.0]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 99), residual=st.booleans())
def test_rms_norm_matches_the_reference(rows, dim, scale, dtype, seed, residual):
    # scale 600 mimics SmolLM2's massive-activation channels, where a sum kept in bf16 would overflow or drift
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 3, dim, generator=g) * scale).to(dtype)
    r = (torch.randn(rows, 3, dim, generator=g) * scale).to(dtype) if residual else None
    w = torch.randn(dim, generator=g).to(dtype)
    ref = LlamaRMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
        normed, total = ops.rms_norm(x, w, 1e-5, r)
        if residual:
            assert torch.equal(total, x + r)  # the residual sum is rounded exactly as torch's add rounds it
            x = x + r
        want = ref(x)
    if dtype == torch.float32:
        torch.testing.assert_close(normed, want, rtol=2e-6, atol=1e-7)
    else:
        assert _within_one_ulp(normed, want)
        assert (normed == want).float().mean() > 0.97


def _cache(rows: int, max_len: int, kvh: int, d: int, dtype, g) -> KVCache:
    cache = KVCache(num_layers=2, num_rows=rows, max_len=max_len, num_kv_heads=kvh, head_dim=d, dtype=dtype)
    # Stale entries hold huge values: a key read past a query's count would swamp its output.
    cache.k.copy_(torch.randn(cache.k.shape, generator=g) * 1e4)
    cache.v.copy_(torch.randn(cache.v.shape, generator=g) * 1e4)
    return cache


def _sdpa_per_query(q, cache, layer, rows, lens, scale, window=None):
    """The oracle: SDPA (fp32) of each query over exactly its visible keys."""
    out = []
    for i in range(q.shape[0]):
        end = int(lens[i])
        start = max(0, end - window) if window else 0
        k = cache.k[layer, int(rows[i]), :, start:end].float()[None]
        v = cache.v[layer, int(rows[i]), :, start:end].float()[None]
        o = F.scaled_dot_product_attention(q[i].float()[None, :, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 2, 80), (16, 4, 128)])
@pytest.mark.parametrize("window", [None, 5])
def test_cached_attention_kernel_equals_sdpa_over_the_visible_keys(dtype, heads, kv_heads, d, window):
    g = torch.Generator().manual_seed(heads * d)
    cache = _cache(6, 96, kv_heads, d, dtype, g)
    rows = torch.tensor([4, 0, 5, 5, 2, 1, 3])  # unordered, one row twice (two queries of a verify block)
    lens = torch.tensor([1, 96, 37, 38, 64, 2, 70])
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    got = ops.cached_attention(q, cache.k[1], cache.v[1], rows, lens, 0.2, window)
    want = _sdpa_per_query(q, cache, 1, rows, lens, 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bf16: the output's own rounding, on values of about 1e4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 1e4 if dtype == torch.bfloat16 else tol)


def test_cached_attention_takes_the_kernel_for_verify_blocks_in_inference():
    """A 4-query causal block per row through cached_attention, as verify runs it: each query sees its own
    and the earlier keys of its row, freshly written ones included."""
    g = torch.Generator().manual_seed(7)
    cache = _cache(4, 64, 2, 32, torch.float32, g)
    rows = torch.tensor([3, 1])
    positions = torch.tensor([[10, 11, 12, 13], [40, 41, 42, 43]])
    meta = AttentionMetadata.causal_step(rows, positions)
    q = torch.randn(2, 6, 4, 32, generator=g)
    k, v = torch.randn(2, 4, 2, 32, generator=g), torch.randn(2, 4, 2, 32, generator=g)
    with torch.inference_mode():
        got = cached_attention(cache, 0, meta, q, k, v, scale=0.3)
    assert torch.equal(cache.k[0, 3, :, 10:14], k[0].transpose(0, 1))  # the step's keys were written first
    flat_rows, lens, longest = meta.query_keys()
    assert longest == 44
    want = _sdpa_per_query(q.transpose(1, 2).reshape(8, 6, 32), cache, 0, flat_rows, lens, 0.3)
    torch.testing.assert_close(got, want.reshape(2, 4, 6 * 32), rtol=1e-5, atol=1e-5)


def test_cached_attention_refuses_queries_past_the_cache():
    cache = KVCache(num_layers=1, num_rows=2, max_len=16, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    meta = AttentionMetadata.causal_step(torch.tensor([0, 1]), torch.tensor([[16], [3]]))
    with torch.inference_mode(), pytest.raises(ValueError, match="position 16"):
        cached_attention(cache, 0, meta, torch.zeros(2, 2, 1, 32), torch.ones(2, 1, 1, 32), torch.ones(2, 1, 1, 32), 1.0)
    assert not cache.k.any() and not cache.v.any()  # row 0's position 16 would have been row 1's position 0


def test_kernels_stand_aside_for_autograd_and_other_dtypes():
    x = torch.ones(2, 8, requires_grad=True)
    assert cpu_ops.for_tensors(x) is None  # training differentiates through torch's ops
    with torch.no_grad():
        assert cpu_ops.for_tensors(x) is ops
        assert cpu_ops.for_tensors(x.half()) is None
        assert cpu_ops.for_tensors(x, x.bfloat16()) is None


def test_the_build_is_cached_and_keyed_by_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    first = cpu_ops.build()
    assert first.parent == tmp_path / "cpu_ops" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_ops.build() == first and first.stat().st_mtime_ns == stamp  # a second build reuses the library
