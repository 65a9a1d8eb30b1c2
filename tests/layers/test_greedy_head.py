"""GreedyHead chooses exactly the token torch.argmax chooses over the full bf16 head's logits (the bf16 kernel's,
themselves tested against F.linear in tests/kernels/test_cpu_ops.py), ties and rounding included, and declines
what it cannot decide. The kernel's properties hold for this CPU's build and for an AVX2 laptop's and a Skylake
server's, whose screen multiplies an int16 input by VPMADDWD where AVX512-VNNI's multiplies two int8 levels by
VPDPBUSD."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.greedy_head import GreedyHead

ops = cpu_ops.load()


def screens(built) -> bool:
    bf16 = torch.zeros(64, 32, dtype=torch.bfloat16)
    return built is not None and built.has_int8_kernels() and built.has_linear(bf16)


needs_screen = pytest.mark.skipif(not screens(ops), reason="no CPU kernel for the screen (AVX512-VNNI or AVX2)")


@pytest.fixture(scope="module", params=["native", "avx2_ops", "avx512f_ops"])
def kernels(request):
    built = ops if request.param == "native" else request.getfixturevalue(request.param)
    if not screens(built):
        pytest.skip("no CPU kernel for the screen (AVX512-VNNI or AVX2)")
    return built


def full_head_argmax(kernels, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.argmax(kernels.linear(x, kernels.kernel_weight(w)), dim=-1)


def screened_argmax(kernels, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The kernel's greedy tokens through a fresh int8 copy of w, or None where it declines."""
    scratch = torch.empty(3 * x.shape[0] * w.shape[0] // 2)
    return kernels.head_argmax(x, cpu_ops.Int8Weight(w), kernels.kernel_weight(w), scratch)


def head(w: torch.Tensor) -> GreedyHead:
    return GreedyHead(w, ops.kernel_weight(w))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), n=st.sampled_from([64, 128, 1024, 4096]), k=st.sampled_from([32, 64, 576]),
       seed=st.integers(0, 2**16), outliers=st.booleans(), duplicates=st.integers(0, 8),
       temperature=st.sampled_from([0.1, 1.0, 10.0]))
def test_equals_the_full_heads_argmax(kernels, rows, n, k, seed, outliers, duplicates, temperature):
    """Random heads and hidden states, with SmolLM2-like massive-activation channels, rows repeated exactly (ties
    the first index must win) or nudged by one bf16 step (near-ties), and logits from flat to peaked; rows past the
    screen's limit (8 with VNNI, 4 with AVX2) are declined."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    for _ in range(duplicates):
        src, dst = torch.randint(0, n, (2,), generator=g).tolist()
        w[dst] = w[src]
        if torch.rand(1, generator=g).item() < 0.5:
            w[dst, torch.randint(0, k, (1,), generator=g)] *= 1 + 2**-7
    w = w.bfloat16()
    x = torch.randn(rows, k, generator=g) * temperature
    if outliers:
        x[:, torch.randint(0, k, (2,), generator=g)] *= 300
    x = x.bfloat16()
    with torch.no_grad():
        got = screened_argmax(kernels, x, w)
        assert (got is None) == (rows > kernels.head_screen_rows())
        if got is not None:
            assert torch.equal(got, full_head_argmax(kernels, x, w))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), k=st.sampled_from([32, 64, 576]), seed=st.integers(0, 999), outliers=st.booleans())
def test_the_screened_values_are_the_int8_heads_logits(kernels, rows, k, seed, outliers):
    """What the screen bounds, against a float64 matmul with the int8 head's dequantized values: off by no more than
    the inputs' quantization remainder (two int8 levels or one int16 level: 2^-16 of a row's largest value per
    element, here allowed 2^-14) can make, with outlier channels that leave most of a row to the second level. The
    argmax tests cannot see an error the bound's slack absorbs; this one can."""
    if rows > kernels.head_screen_rows():
        return
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(128, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g)
    if outliers:
        x[:, torch.randint(0, k, (2,), generator=g)] *= 300
    x = x.bfloat16()
    q8 = cpu_ops.Int8Weight(w)
    with torch.no_grad():
        got = kernels.head_screen_values(x, q8).double()
    wq = q8.dequantized().double()
    want = x.double() @ wq.T
    magnitude = x.double().abs() @ wq.abs().T
    tol = x.double().abs().amax(1, keepdim=True) * 2.0**-14 * wq.abs().sum(1)[None] + 1e-5 * magnitude
    assert bool(((got - want).abs() <= tol).all())


def test_rounding_ties_go_to_the_first_index(kernels):
    """Two logits 0.47 apart that both round to bf16's 126.0, in different 64-feature groups: the first index wins.
    The screen's error bound alone (0.13 either side here) ranks the second strictly higher and would never compute
    the first's group; only the margin for bf16's rounding keeps it (integer-valued weights and inputs: every
    product and sum is exact)."""
    k, n, second = 32, 128, 64
    w = torch.zeros(n, k)
    w[0, :2] = torch.tensor([127.0, -30.0]) / 16
    w[second, :2] = torch.tensor([127.0, 30.0]) / 16
    x = torch.zeros(1, k)
    x[0, :2] = torch.tensor([127.0, 1.0]) / 8
    w, x = w.bfloat16(), x.bfloat16()
    with torch.no_grad():
        logits = kernels.linear(x, kernels.kernel_weight(w))
        assert logits[0, 0] == logits[0, second] == 126.0  # (16129 - 30) / 128 and (16129 + 30) / 128, rounded
        assert screened_argmax(kernels, x, w).item() == 0 == full_head_argmax(kernels, x, w).item()


