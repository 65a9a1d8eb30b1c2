"""The CPU kernels (dflash_trt/kernels/cpu_ops.c) against torch: RMSNorm against transformers' LlamaRMSNorm,
cached attention against SDPA over exactly the keys each query may see, rotary + cache write against
transformers' apply_rotary_pos_emb, the gated activation against F.silu."""

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.hardware import cpu_flags
from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.attention import AttentionMetadata, kernel_step
from dflash_trt.layers.rotary import RotaryEmbedding

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


@pytest.fixture(params=["native", "avx2_ops", "avx512f_ops", "avx512bf16_ops"])
def attention_ops(request):
    """This CPU's build (with AMX: a run's scores through tiles), and builds without AMX: with AVX512-BF16 dot products
    (Cooper Lake's), and without them (an AVX2 laptop's, Skylake's), whose bf16 attention widens keys and values to
    fp32 in eight lanes."""
    return ops if request.param == "native" else request.getfixturevalue(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 2, 80), (16, 4, 128)])
@pytest.mark.parametrize("window", [None, 5])
def test_cached_attention_kernel_equals_sdpa_over_the_visible_keys(attention_ops, dtype, heads, kv_heads, d,
                                                                   window):
    """Key counts on both sides of the kernel's 16- and 8-key blocks; and each query alone gives its batched output bit
    for bit, which is what lets a one-token decode and a K-token verify agree."""
    g = torch.Generator().manual_seed(heads * d)
    cache = _cache(6, 96, kv_heads, d, dtype, g)
    # unordered, rows 5 and 2 holding a verify block each (row 2's last query the one its window of 5 hides keys from)
    rows = torch.tensor([4, 0, 5, 5, 2, 1, 3, 0, 2, 2, 2])
    lens = torch.tensor([1, 96, 37, 38, 64, 2, 70, 16, 3, 4, 6])
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    got = attention_ops.cached_attention(q, cache.k[1], cache.v[1], rows, lens, 0.2, window)
    want = _sdpa_per_query(q, cache, 1, rows, lens, 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bf16: the output's own rounding, on values of about 1e4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 1e4 if dtype == torch.bfloat16 else tol)
    alone = [attention_ops.cached_attention(q[i : i + 1], cache.k[1], cache.v[1], rows[i : i + 1], lens[i : i + 1],
                                            0.2, window) for i in range(len(rows))]
    assert torch.equal(got, torch.cat(alone))


def _sink_attention_per_query(q, cache, layer, rows, lens, scale, sinks, window=None):
    """The oracle for gpt-oss's attention: float64 scores of each query over its visible keys, the head's sink logit
    joined to them in the softmax, its probability dropped (as transformers' GptOss eager attention does)."""
    out = []
    for i in range(q.shape[0]):
        end = int(lens[i])
        start = max(0, end - window) if window else 0
        k = cache.k[layer, int(rows[i]), :, start:end].double()  # [KVH, T, D]
        v = cache.v[layer, int(rows[i]), :, start:end].double()
        g = q.shape[1] // k.shape[0]
        scores = torch.einsum("hd,htd->ht", q[i].double(), k.repeat_interleave(g, 0)) * scale  # [H, T]
        probs = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=-1), dim=-1)[:, :-1]
        out.append(torch.einsum("ht,htd->hd", probs, v.repeat_interleave(g, 0)))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sink_scale", [0.5, 8.0])
