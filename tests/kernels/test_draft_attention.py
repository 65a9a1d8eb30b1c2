"""dflash::draft_attention: the reference against a naive float64 oracle, the Triton kernel against
the reference over a property-based sweep, and the fake implementation under FakeTensor / torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.kernels.draft_attention import draft_attention, draft_attention_ref


def _inputs(b, n, kvh, groups, d, ctx_lens, dtype=torch.float32, rows=None, cache_len=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = kvh * groups
    num_rows = (max(rows) + 1) if rows else b
    s = cache_len or (max(ctx_lens) + 3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q, kb, vb = rnd(b, n, h, d), rnd(b, n, kvh, d), rnd(b, n, kvh, d)
    kc, vc = rnd(num_rows, kvh, s, d), rnd(num_rows, kvh, s, d)
    rows_t = torch.tensor(rows if rows else list(range(b)), device=device)
    return q, kb, vb, kc, vc, rows_t, torch.tensor(ctx_lens, device=device)


def _naive(q, kb, vb, kc, vc, rows, ctx_lens, scale, causal, window, sinks):
    """One query at a time in float64: list the visible keys by position, softmax (with the sink), sum."""
    b, n, h, d = q.shape
    kvh = kb.shape[2]
    out = torch.zeros(b, n, h, d, dtype=torch.float64)
    for i in range(b):
        ctx = int(ctx_lens[i])
        keys = [(t, kc[rows[i], :, t], vc[rows[i], :, t]) for t in range(ctx)]
        keys += [(ctx + j, kb[i, j], vb[i, j]) for j in range(n)]
        for j in range(n):
            p = ctx + j
            vis = [(k, v) for t, k, v in keys if (t <= p if causal else True)
                   and (window == 0 or (p - t < window and (causal or t - p < window)))]
            for hh in range(h):
                kv = hh // (h // kvh)
                logits = [float(q[i, j, hh].double() @ k[kv].double()) * scale for k, _ in vis]
                extra = [float(sinks[hh])] if sinks is not None else []
                m = max(logits + extra)
                w = [math.exp(x - m) for x in logits]
                z = sum(w) + sum(math.exp(x - m) for x in extra)
                out[i, j, hh] = sum(wi * v[kv].double() for wi, (_, v) in zip(w, vis)) / z
    return out


@pytest.mark.parametrize("causal, window, with_sinks", [(False, 0, False), (True, 0, False), (True, 4, True), (False, 3, True)])
def test_reference_matches_a_naive_per_query_oracle(causal, window, with_sinks):
    # ragged contexts (7, 0, 2) over rows (2, 0, 1); a window of 3-4 cuts into both context and block
    args = _inputs(3, 4, 2, 2, 8, [7, 0, 2], rows=[2, 0, 1])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    got = draft_attention_ref(*args, 0.4, causal, window, sinks)
    want = _naive(*args, 0.4, causal, window, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, ctx_lens", [(4, [3, 2]), (8, [1, 0, 2])])
def test_reference_handles_blocks_longer_than_every_context(n, ctx_lens):
    # short prompts in a ragged batch (the server met this with 2-3 token completions prompts)
    args = _inputs(len(ctx_lens), n, 2, 2, 8, ctx_lens)
    torch.testing.assert_close(draft_attention_ref(*args, 0.4).double(), _naive(*args, 0.4, False, 0, None),
                               atol=1e-5, rtol=1e-5)


def test_cache_entries_past_the_context_are_never_read():
    q, kb, vb, kc, vc, rows, ctx = _inputs(2, 3, 1, 2, 8, [4, 1], cache_len=12)
    before = draft_attention_ref(q, kb, vb, kc, vc, rows, ctx, 0.3)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[0, :, 4:] = 1e4  # garbage where a stale block or padding would sit
    vc2[1, :, 1:] = float("nan")
    torch.testing.assert_close(draft_attention_ref(q, kb, vb, kc2, vc2, rows, ctx, 0.3), before)


def _check_kernel(b, n, kvh, groups, d, ctx_lens, dtype, causal, window, with_sinks, splits, seed, device):
    from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

    rows = list(range(b))[::-1]  # rows in another order than the batch
    args = _inputs(b, n, kvh, groups, d, ctx_lens, dtype, rows=rows, seed=seed, device=device)
    sinks = torch.linspace(-1, 1, kvh * groups, device=device) if with_sinks else None
    got = draft_attention_triton(*args, d**-0.5, causal, window, sinks, num_splits=splits)
    want = draft_attention_ref(*(a.float() if a.is_floating_point() else a for a in args), d**-0.5, causal, window, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@settings(max_examples=14, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 3), n=st.integers(1, 5), kvh=st.integers(1, 2), groups=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([16, 24, 32]), ctx=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float16]), causal=st.booleans(), window=st.sampled_from([0, 1, 3, 9]),
    with_sinks=st.booleans(), splits=st.sampled_from([1, 1, 3]), seed=st.integers(0, 99),
)
def test_kernel_matches_reference_over_small_shapes(triton_device, b, n, kvh, groups, d, ctx, dtype, causal, window,
                                                    with_sinks, splits, seed):
    # d = 24 is not a power of two (padded lanes); 3 groups make M = 3 * n ragged; window 1 sees only itself
    _check_kernel(b, n, kvh, groups, d, ctx[:b], dtype, causal, window, with_sinks, splits, seed, triton_device)


@pytest.mark.parametrize("groups, d, n", [(8, 64, 10), (4, 128, 16), (2, 64, 8)])
def test_kernel_matches_reference_at_drafter_head_dims_and_block_sizes(triton_device, groups, d, n):
    # gpt-oss-120b (head_dim 64, block 10) and Qwen3-8B (128, 16) shapes, one kv head, a short context
    _check_kernel(2, n, 1, groups, d, [5, 19], torch.float16, False, 0, False, 1, 0, triton_device)


def test_fake_implementation_gives_shapes_under_fake_tensors_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _inputs(2, 3, 2, 2, 8, [5, 2])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = draft_attention(*fake, 0.3, True, 2, None)
        assert out.shape == (2, 3, 4, 8) and out.dtype == torch.float32

    def layer(q, kb, vb, kc, vc, rows, ctx):
        return draft_attention(q * 2, kb, vb, kc, vc, rows, ctx, 0.3, False, 0, None).sum(-1)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # no graph break at the op
    torch.testing.assert_close(compiled(*args), layer(*args))


def test_kernel_takes_k_and_v_with_different_strides(triton_device):
    # The drafter passes K after RoPE (a fresh tensor) and V as a view of the fused kv projection: their strides
    # differ. The first CUDA run of the engine refused such inputs; the kernel must make them agree instead.
    from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

    q, kb, vb, kc, vc, rows, ctx = _inputs(2, 4, 1, 2, 16, [7, 3], device=triton_device)
    kv = torch.cat([kb, vb], dim=-1)  # [B, Q, KVH, 2D], like kv_proj's output
    v_view = kv[..., 16:]
    assert v_view.stride() != kb.stride()
    got = draft_attention_triton(q, kb, v_view, kc, vc, rows, ctx, 0.25)
    want = draft_attention_ref(q, kb, vb, kc, vc, rows, ctx, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # caches as views of longer ones, read in place while the blocks are copied
    kc_view, vc_view = (torch.cat([c, torch.zeros_like(c)], dim=2)[:, :, :c.shape[2]] for c in (kc, vc))
    assert kc_view.stride() != kc.stride()
    got = draft_attention_triton(q, kb, v_view, kc_view, vc_view, rows, ctx, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kernel_reads_context_lengths_rows_and_sinks_given_as_strided_views(triton_device):
    # The drafter passes its block positions' first column (positions[:, 0]) as the context lengths: a view whose
    # stride is the block length. Read as contiguous, every row past the first attended to another row's context.
    from dflash_trt.kernels.draft_attention_triton import draft_attention_triton

    q, kb, vb, kc, vc, rows, ctx = _inputs(3, 4, 1, 2, 16, [20, 7, 12], rows=[1, 2, 0], device=triton_device)
    positions = ctx[:, None] + torch.arange(4, device=triton_device)  # [B, Q], as the drafter's metadata holds them
    rows_view = torch.stack([rows, rows], dim=1)[:, 0]
    assert positions[:, 0].stride() != (1,) and rows_view.stride() != (1,)
    got = draft_attention_triton(q, kb, vb, kc, vc, rows_view, positions[:, 0], 0.25)
    want = draft_attention_ref(q, kb, vb, kc, vc, rows, ctx, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sinks = torch.tensor([[-1.0, 0.5], [1.5, -2.0]], device=triton_device)[:, 1]  # a strided view: [0.5, -2.0]
    assert sinks.stride() != (1,)
    got = draft_attention_triton(q, kb, vb, kc, vc, rows, ctx, 0.25, sinks=sinks)
    want = draft_attention_ref(q, kb, vb, kc, vc, rows, ctx, 0.25, sinks=sinks.contiguous())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _Launches:
    """Stands in for a @triton.jit kernel: records each launch's compile-time constants, runs nothing."""

    def __init__(self) -> None:
        self.constants: set[tuple] = set()

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.constants.add(tuple(sorted(constexprs.items())))


