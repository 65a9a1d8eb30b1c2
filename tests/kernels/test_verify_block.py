"""dflash::verify_block: hand-computed greedy cases, the Triton kernels against the reference on random
mixed batches, rejection sampling through the kernel preserving the target distribution, fake shapes."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.kernels.verify_block import GREEDY, MATCH, REJECTION, verify_block, verify_block_ref
from dflash_trt.layers.sampler import sample_from, sampling_probs
from tests.stats import assert_matches


def _one_hot_logits(choices, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(choices), vocab).float()[None] * 5


def _greedy_args(drafts, logits):
    b, k = drafts.shape
    zeros = torch.zeros(b)
    return (drafts, logits, None, torch.zeros(b, k + 1), torch.full((b,), GREEDY), zeros, zeros.long(), zeros + 1)


def test_greedy_worked_example_through_the_op():
    # drafts [5, 9, 2], target argmax [5, 9, 7, 4]: 5 and 9 match, 2 != 7 -> 2 accepted, bonus 7
    num_accepted, bonus = verify_block(*_greedy_args(torch.tensor([[5, 9, 2]]), _one_hot_logits([5, 9, 7, 4])))
    assert num_accepted.tolist() == [2] and bonus.tolist() == [7]
    # all accepted: the bonus is the argmax after the last draft
    num_accepted, bonus = verify_block(*_greedy_args(torch.tensor([[5, 9, 7]]), _one_hot_logits([5, 9, 7, 4])))
    assert num_accepted.tolist() == [3] and bonus.tolist() == [4]


def _random_batch(b, k, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, vocab, generator=g) * 2.5
    modes = torch.tensor([GREEDY, MATCH, REJECTION])[torch.randint(0, 3, (b,), generator=g)]
    temperature = torch.where(modes == GREEDY, 0.0, 0.6 + torch.rand(b, generator=g))
    top_k = torch.tensor([0, 3, 7])[torch.randint(0, 3, (b,), generator=g)]
    top_p = torch.tensor([1.0, 0.9, 0.6])[torch.randint(0, 3, (b,), generator=g)]
    draft_probs = sampling_probs(torch.randn(b, k, vocab, generator=g) * 2.5, temperature.clamp_min(0.7), top_k, top_p)
    drafts = sample_from(draft_probs, torch.rand(b, k, generator=g))
    # make long accepted prefixes common: copy the target's argmax into most drafts
    copy = torch.rand(b, k, generator=g) < 0.7
    drafts = torch.where(copy, logits[:, :k].argmax(-1), drafts)
    uniforms = torch.rand(b, k + 1, generator=g)
    return drafts, logits, draft_probs, uniforms, modes, temperature, top_k, top_p


@pytest.mark.parametrize("b, k, vocab, seed", [(24, 3, 50, 0), (16, 7, 130, 1), (9, 1, 7, 2)])
def test_kernels_match_reference_on_mixed_batches(triton_device, b, k, vocab, seed):
    from dflash_trt.kernels.verify_block_triton import verify_block_triton

    args = _random_batch(b, k, vocab, seed)
    want = verify_block_ref(*args)
    got = verify_block_triton(*(a.to(triton_device) for a in args), block_v=32)  # several vocabulary tiles
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()
    assert 0 < want[0].float().mean() < k  # partial acceptance happened


def test_greedy_kernels_take_a_nan_logit_as_the_maximum_as_torch_does(triton_device):
    """torch.argmax's rule (the reference's and the CPU path's): the first NaN wins; the kernel skipped NaNs, so the
    two paths accepted different drafts."""
    from dflash_trt.kernels.verify_block_triton import verify_block_triton

    logits = torch.randn(3, 3, 100, generator=torch.Generator().manual_seed(0))
    logits[:, :, 10] = 50.0
    logits[0, 0, 70] = logits[0, 0, 80] = float("nan")  # a NaN in a later tile than the maximum
    logits[1, 1] = float("nan")
    logits[2, 0, 3] = float("nan")  # before the maximum, in its tile
    args = _greedy_args(torch.full((3, 2), 10), logits)
    want = verify_block_ref(*args)
    assert want[0].tolist() == [0, 1, 0] and want[1].tolist() == [70, 0, 3]
    got = verify_block_triton(*(a if a is None else a.to(triton_device) for a in args), block_v=32)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_with_no_drafts_every_rule_samples_the_bonus_from_the_target():
    # K = 0 under the rejection rule raised an IndexError (its residual padded with an empty slice)
    vocab = 6
    logits = torch.randn(3, 1, vocab, generator=torch.Generator().manual_seed(4)) * 2
    ones, u = torch.ones(3), torch.tensor([[0.1], [0.5], [0.9]])
    args = (torch.zeros(3, 0, dtype=torch.long), logits, torch.zeros(3, 0, vocab), u,
            torch.tensor([GREEDY, MATCH, REJECTION]), torch.tensor([0.0, 1.0, 1.0]), torch.zeros(3, dtype=torch.long),
            ones)
    num_accepted, bonus = verify_block_ref(*args)
    cdf = torch.softmax(logits[:, 0], -1).cumsum(-1)  # inverse-CDF sampling at each row's uniform
    assert num_accepted.tolist() == [0, 0, 0]
    assert bonus.tolist() == [int(logits[0, 0].argmax()), *(int((cdf[i] <= u[i, 0]).sum()) for i in (1, 2))]


def test_rejection_sampling_in_the_kernel_preserves_the_target_distribution(triton_device):
    """K = 1: the emitted first token (the draft if accepted, else the residual sample) must follow p."""
    from dflash_trt.kernels.verify_block_triton import verify_block_triton

    n, vocab = 800, 5  # (a row a program under Triton's interpreter: the suite's slowest test at 1,500)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(1, 2, vocab, generator=g) * 1.5).expand(n, -1, -1).contiguous()
    ones = torch.ones(n)
    p = sampling_probs(logits[:1], ones[:1], torch.zeros(1, dtype=torch.long), ones[:1])[0, 0]
    q = torch.softmax(torch.randn(1, 1, vocab, generator=g) * 1.5, -1).expand(n, -1, -1).contiguous()
    drafts = sample_from(q, torch.rand(n, 1, generator=g))
    uniforms = torch.rand(n, 2, generator=g)
    args = (drafts, logits, q, uniforms, torch.full((n,), REJECTION), ones, torch.zeros(n, dtype=torch.long), ones)
    num_accepted, bonus = verify_block_triton(*(a.to(triton_device) for a in args))
    first = torch.where(num_accepted.cpu() > 0, drafts[:, 0], bonus.cpu())
    assert 0.05 < num_accepted.float().mean() < 0.95  # both branches are exercised
    assert_matches(first.tolist(), {i: float(p[i]) for i in range(vocab)})


def test_fake_implementation_gives_shapes_under_fake_tensors_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _random_batch(4, 3, 20, 0)
    with FakeTensorMode() as mode:
        num_accepted, bonus = verify_block(*[mode.from_tensor(a) for a in args])
        assert num_accepted.shape == bonus.shape == (4,) and num_accepted.dtype == bonus.dtype == torch.long

    def step(*a):
        n, bonus = verify_block(*a)
        return n + 1, bonus  # tau, and the next anchor

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for x, y in zip(compiled(*args), step(*args)):
        assert x.tolist() == y.tolist()