def test_cached_attention_with_sinks_equals_the_softmax_with_each_heads_sink(attention_ops, dtype, window,
                                                                              sink_scale):
    """gpt-oss's per-head sink logits in the softmax's denominator: against a float64 reference, with sinks about as
    large as the scores (0.5) and far above them (8: the sink takes most of the weight); each query alone gives its
    batched output bit for bit, as a one-token decode and a K-token verify need."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d = 8, 2, 64
    cache = _cache(6, 96, kv_heads, d, dtype, g)
    cache.k.mul_(1e-4)  # scores of about 1, where a sink of 0.5 competes with the keys
    cache.v.mul_(1e-4)
    rows = torch.tensor([4, 0, 5, 5, 2, 1, 3, 0, 2, 2, 2])
    lens = torch.tensor([1, 96, 37, 38, 64, 2, 70, 16, 3, 4, 6])
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    sinks = (torch.randn(heads, generator=g) * sink_scale).to(dtype)
    got = attention_ops.cached_attention(q, cache.k[1], cache.v[1], rows, lens, 0.2, window, sinks=sinks)
    want = _sink_attention_per_query(q, cache, 1, rows, lens, 0.2, sinks.float(), window)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    without = attention_ops.cached_attention(q, cache.k[1], cache.v[1], rows, lens, 0.2, window)
    assert not torch.allclose(got.float(), without.float(), rtol=tol, atol=tol)  # the sinks were read
    alone = [attention_ops.cached_attention(q[i : i + 1], cache.k[1], cache.v[1], rows[i : i + 1], lens[i : i + 1],
                                            0.2, window, sinks=sinks) for i in range(len(rows))]
    assert torch.equal(got, torch.cat(alone))
    with pytest.raises(ValueError, match="sinks of shape"):
        attention_ops.cached_attention(q, cache.k[1], cache.v[1], rows, lens, 0.2, window, sinks=sinks[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2, 6, 20, 44])
def test_tree_attention_sees_only_the_prefix_and_each_nodes_ancestors(attention_ops, dtype, window):
    """A draft tree's verify (spec/draft_tree.py): nodes at consecutive positions from `start`, each seeing the keys
    before `start` and, of the tree's own, its ancestors and itself. Against SDPA over exactly those keys; and bit for
    bit the output the same query gets when its ancestors sit contiguously after the prefix (a chain), which is what
    keeps a tree's verify as exact as a chain's. A sliding window counts from the node's depth, as in that chain: a
    window of 2 leaves a node its parent alone, 6 the node of depth 4 one key of the prefix, 20 hides the prefix's
    first 21-25 keys, 44 only the deepest node's first (the others share a run)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, start = 9, 3, 64, 40
    cache = _cache(2, 96, kv_heads, d, dtype, g)
    parents = [-1, 0, 0, 1, 2, 3, 1, 5]  # node 0 the root; every parent before its children
    ancestors = []
    for node, parent in enumerate(parents):
        ancestors.append((ancestors[parent] if parent >= 0 else 0) | (1 << node))
    n = len(parents)
    rows = torch.full((n,), 1)
    lens = start + torch.arange(n) + 1
    tree = torch.tensor([[start, bits] for bits in ancestors], dtype=torch.int64)
    # scores of about 1: a spread softmax, where the order of its sum shows
    q = (torch.randn(n, heads, d, generator=g) * 1e-4).to(dtype)
    got = attention_ops.cached_attention(q, cache.k[0], cache.v[0], rows, lens, 0.125, window, tree)

    # the chain arrangement: node j's prefix then its ancestors in order, copied into another cache row
    for j in range(n):
        keys = list(range(start)) + [start + i for i in range(n) if ancestors[j] >> i & 1]
        for layer_cache in (cache.k, cache.v):
            layer_cache[0, 0, :, : len(keys)] = layer_cache[0, 1, :, keys]
        chain = attention_ops.cached_attention(q[j : j + 1], cache.k[0], cache.v[0], torch.tensor([0]),
                                               torch.tensor([len(keys)]), 0.125, window)
        want = _sdpa_per_query(q[j : j + 1], cache, 0, torch.tensor([0]), torch.tensor([len(keys)]), 0.125, window)
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(got[j : j + 1].float(), want, rtol=tol, atol=tol * 1e4)  # values of about 1e4
        assert torch.equal(got[j : j + 1], chain), f"node {j}"


def test_tree_attention_refuses_a_malformed_tree():
    cache = _cache(1, 16, 1, 32, torch.float32, torch.Generator().manual_seed(0))
    q, rows, lens = torch.zeros(2, 1, 32), torch.zeros(2, dtype=torch.long), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="tree"):
        ops.cached_attention(q, cache.k[0], cache.v[0], rows, lens, 1.0, tree=torch.zeros(2, dtype=torch.long))


def test_indices_the_kernels_would_misread_are_refused():
    # a strided lens view was read as contiguous int64, past the cache: values of 1e28 where 0 was due
    cache = _cache(2, 16, 1, 32, torch.float32, torch.Generator().manual_seed(0))
    q, rows = torch.zeros(2, 1, 32), torch.zeros(2, dtype=torch.long)
    misread = ((torch.tensor([[3, 9], [4, 9]])[:, 0], "strided"),
               (torch.tensor([3, 4], dtype=torch.int32), "torch.int32"), (torch.tensor([3]), "[2]"))
    for lens, words in misread:
        with pytest.raises(ValueError, match=f"lens must be a contiguous int64.*{words}"):
            ops.cached_attention(q, cache.k[0], cache.v[0], rows, lens, 1.0)
    with pytest.raises(ValueError, match="query heads of 16 over 1 KV heads of 32"):
        ops.cached_attention(torch.zeros(2, 2, 16), cache.k[0], cache.v[0], rows, torch.tensor([3, 4]), 1.0)
    qkv, cos = torch.zeros(2, 3 * 32), torch.zeros(2, 32)
    with pytest.raises(ValueError, match="positions must be a contiguous int64"):
        ops.qkv_rotary_write(qkv, cos, cos, rows, torch.tensor([1, 2], dtype=torch.int32), cache.k[0], cache.v[0], 1)


