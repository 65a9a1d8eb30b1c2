"""attend(): the grouped CPU path (one query per row at 3+ rows) and the SDPA path equal torch's SDPA
(the oracle) in fp32, over cache views, with and without masks; cached_attention's bucketed key reads; metadata
built from the host's copies equals metadata read from the tensors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.layers.attention import (KEY_BUCKET, AttentionMetadata, HostRows, _attend_grouped, _takes_grouped_path,
                                         attend, cached_attention)


@pytest.mark.parametrize("b, n, t, mask_q", [(4, 1, 9, None), (2, 1, 300, None), (3, 4, 12, 4), (3, 4, 12, 1), (8, 1, 7, 1),
                                             (2, 16, 40, 16), (1, 20, 30, 20), (4, 4, 50, 4), (5, 16, 40, 1)])
def test_grouped_attention_equals_sdpa(b, n, t, mask_q):
    g = torch.Generator().manual_seed(b * 100 + n)
    q = torch.randn(b, 6, n, 8, generator=g)
    k = torch.randn(b, 2, t + 5, 8, generator=g)[:, :, :t]  # a cache view, as the runtime passes
    v = torch.randn(b, 2, t + 5, 8, generator=g)[:, :, :t]
    mask = None
    if mask_q is not None:
        mask = torch.rand(b, 1, mask_q, t, generator=g) > 0.3
        mask[..., 0] = True  # every query sees at least one key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(_attend_grouped(q, k, v, mask, 0.3), want, atol=1e-5, rtol=1e-5)
    b_, h, n_, d = want.shape
    torch.testing.assert_close(attend(q, k, v, mask, 0.3), want.transpose(1, 2).reshape(b_, n_, h * d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", [(2, 1, 4, 11), (1, 1, 4, 11), (2, 1, 1, 11), (1, 1, 1, 11)])
def test_masked_gqa_on_cuda_folds_query_heads_so_sdpa_keeps_an_efficient_kernel(monkeypatch, mask_shape):
    """CUDA's SDPA serves a mask with GQA only in its math kernel, so masked steps there fold each KV head's query
    heads onto the query axis. Taken here on the CPU, with masks broadcast over rows or queries as steps pass them:
    query head h must still read KV head h // groups (SDPA's own GQA, the oracle), and K/V are not repeated."""
    from dflash_trt.layers import attention

    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 4, 8, generator=g)
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    mask = torch.rand(*mask_shape, generator=g) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    want = want.transpose(1, 2).reshape(2, 4, 48)
    assert not attention._masked_gqa_falls_to_math(q, k, mask)  # the CPU's SDPA takes masked GQA as it is
    monkeypatch.setattr(attention, "_masked_gqa_falls_to_math", lambda *a: True)
    torch.testing.assert_close(attend(q, k, v, mask, 0.3), want, atol=1e-5, rtol=1e-5)
    # CUDA's efficient kernel returns its output strided as [B, Q, H, D] transposed, not contiguous: the same values
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    torch.testing.assert_close(attend(q, k, v, mask, 0.3), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 3, 9), (1, 1, 3, 9), (2, 1, 1, 9)])
def test_attention_with_sinks_is_a_naive_per_head_softmax_with_the_sink_in_its_denominator(mask_shape):
    """gpt-oss: each query head has a sink logit that joins the softmax and adds no value; query head h reads KV
    head h // groups (float64, one head at a time, as the oracle)."""
    g = torch.Generator().manual_seed(3)
    b, h, kvh, n, t, d = 2, 6, 2, 3, 9, 8
    q, k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, kvh, t, d, generator=g), torch.randn(b, kvh, t, d,
                                                                                                          generator=g)
    sinks = torch.randn(h, generator=g) * 2
    mask = None if mask_shape is None else torch.rand(*mask_shape, generator=g) > 0.4
    if mask is not None:
        mask[..., 0] = True
    want = torch.empty(b, n, h, d, dtype=torch.float64)
    for i in range(b):
        for head in range(h):
            kv = head // (h // kvh)
            scores = q[i, head].double() @ k[i, kv].double().T * 0.3  # [n, t]
            if mask is not None:
                scores = scores.masked_fill(~mask[min(i, mask.shape[0] - 1), 0].expand(n, t), float("-inf"))
            e = torch.exp(torch.cat([scores, sinks[head].double().expand(n, 1)], dim=1))
            want[i, :, head] = (e[:, :-1] / e.sum(1, keepdim=True)) @ v[i, kv].double()
    got = attend(q, k, v, mask, 0.3, sinks)
    torch.testing.assert_close(got, want.reshape(b, n, h * d).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, lengths", [((0, 1, 2, 3), (5, 70, 64, 1)), ((6, 2, 4, 0, 1), (9, 9, 130, 3, 64))])
def test_cached_attention_reads_keys_in_buckets_and_hides_the_extra_ones(rows, lengths):
    """One query per row at 3+ rows takes the grouped path, which reads keys in buckets of KEY_BUCKET: the keys
    past each row's position (here huge values, as stale entries could hold) must change nothing."""
    g = torch.Generator().manual_seed(len(rows))
    cache = KVCache(num_layers=1, num_rows=8, max_len=200, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache.k.normal_(generator=g).mul_(1e4)
    cache.v.normal_(generator=g).mul_(1e4)
    b = len(rows)
    positions = torch.tensor(lengths)[:, None] - 1  # each row's query is its last token
    meta = AttentionMetadata.causal_step(torch.tensor(rows), positions)
    q, k, v = torch.randn(b, 6, 1, 8, generator=g), torch.randn(b, 1, 2, 8, generator=g), torch.randn(b, 1, 2, 8, generator=g)
    assert _takes_grouped_path(q)
    out = cached_attention(cache, 0, meta, q, k, v, scale=0.3)
    for i, (row, n) in enumerate(zip(rows, lengths)):  # the oracle: SDPA over exactly the row's live keys
        want = F.scaled_dot_product_attention(q[i : i + 1], cache.k[0, row : row + 1, :, :n], cache.v[0, row : row + 1, :, :n],
                                              scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[i, 0], want.transpose(1, 2).reshape(1, 48)[0], atol=1e-5, rtol=1e-5)
    assert meta.kv_len % KEY_BUCKET != 0  # the case exercises a partial bucket


def test_cache_read_refuses_more_keys_than_it_holds():
    cache = KVCache(num_layers=1, num_rows=2, max_len=16, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    meta = AttentionMetadata.causal_step(torch.tensor([0, 1]), torch.tensor([[3], [5]]))
    with pytest.raises(ValueError, match="kv_len=17"):
        cache.read(0, meta, 17)
    assert cache.read(0, meta, 16)[0].shape == (2, 1, 16, 4)


def test_a_tree_step_sees_the_prefix_and_each_nodes_ancestors_at_rotary_positions_of_their_depth():
    # two rows; row 0's tree: root, two children of the root, a grandchild under the second child
    start = torch.tensor([3, 5])
    parents = [[-1, 0, 0, 2], [-1, 0, 1, 2]]
    depths, ancestors = [], []
    for row in parents:
        d, a = [], []
        for node, p in enumerate(row):
            d.append(0 if p < 0 else d[p] + 1)
            a.append((0 if p < 0 else a[p]) | (1 << node))
        depths.append(d), ancestors.append(a)
    meta = AttentionMetadata.tree_step(torch.tensor([1, 0]), start, torch.tensor(depths), torch.tensor(ancestors))
    assert meta.positions.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]  # written at consecutive positions
    assert meta.rope_positions.tolist() == [[3, 4, 4, 5], [5, 6, 7, 8]]  # rotated at start + depth
    mask = meta.mask(kv_len=12)[:, 0]
    for b in range(2):
        for q in range(4):
            for t in range(12):
                node = t - int(start[b])
                want = node < 0 or (node < 4 and (node == q or _is_ancestor(parents[b], node, q)))
                assert bool(mask[b, q, t]) == want, (b, q, t)
    keys = meta.query_keys()
    assert keys.tree.tolist() == [[3, a] for a in ancestors[0]] + [[5, a] for a in ancestors[1]]
    assert keys.lens.tolist() == [4, 5, 6, 7, 6, 7, 8, 9]  # up to the node itself: its ancestors come before it


def test_a_window_measures_tree_keys_from_their_nodes_depths():
    """As a chain of its ancestors would place them: node 5 (depth 3) does not see node 3 (depth 1) through a window of
    2, although node 3 sits two cache positions before it."""
    parents = [-1, 0, 0, 1, 3, 4]
    depths, ancestors = [], []
    for node, p in enumerate(parents):
        depths.append(0 if p < 0 else depths[p] + 1)
        ancestors.append((0 if p < 0 else ancestors[p]) | (1 << node))
    start = 10
    meta = AttentionMetadata.tree_step(torch.tensor([0]), torch.tensor([start]), torch.tensor([depths]),
                                       torch.tensor([ancestors]))
    mask = meta.mask(window=2, kv_len=20)[0, 0]
    for q in range(6):
        for t in range(20):
            node = t - start
            if node < 0:
                want = start + depths[q] - t < 2
            else:
                want = node < 6 and (node == q or _is_ancestor(parents, node, q)) and depths[q] - depths[node] < 2
            assert bool(mask[q, t]) == want, (q, t)
    assert not mask[5, start + 3] and mask[5, start + 4]


def _is_ancestor(parents, a, node):
    while parents[node] >= 0:
        node = parents[node]
        if node == a:
            return True
    return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_attention_takes_no_cudnn_plan_and_equals_the_math_reference():
    """On CUDA a masked step must not take cuDNN's attention (a new execution plan per shape: ~11 s training steps
    on an H200); the result still equals SDPA's math backend, forward and backward, at every key count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (40, 41, 97):
        q = torch.randn(3, 9, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(3, 3, t, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(3, 3, t, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = torch.rand(3, 1, 8, t, device="cuda", generator=g) > 0.3
        mask[..., 0] = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = attend(q, k, v, mask, 0.125)
            out.float().sum().backward()
        assert not [e.key for e in prof.key_averages() if "cudnn_attention" in e.key]
        with sdpa_kernel([SDPBackend.MATH]):
            want = F.scaled_dot_product_attention(q.detach().float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                                  enable_gqa=True)
        torch.testing.assert_close(out.float(), want.transpose(1, 2).reshape(3, 8, -1), atol=2e-2, rtol=2e-2)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_metadata_from_the_hosts_copies_equals_metadata_read_from_the_tensors(data):
    """Causal steps (prefill chunks clamped below the cache's end, decodes, chain verifies), drafter blocks and tree
    verifies: the same key count, row slice and masks (windows, keys read in buckets past the step's) either way."""
    b = data.draw(st.integers(1, 4))
    slots = data.draw(st.sampled_from([list(range(s, s + b)) for s in range(3)] + [
        data.draw(st.permutations(range(6)))[:b]]))
    starts = data.draw(st.lists(st.integers(0, 20), min_size=b, max_size=b))
    if data.draw(st.booleans()):
        starts = [starts[0]] * b
    q = data.draw(st.integers(1, 5))
    kind = data.draw(st.sampled_from(["causal", "block", "tree"]))
    limit = data.draw(st.integers(2, 26)) if kind == "causal" and data.draw(st.booleans()) else None
    rows, first = torch.tensor(slots), torch.tensor(starts)
    positions = first[:, None] + torch.arange(q)
    if limit is not None:
        positions = positions.clamp_max(limit - 1)
    host = HostRows(slots, starts, limit)
    if kind == "causal":
        metas = [AttentionMetadata.causal_step(rows, positions, h) for h in (None, host)]
    elif kind == "block":
        metas = [AttentionMetadata.block_step(rows, positions, first + q, h) for h in (None, host)]
    else:
        depths = torch.tensor([[0] + [1 + j // 2 for j in range(q - 1)]] * b)
        ancestors = torch.tensor([[(1 << (j + 1)) - 1 for j in range(q)]] * b)  # a chain's: every earlier node
        metas = [AttentionMetadata.tree_step(rows, first, depths, ancestors, h) for h in (None, host)]
    read, given_ = metas
    assert given_.kv_len == read.kv_len and given_.row_slice == read.row_slice
    assert given_.first_position == read.first_position
    window = data.draw(st.sampled_from([None, 1, 3, 8, 30]))
    for extra in (0, data.draw(st.integers(1, 9))):
        want, got = read.mask(window, kv_len=read.kv_len + extra), given_.mask(window, kv_len=read.kv_len + extra)
        assert (want is None) == (got is None) and (want is None or torch.equal(want, got))