@pytest.mark.parametrize("seed", range(40))
def test_the_quantization_error_cannot_hide_the_maximum(kernels, seed):
    """Feature 0's int8 copy is off by almost half a step in every input, each time in the direction of x, so its
    screened logit falls well below its true one; feature 64, exact in int8, lies in between. The true maximum is
    feature 0, and only the bound's |x| |e_j| term keeps its group from being dropped."""
    g = torch.Generator().manual_seed(seed)
    k, n = 32, 128
    x = torch.randn(k, generator=g)
    x[0] = 0
    x = x.bfloat16().double()
    step = 2.0**-4
    w0 = step * (torch.randint(-20, 20, (k,), generator=g).double() + 0.46 * torch.sign(x))
    w0[0] = 127 * step  # the outlier that sets feature 0's int8 scale, where x is 0
    w0 = w0.bfloat16().double()
    true0 = float(x @ w0)
    screened0 = float(x @ torch.round(w0 / step)) * step
    q1 = torch.round(x * 127 / x.abs().max())
    w1 = (q1 * (screened0 + 0.8 * (true0 - screened0)) / float(x @ q1)).bfloat16().double()
    assert screened0 < float(x @ w1) < true0
    w = torch.zeros(n, k, dtype=torch.float64)
    w[0], w[64] = w0, w1
    w, x = w.bfloat16(), x.bfloat16()[None]
    with torch.no_grad():
        assert torch.equal(screened_argmax(kernels, x, w), full_head_argmax(kernels, x, w))


def test_all_equal_logits_choose_index_zero(kernels):
    w = torch.randn(256, 64).bfloat16()
    with torch.no_grad():
        assert screened_argmax(kernels, torch.zeros(2, 64, dtype=torch.bfloat16), w).tolist() == [0, 0]
        same = w[:1].expand(256, 64).contiguous()
        assert screened_argmax(kernels, torch.randn(3, 64).bfloat16(), same).tolist() == [0, 0, 0]


@needs_screen
def test_the_bound_holds_for_the_quantized_head():
    """|x . w_j - s_j (x . q_j)| <= |x| err_j: the per-feature error norms the kernel's bound is built on."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(128, 64, generator=g) * torch.rand(128, 1, generator=g)).bfloat16()
    q8 = head(w).int8
    q = q8.q.transpose(1, 2).reshape(128, 64).double()  # back from [N / 16][K / 4][16][4]
    assert torch.equal(q8.qsum, q.sum(1).int())
    assert torch.allclose(q8.dequantized().double(), q * q8.scale.double()[:, None])
    x = torch.randn(50, 64, generator=g).double()
    gap = (x @ w.double().T - (x @ q.T) * q8.scale.double()).abs()
    assert bool((gap <= x.norm(dim=1, keepdim=True) * q8.err.double()[None]).all())
    assert bool((q8.wnorm.double() >= w.double().norm(dim=1)).all())


@needs_screen
def test_declines_what_it_cannot_decide():
    w = torch.randn(128, 64).bfloat16()
    h = head(w)
    with torch.no_grad():
        assert h.argmax(torch.randn(h.max_rows + 1, 64).bfloat16()) is None  # the full head is cheaper there
        nan = torch.randn(2, 64).bfloat16()
        nan[1, 3] = float("nan")
        assert h.argmax(nan) is None  # the full head's argmax decides (a NaN logit counts as the maximum)
        assert h.argmax(torch.randn(2, 64)) is None  # fp32 hidden states: the bf16 kernel does not compute them
    assert h.argmax(torch.randn(2, 64).bfloat16()) is None  # autograd on: torch's ops run
    assert not GreedyHead.serves(w[:100], ops.kernel_weight(w[:100]))  # not whole 64-feature groups
    inf = w.clone()
    inf[5, 5] = float("inf")
    assert not GreedyHead.serves(inf, ops.kernel_weight(inf))


def test_declines_logits_past_the_float_range(kernels):
    """Finite bf16 inputs whose dots overflow fp32: the bounds are infinite and no group passes a NaN floor, so the
    screen chose token -1 (an index from the embedding's end); it declines, and the full head decides."""
    w = (torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    w[37] = 1e30
    x = torch.full((1, 64), 1e9).bfloat16()
    with torch.no_grad():
        assert screened_argmax(kernels, x, w) is None
        assert int(full_head_argmax(kernels, x, w)) == int((x.double() @ w.double().T).argmax()) == 37


def test_serves_heads_wider_than_8192_inputs(kernels):
    w = (torch.randn(128, 8256, generator=torch.Generator().manual_seed(1)) * 0.05).bfloat16()
    assert GreedyHead.serves(w, ops.kernel_weight(w))
    x = torch.randn(3, 8256, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        assert torch.equal(screened_argmax(kernels, x, w), full_head_argmax(kernels, x, w))


@needs_screen
def test_shapes_follow_the_hidden_states():
    w = torch.randn(128, 64).bfloat16()
    x = torch.randn(2, 2, 64).bfloat16()  # 4 rows: within every build's limit
    with torch.no_grad():
        out = head(w).argmax(x)
    assert out.shape == (2, 2) and out.dtype == torch.long
    assert torch.equal(out, full_head_argmax(ops, x.reshape(4, 64), w).view(2, 2))