def test_the_torch_ops_launches_compile_once_per_tile_size_not_per_draft_length_or_split_count(monkeypatch):
    """Triton compiles a kernel per set of compile-time constants, on first launch: the engine launches every draft
    length its schedule and requests' ends give (1..K + 1 slots) and a split count per batch size, mid-serving. Only
    the tiles (powers of two) may vary with them (nor does Triton specialize the two ints: tests/plugins)."""
    pytest.importorskip("triton", reason="the `kernels` extra (triton==3.7.1) is not installed")
    from dflash_trt.kernels import draft_attention_triton as module

    split, combine = _Launches(), _Launches()
    monkeypatch.setattr(module, "draft_attention_kernel", split)
    monkeypatch.setattr(module, "_combine_kernel", combine)
    tiles = set()
    for n in range(1, 16):
        for splits in (1, 2, 3, 7, 32):
            module.draft_attention_triton(*_inputs(1, n, 1, 2, 16, [40]), 0.25, num_splits=splits)
        tiles.add(max(16, 1 << (2 * n - 1).bit_length()))  # BLOCK_M: the group's 2 heads x n slots, a power of two
    assert len(split.constants) == len(tiles) == 2
    assert len(combine.constants) == 1


# Compiled ahead of time for an sm_80 GPU by Triton's own compiler and ptxas (no GPU needed), with the tiles and launch
# options the launcher passes; in a subprocess, as this process's kernels are the interpreter's.
_COMPILE = """
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash_trt.kernels.draft_attention_triton import draft_attention_kernel as kernel, tiles

out = []
for dtype, kvh, groups, head_dim, q_len in json.loads(sys.argv[1]):
    meta = tiles(getattr(torch, dtype), groups, q_len, head_dim)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages")}
    consts = dict(KVH=kvh, GROUPS=groups, HEAD_DIM=head_dim, CAUSAL=False, HAS_WINDOW=False, HAS_SINKS=False, **meta)
    t = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    types = dict.fromkeys(kernel.arg_names, "i32") | dict.fromkeys(("Q", "KB", "VB", "KC", "VC", "OUT", "SINKS"),
                                                                   "*" + t)
    types |= {"ROWS": "*i64", "CTX": "*i64", "ML": "*fp32", "qk_scale": "fp32"}
    signature = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
    out.append(triton.compile(src, target=GPUTarget("cuda", 80, 32), options=options).metadata.shared)
print(json.dumps(out))
"""


def test_the_kernel_fits_the_shared_memory_of_a_consumer_gpu_in_both_dtypes(tmp_path):
    """An RTX 30/40 or L4 block has 99 KB of shared memory (an A100 163): Triton refuses to launch past it. fp32
    tiles of 64 keys in 3 stages took 131-180 KB for the GPU drafters."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys

    # (kv heads, query heads per kv head, head_dim, block of K+1 queries): gpt-oss-120b's drafter at K=9, Qwen3-8B's
    # at K=15, SmolLM2's at K=7
    shapes = [(8, 8, 64, 10), (8, 4, 128, 16), (3, 3, 64, 8)]
    # every shape in fp32 (the tiles that outgrew the limit), the largest in bf16 (half the bytes a tile)
    cases = [["float32", *shape] for shape in shapes] + [["bfloat16", *shapes[1]]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], capture_output=True, text=True, env=env,
                       timeout=240)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's bundled ptxas is missing")
    assert r.returncode == 0, r.stderr[-3000:]
    shared = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(0 < used <= 99 * 1024 for used in shared), dict(zip(map(tuple, cases), shared))