def test_a_linear_whose_input_is_not_the_weights_width_is_refused():
    # 2 rows of 96 inputs over a 64-input weight: the kernel wrote 3 rows into an output of 2, corrupting the heap
    weight = ops.kernel_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="with 96 inputs, the weight takes torch.bfloat16 with 64"):
        ops.linear(torch.zeros(2, 96, dtype=torch.bfloat16), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim, qk_norm", [(64, False), (32, False), (64, True)])
def test_qkv_rotary_write_equals_transformers_rotary_and_an_indexed_write(dtype, rotary_dim, qk_norm):
    """Two rows x 3 tokens of fused q/k/v: q comes back rotated; k (rotated) and v land at (row, position) and
    nowhere else. bf16 results are bit-identical: the kernel rounds each product where torch's ops round."""
    g = torch.Generator().manual_seed(rotary_dim)
    heads, kv_heads, d = 4, 2, 64
    rows, positions = torch.tensor([3, 1]), torch.tensor([[5, 6, 7], [0, 1, 2]])
    qkv = torch.randn(2, 3, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    rope = RotaryEmbedding(rotary_dim, {"rope_theta": 10000.0}, 64)
    cos, sin = rope(positions, dtype)  # [B, 1, T, rotary_dim]
    norms = None
    q, k, v = qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k, v = q.view(2, 3, heads, d), k.view(2, 3, kv_heads, d), v.view(2, 3, kv_heads, d)
    if qk_norm:
        qn, kn = LlamaRMSNorm(d, 1e-6).to(dtype), LlamaRMSNorm(d, 1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(d, generator=g)), kn.weight.copy_(torch.randn(d, generator=g))
            q, k = qn(q), kn(k)
        norms = (qn.weight.detach(), kn.weight.detach(), 1e-6)
    rot_q, rot_k = apply_rotary_pos_emb(q[..., :rotary_dim].transpose(1, 2), k[..., :rotary_dim].transpose(1, 2),
                                        cos[:, 0], sin[:, 0])
    want_q = torch.cat([rot_q.transpose(1, 2), q[..., rotary_dim:]], -1)
    want_k = torch.cat([rot_k.transpose(1, 2), k[..., rotary_dim:]], -1)
    cache = KVCache(num_layers=1, num_rows=4, max_len=8, num_kv_heads=kv_heads, head_dim=d, dtype=dtype)
    flat_rows, flat_pos = rows.repeat_interleave(3), positions.reshape(-1)
    with torch.no_grad():
        got_q = ops.qkv_rotary_write(qkv, cos, sin, flat_rows, flat_pos, cache.k[0], cache.v[0], heads, norms)
    exact = dtype == torch.bfloat16 and not qk_norm  # a norm's sum order may move a bf16 ulp before the rotary
    check = torch.testing.assert_close if not exact else (lambda a, b: torch.equal(a, b) or pytest.fail("not bitwise"))
    check(got_q, want_q.reshape(6, heads, d))
    for b, row in enumerate(rows.tolist()):
        check(cache.k[0, row, :, positions[b]], want_k[b].transpose(0, 1))
        assert torch.equal(cache.v[0, row, :, positions[b]], v[b].transpose(0, 1))
    written = torch.zeros(4, 8, dtype=torch.bool)
    written[3, 5:8] = written[1, 0:3] = True
    assert not cache.k[0].transpose(1, 2)[~written].any() and not cache.v[0].transpose(1, 2)[~written].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_torch(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 2, 2 * 1536, generator=g) * 6).to(dtype)  # big gates: both tails of the sigmoid
    gate_up[0, 0, :4] = torch.tensor([-100.0, -88.0, 0.0, 100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    with torch.no_grad():
        got = ops.silu_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-30)
    else:
        assert _within_one_ulp(got, want) and (got == want).float().mean() > 0.99


def test_kernel_step_serves_short_causal_steps_and_refuses_positions_past_the_cache():
    cache = KVCache(num_layers=1, num_rows=2, max_len=16, num_kv_heads=1, head_dim=32, dtype=torch.float32)
    x = torch.zeros(2, 1, 32)
    with torch.inference_mode():
        verify = AttentionMetadata.causal_step(torch.tensor([1, 0]), torch.tensor([[4, 5, 6], [9, 10, 11]]))
        step_ops, keys = kernel_step(verify, cache, x)
        assert step_ops is ops and keys.rows.tolist() == [1, 1, 1, 0, 0, 0] and keys.lens.tolist() == [5, 6, 7, 10, 11, 12]
        long_chunk = AttentionMetadata.causal_step(torch.tensor([0]), torch.arange(17)[None] % 16)
        assert kernel_step(long_chunk, cache, x) is None  # long prompt chunks stay on SDPA
        past = AttentionMetadata.causal_step(torch.tensor([0, 1]), torch.tensor([[16], [3]]))
        with pytest.raises(ValueError, match="position 16"):
            kernel_step(past, cache, x)
    assert kernel_step(verify, cache, x) is None  # with autograd on, torch's ops run


needs_linear = pytest.mark.skipif(ops is None or not ops.has_linear(torch.zeros(4, 64, dtype=torch.bfloat16)),
                                  reason="the linear kernel needs AVX512-BF16")


@needs_linear
@pytest.mark.parametrize("rows, n, k, bias", [
    (1, 8, 64, False), (2, 9, 64, True), (3, 13, 96, True), (6, 7, 64, False), (7, 5, 96, True), (9, 4099, 576, False),
    (32, 6, 1536, True),
    # multiples of 64 features: AMX's tiles where the CPU has them, past 16 rows 16 at a time (the last padded)
    (1, 64, 64, True), (3, 192, 576, False), (4, 128, 1536, True), (17, 64, 96, False), (32, 256, 64, True),
    (45, 128, 576, True), (128, 64, 64, False),
])
def test_linear_equals_torch_and_each_row_ignores_its_batch(rows, n, k, bias):
    """Against F.linear in fp32 on the same bf16 values (the kernel sums in fp32 and rounds once), with feature
    counts that are not multiples of the kernel's 4-wide tiles; and every row alone gives its batched result
    bit for bit, which is what lets a one-token decode and a K-token verify agree."""
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    kw = ops.kernel_weight(w)
    assert torch.equal(ops.plain_weight(kw), w)
    with torch.no_grad():
        got = ops.linear(x, kw, b)
        alone = torch.cat([ops.linear(x[i : i + 1], kw, b) for i in range(rows)])
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # one bf16 rounding of the fp32 sum, plus room for a sum taken in another order where terms cancel
    assert bool(((got.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all())
    assert torch.equal(got, alone)
    assert ops.linear(x[:0], kw, b).shape == (0, n)  # an empty batch is an empty result


@pytest.mark.parametrize("build", ["avx2_ops", "avx512f_ops"])
def test_builds_without_avx512_bf16_serve_bf16_linears_alike_whatever_the_batch(build, request):
    """Built without AVX-512 BF16 (-march=x86-64-v3: 8 lanes; skylake-avx512: 16), the linear kernel widens bf16 to
    fp32 and multiplies with FMA: the same bound against F.linear in fp32, and every row alone bit for bit its batched
    result (which makes bf16 speculation token-exact there too); the int8 kernels take AVX2's VPMADDWD (tested with
    the native build's below), and the head's screen up to 4 rows."""
    built = request.getfixturevalue(build)
    # AVX2 alone stores whole 16-feature groups in panels; AVX-512F keeps the dot products
    assert built.linear_layout(torch.zeros(64, 64, dtype=torch.bfloat16)) == {"avx2_ops": "panels",
                                                                              "avx512f_ops": "rows"}[build]
    assert built.linear_layout(torch.zeros(40, 64, dtype=torch.bfloat16)) == "rows"
    assert built.int8_dot() == "vpmaddwd" and built.head_screen_rows() == 4
    for rows, n, k, bias in [(1, 8, 64, False), (3, 13, 96, True), (4, 7, 576, False), (7, 5, 96, True),
                             (9, 4099, 576, False), (45, 192, 576, True), (1, 16, 64, True), (6, 48, 1536, False),
                             (7, 64, 96, True), (13, 960, 576, False), (100, 32, 64, True)]:
        g = torch.Generator().manual_seed(rows * n)
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        b = torch.randn(n, generator=g).bfloat16() if bias else None
        kw = built.kernel_weight(w)
        assert torch.equal(built.plain_weight(kw), w)
        with torch.no_grad():
            got = built.linear(x, kw, b)
            alone = torch.cat([built.linear(x[i : i + 1], kw, b) for i in range(rows)])
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert bool(((got.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-4).all()), (rows, n, k)
        assert torch.equal(got, alone), (rows, n, k)


@pytest.fixture(scope="module", params=["native", "avx2_ops", "avx512f_ops"])
def int8_ops(request):
    """This CPU's build, an AVX2 laptop's and a Skylake server's: the int8 kernels multiply two int8 levels of the
    input by VPDPBUSD with AVX512-VNNI (and BF16), one int16 level by VPMADDWD otherwise."""
    built = ops if request.param == "native" else request.getfixturevalue(request.param)
    if built is None or not built.has_int8_kernels():
        pytest.skip("no int8 kernels (AVX512-VNNI or AVX2)")
    return built


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 20), n=st.sampled_from([16, 48, 576]), k=st.sampled_from([4, 64, 576, 2880]),
       bias=st.booleans(), outliers=st.booleans(), seed=st.integers(0, 99))
def test_linear_q8_against_its_dequantized_weight(int8_ops, rows, n, k, bias, outliers, seed):
    """Against a float64 matmul with the int8 weight's own dequantized values (scale * q): what is left is the
    input's quantization (two int8 levels or one int16 level: at most ~2^-16 of a row's largest value per element),
    fp32 sums and one bf16 rounding; with SmolLM2-like outlier channels too. Every row alone gives its batched result
    bit for bit (rows run in chunks of 8, each quantized by itself), past a chunk's end included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if outliers:
        x[:, torch.randint(0, k, (2,), generator=g)] *= 300
    x = x.bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    q8 = cpu_ops.Int8Weight(w)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    with torch.no_grad():
        got = int8_ops.linear_q8(x, q8, b)
        alone = torch.cat([int8_ops.linear_q8(x[i : i + 1], q8, b) for i in range(rows)])
    assert within_int8_bound(got, x, q8, b)
    assert torch.equal(got, alone)
    wq = q8.dequantized().double()
    assert float((wq - w.double()).abs().max()) <= float(w.double().abs().max()) / 254 * 1.001  # half an int8 step


@pytest.mark.parametrize("k", [8196, 20480])
def test_linear_q8_takes_inputs_wider_than_8192(int8_ops, k):
    """An 8B target's drafter: fc over 5 x 4,096 features, down_proj over 14,336 (the kernels stopped at 8,192)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=g).bfloat16()
    q8 = cpu_ops.Int8Weight((torch.randn(32, k, generator=g) * 0.05).bfloat16())
    with torch.no_grad():
        got = int8_ops.linear_q8(x, q8)
        assert within_int8_bound(got, x, q8)
        assert torch.equal(got[8:], int8_ops.linear_q8(x[8:], q8))


def test_int8_weights_quantize_wide_rows_a_chunk_at_a_time_as_in_one_go(monkeypatch):
    """Each chunk holds CHUNK_VALUES weights however wide the rows (8,192 rows a chunk took 2 GB of float64 copies
    for an 8B drafter's fc, 12 GB past 65,536 inputs); a row's scale and q are its own, as one pass over the whole
    weight gives them (scale = max |w| / 127, q = round(w / scale))."""
    w = (torch.randn(80, 8196, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    monkeypatch.setattr(cpu_ops.Int8Weight, "CHUNK_VALUES", 8196 * 20)  # 20 rows a chunk: four chunks
    q8 = cpu_ops.Int8Weight(w)
    scale = (w.double().abs().amax(1) / 127).float()
    assert torch.equal(q8.scale, scale)
    assert torch.equal(q8.dequantized(), torch.round(w.double() / scale.double()[:, None]).float() * scale[:, None])


def within_int8_bound(got: torch.Tensor, x: torch.Tensor, q8: cpu_ops.Int8Weight, b: torch.Tensor | None = None
                      ) -> bool:
    """linear_q8's result against a float64 matmul with the int8 weight's dequantized values: the input's
    quantization (~2^-16 of a row's largest value per element, allowed 2^-14), fp32 sums and one bf16 rounding."""
    wq = q8.dequantized().double()
    want = x.double() @ wq.T + (b.double() if b is not None else 0)
    magnitude = x.double().abs() @ wq.abs().T
    tol = x.double().abs().amax(1, keepdim=True) * 2.0**-14 * wq.abs().sum(1)[None] + 1e-5 * magnitude
    return bool(((got.double() - want).abs() <= tol + want.abs() * 2.0**-8).all())


@pytest.mark.parametrize("scale", [1e-36, 1e-20, 1e20])
def test_linear_q8_quantizes_rows_near_the_ends_of_the_float_range(int8_ops, scale):
    """A row's scale can be so small that its reciprocal overflows (below ~1e-34 with an int16 level): the result
    still scales with the row, within the same bound as any other row."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 20, generator=g) * scale).bfloat16()
    q8 = cpu_ops.Int8Weight((torch.randn(16, 20, generator=g) * 0.05).bfloat16())
    with torch.no_grad():
        assert within_int8_bound(int8_ops.linear_q8(x, q8), x, q8)


def test_linear_q8_gives_nans_for_a_row_that_is_not_finite_and_leaves_the_others(int8_ops):
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("nan")
    q8 = cpu_ops.Int8Weight(torch.randn(32, 64).bfloat16())
    with torch.no_grad():
        got = int8_ops.linear_q8(x, q8)
        assert bool(got[1].isnan().all()) and not bool(got[[0, 2]].isnan().any())
        assert torch.equal(got[[0, 2]], int8_ops.linear_q8(x[[0, 2]], q8))


def test_int8_weights_need_whole_blocks():
    with pytest.raises(ValueError, match=r"\[40, 64\] is not whole blocks"):
        cpu_ops.Int8Weight(torch.zeros(40, 64, dtype=torch.bfloat16))


@needs_linear
def test_linear_declines_weights_it_cannot_serve():
    assert not ops.has_linear(torch.zeros(4, 48, dtype=torch.bfloat16))  # rows not a multiple of 32
    assert not ops.has_linear(torch.zeros(4, 64))  # fp32: oneDNN's packed linear serves it
    assert ops.kernel_weight(torch.zeros(4, 48, dtype=torch.bfloat16)) is None
    assert ops.has_linear(torch.zeros(4, 64, dtype=torch.bfloat16))
    # AMX's tiles take whole groups of 64 features, AVX2's panels of 16; any other count keeps the weight as it is
    assert ops.linear_layout(torch.zeros(4, 64, dtype=torch.bfloat16)) == "rows"
    grouped = "tiles" if amx_usable() else "panels" if avx2_without_avx512() else "rows"
    assert ops.linear_layout(torch.zeros(128, 64, dtype=torch.bfloat16)) == grouped


def avx2_without_avx512() -> bool:
    """The native build's linears take AVX2 panels: the CPU has AVX2 and FMA and no AVX-512 at all."""
    flags = cpu_flags()
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


@pytest.mark.parametrize("value, off", [("0", True), ("off", True), ("False", True), ("NO", True), ("1", False),
                                        ("on", False), ("", False)])
def test_the_cpu_kernels_switch_reads_0_false_no_or_off(monkeypatch, value, off):
    """DFLASH_TRT_CPU_KERNELS took only `0`: `false` or `off` left the kernels on without a word."""
    monkeypatch.setenv("DFLASH_TRT_CPU_KERNELS", value)
    assert cpu_ops.switched_off("DFLASH_TRT_CPU_KERNELS") == off
    assert (cpu_ops.load.__wrapped__() is None) == off


@pytest.mark.parametrize("name", cpu_ops.SWITCHES)
def test_a_switch_set_to_neither_on_nor_off_is_warned_about_and_left_on(monkeypatch, name):
    monkeypatch.setenv(name, "disable")
    with pytest.warns(UserWarning, match=f"{name}='disable' is neither off .* left on"):
        ops_now = cpu_ops.load.__wrapped__()
    assert ops_now is not None
    monkeypatch.setenv(name, "On")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_ops.load.__wrapped__()


def test_the_kernels_own_switches_read_the_same_words(tmp_path):
    """DFLASH_TRT_PANELS (and DFLASH_TRT_AMX, read by the same C function on AMX CPUs), read by the compiled kernels,
    take the same words as the Python switch:
    an AVX2 build's linears leave their panels for dot products at each (its layout, asked in a fresh process)."""
    if not {"avx2", "fma"} <= set(cpu_ops._cpu_features().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    script = ("import torch; from dflash_trt.kernels import cpu_ops; "
              "print(cpu_ops.load().linear_layout(torch.zeros(64, 64, dtype=torch.bfloat16)))")
    env = {**os.environ, "DFLASH_TRT_MARCH": "x86-64-v3", "DFLASH_TRT_CACHE": str(tmp_path)}
    env.pop("DFLASH_TRT_PANELS", None)
    env.pop("DFLASH_TRT_CPU_KERNELS", None)

    def layout(**switches) -> str:
        run = subprocess.run([sys.executable, "-c", script], env={**env, **switches}, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert layout() == "panels"
    for value in ("0", "off", "False", "no"):
        assert layout(DFLASH_TRT_PANELS=value) == "rows", value
    assert layout(DFLASH_TRT_PANELS="1") == "panels"


def amx_usable() -> bool:
    """AMX, asked of the machine rather than of the kernels: the CPU lists amx_bf16, the compiler targets it with
    -march=native, Linux grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and DFLASH_TRT_AMX is not 0."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpu_ops.switched_off("DFLASH_TRT_AMX") or not cpuinfo.exists() or "amx_bf16" not in cpuinfo.read_text():
        return False
    macros = subprocess.run([os.environ.get("CC", "cc"), "-march=native", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True).stdout
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return "__AMX_BF16__" in macros and ctypes.CDLL(None).syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0


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


def test_a_failing_compiler_leaves_torch_ops_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such option' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.warns(UserWarning, match="torch's ops run instead: compiling the CPU kernels failed"):
        assert cpu_ops.load_with(str(broken)) is None
    assert not list((tmp_path / "cpu_ops").glob("*.so"))  # nothing half-built left behind
    with pytest.warns(UserWarning, match="no C compiler .*no-such-compiler.* found .*about half as fast"):
        assert cpu_ops.load_with(str(tmp_path / "no-such-compiler")) is None


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None or platform.machine() != "x86_64",
                    reason="needs a C compiler for x86-64")
def test_a_march_past_this_cpu_leaves_torch_ops_with_a_warning_naming_what_it_lacks(tmp_path, monkeypatch):
    """$DFLASH_TRT_MARCH from an AVX-512 host's environment on an AVX2 laptop: its build stopped the process with
    SIGILL at the first kernel call (a server's first request, after /health had passed)."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    monkeypatch.setenv("DFLASH_TRT_MARCH", "sapphirerapids")
    laptop = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}  # an AVX2 laptop's
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset(laptop))
    with pytest.warns(UserWarning, match=r"torch's ops run instead: DFLASH_TRT_MARCH=sapphirerapids builds them with "
                                         r"amx_bf16, .*avx512f, .*which this CPU lacks"):
        assert cpu_ops.load_with(os.environ.get("CC", "cc")) is None
    assert not (tmp_path / "cpu_ops").exists()  # refused before compiling


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None or platform.machine() != "x86_64",
                    reason="needs a C compiler for x86-64")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3", "skylake-avx512", "sapphirerapids"])
def test_the_kernels_compile_for_cpus_with_fewer_instruction_sets(tmp_path, march):
    """-march=native builds only what the CPU has; every other CPU compiles the same source with its own subset (no
    AVX-512, AVX-512 without BF16 or VNNI, ...), and a kernel guarded for one instruction set must not be reached by
    another's build. Each build links and exports every function cpu_ops.py binds."""
    source = Path(cpu_ops.__file__).parent / "cpu_ops.c"
    lib = tmp_path / f"cpu_ops-{march}.so"
    flags = [f if f != "-march=native" else f"-march={march}" for f in cpu_ops._FLAGS]
    result = subprocess.run([os.environ.get("CC", "cc"), *flags, "-Werror", str(source), "-o", str(lib)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for name in ("linear_bf16", "linear_q8", "head_argmax_bf16", "head_screen_rows", "head_screen_values",
                 "int8_dot_kind", "llama_layers_bf16",
                 "dflash_step_bf16", "argmax_rows_bf16", "rms_norm_bf16", "decode_attention_f32"):
        assert f" {name}\n" in symbols, name


@needs_linear
def test_without_onednn_bf16_a_packed_linear_takes_the_kernel_at_any_size_and_torch_past_it(monkeypatch):
    """Where oneDNN cannot reorder a bf16 weight (an AVX2 CPU: its reorder raises), PackedLinear keeps the plain weight:
    the kernel serves every row count, and torch's linear what the kernel cannot (here: under autograd); a weight
    neither serves is refused by name."""
    from dflash_trt.layers import linear

    monkeypatch.setattr(linear, "onednn_packs", lambda w: False)
    g = torch.Generator().manual_seed(5)
    w, b = (torch.randn(64, 96, generator=g) * 0.1).bfloat16(), torch.randn(64, generator=g).bfloat16()
    layer = linear.PackedLinear(w, b)
    assert layer.packed is None and layer.kernel_max_rows > 1000
    x = torch.randn(300, 96, generator=g).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), ops.linear(x, layer.kernel_weight, b))  # 300 rows: still the kernel
    with torch.enable_grad():
        torch.testing.assert_close(layer(x), F.linear(x, w, b))  # autograd: torch's linear on the plain weight
    assert not linear.can_pack(w, with_kernel=False)
    with pytest.raises(ValueError, match="no packed or kernel path serves a torch.bfloat16 weight of shape"):
        linear.PackedLinear(w, b, with_kernel=False)


@needs_linear
@pytest.mark.parametrize("build", ["native", "avx2_ops"])
def test_a_linear_without_onednns_copy_holds_one_copy_and_computes_rows_alike(build, request, monkeypatch):
    """gpt-oss's experts (PackedLinear(onednn=False)): each row as it would come alone (a verify block's rows as a
    one-token step's) as far as the kernel serves, against torch's fp32 product: in its dot products' layout, where
    oneDNN has bf16, up to UNPACKED_MAX_ROWS rows and torch's linear on the plain weight above (faster there); where
    it reads a reordered copy (AMX tiles, AVX2 panels) at any row count, the plain weight not kept, and a call the
    kernel cannot serve (autograd) is refused naming the linear."""
    from dflash_trt.layers import linear

    if build != "native":
        built = request.getfixturevalue(build)
        monkeypatch.setattr(cpu_ops, "load", lambda: built)
    g = torch.Generator().manual_seed(7)
    w, b = (torch.randn(128, 96, generator=g) * 0.1).bfloat16(), torch.randn(128, generator=g).bfloat16()
    layer = linear.PackedLinear(w, b, onednn=False)
    reordered = layer.kernel_layout != "rows"
    assert layer.packed is None and (layer.weight is None) == reordered and (build == "native" or reordered)
    reach = linear.UNPACKED_MAX_ROWS if not reordered and linear.onednn_packs(w) else sys.maxsize
    assert layer.kernel_max_rows == reach and reach >= linear.UNPACKED_MAX_ROWS
    x = torch.randn(300, 96, generator=g).bfloat16()
    with torch.inference_mode():
        within = layer(x[:reach] if reach < 300 else x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(0, len(within), 37)])
        assert torch.equal(within[::37], alone)
        if reach < 300:
            assert torch.equal(layer(x), F.linear(x, w, b))
    torch.testing.assert_close(within.float(), F.linear(x[: len(within)].float(), w.float(), b.float()), rtol=2e-2,
                               atol=2e-2)
    if reordered:
        with torch.enable_grad(), pytest.raises(RuntimeError, match="128 x 96 linear keeps only the bf16 kernel's"):
            layer(x)


@needs_linear
def test_a_model_computes_rows_alike_up_to_the_kernels_reach_only_where_the_kernel_serves_every_linear():
    """A linear the kernel leaves to oneDNN (PackedLinear(with_kernel=False): gpt-oss's experts where the kernel
    cannot serve them, float32 or no kernel) rounds with its rows at any count: no reach applies, and no step is cut
    for it."""
    from torch import nn

    from dflash_trt.layers import linear

    if not linear.onednn_packs(torch.zeros(64, 96, dtype=torch.bfloat16)):
        pytest.skip("oneDNN packs no bf16 weight here")
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(64, 96, generator=g) * 0.1).bfloat16()
    served = nn.Sequential(linear.PackedLinear(w), linear.PackedLinear(w))
    assert linear.row_invariant_rows(served) == served[0].kernel_max_rows < 1000
    assert linear.row_invariant_rows(nn.Sequential(served, linear.PackedLinear(w, with_kernel=False))) is None
    assert linear.row_invariant_rows(nn.Linear(4, 4)) is None


@needs_linear
@pytest.mark.parametrize("call", ["linear fp32", "q8 narrow", "q8 wide", "q8 fp32", "head narrow", "screen wide",
                                  "attention fp32"])
def test_inputs_the_kernels_would_misread_are_refused(call):
    """The kernels read x.numel() // K rows of the weight's type: a narrower x wrote past the output, a wider one
    read past x, an fp32 one read as bf16 gave NaNs; each is refused naming the op (a linear's width: above)."""
    w = torch.randn(64, 64).bfloat16()
    q8 = cpu_ops.Int8Weight(w) if ops.has_int8_kernels() else None
    if call.startswith(("q8", "head", "screen")) and q8 is None:
        pytest.skip("no int8 kernels (AVX512-VNNI or AVX2)")
    cache = torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.long)
    calls = {
        "linear fp32": lambda: ops.linear(torch.randn(3, 64), ops.kernel_weight(w)),
        "q8 narrow": lambda: ops.linear_q8(torch.randn(3, 48).bfloat16(), q8),
        "q8 wide": lambda: ops.linear_q8(torch.randn(1, 128).bfloat16(), q8),
        "q8 fp32": lambda: ops.linear_q8(torch.randn(3, 64), q8),
        "head narrow": lambda: ops.head_argmax(torch.randn(1, 32).bfloat16(), q8, ops.kernel_weight(w),
                                               torch.empty(96)),
        "screen wide": lambda: ops.head_screen_values(torch.randn(1, 96).bfloat16(), q8),
        "attention fp32": lambda: ops.cached_attention(torch.randn(1, 2, 16), cache, cache, one, one + 4, 0.25),
    }
    op = {"linear": "linear", "q8": "linear_q8", "head": "head_argmax", "screen": "head_screen_values",
          "attention": "cached_attention"}
    with pytest.raises(ValueError, match=f"^{op[call.split()[0]]}: "):
        calls[call]()
