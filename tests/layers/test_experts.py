"""A mixture of experts' bank: the routed tokens through their experts one expert at a time, or in two grouped GEMMs
(torch._grouped_mm, taken on a GPU), against transformers' own Qwen3-MoE experts; expert-parallel ranks' shares sum to
the whole layer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from dflash_trt.layers.experts import SiluExperts
from dflash_trt.models.gpt_oss import GptOssExperts

H, I, E = 32, 16, 8


def _bank(cls, experts: range, seed: int = 0, **kw):
    bank = cls(H, I, experts, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bank.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return bank


def _routes(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return torch.randn(tokens, H, generator=g), ids, torch.rand(tokens, k, generator=g)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 24), k=st.integers(1, 4), grouped=st.booleans(), seed=st.integers(0, 99))
def test_silu_experts_equal_transformers_qwen3_moe_experts(tokens, k, grouped, seed):
    ours = _bank(SiluExperts, range(E), seed, bias=False)
    ours.grouped = grouped
    theirs = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E))
    with torch.no_grad():
        theirs.gate_up_proj.copy_(ours.gate_up_proj)
        theirs.down_proj.copy_(ours.down_proj)
        x, ids, w = _routes(tokens, k, seed)
        assert torch.allclose(ours(x, ids, w), theirs(x, ids, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cls, kw", [(SiluExperts, {"bias": False}), (GptOssExperts, {"alpha": 1.702, "limit": 7.0})])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_grouped_products_equal_one_expert_at_a_time_on_every_expert_parallel_rank(cls, kw, ranks):
    """The grouped path sorts the routed entries by expert and leaves other ranks' entries out; each rank's share is
    the loop's, and the shares sum to the whole layer."""
    x, ids, w = _routes(13, 3, seed=1)
    whole = _bank(cls, range(E), **kw)
    with torch.no_grad():
        want = whole(x, ids, w)
        shares = []
        for rank in range(ranks):
            held = range(rank * E // ranks, (rank + 1) * E // ranks)
            bank = _bank(cls, held, **kw)
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                if getattr(bank, name) is not None:
                    getattr(bank, name).copy_(getattr(whole, name)[held.start:held.stop])
            bank.grouped = False
            alone = bank(x, ids, w)
            bank.grouped = True
            shares.append(bank(x, ids, w))
            assert torch.allclose(shares[-1], alone, atol=1e-5) and bank.grouped
    assert torch.allclose(sum(shares), want, atol=1e-4)


def test_a_grouped_gemm_torch_refuses_here_falls_back_to_one_expert_at_a_time(monkeypatch):
    bank = _bank(SiluExperts, range(E), bias=False)
    x, ids, w = _routes(5, 2, seed=2)
    with torch.no_grad():
        want = bank(x, ids, w)  # (on the CPU: one expert at a time)

        def refuse(*args, **kwargs):
            raise RuntimeError("grouped gemm is not supported on this device")

        monkeypatch.setattr(torch, "_grouped_mm", refuse)
        bank.grouped = True
        with pytest.warns(RuntimeWarning, match=r"grouped GEMM failed here \(grouped gemm is not supported"):
            assert torch.equal(bank(x, ids, w), want)
        assert bank.grouped is False and torch.equal(bank(x, ids, w), want)


def test_a_device_out_of_memory_is_raised_not_taken_for_a_grouped_gemm_it_cannot_run(monkeypatch):
    bank = _bank(SiluExperts, range(E), bias=False)
    bank.grouped = True
    x, ids, w = _routes(5, 2, seed=2)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "_grouped_mm", out_of_memory)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        bank(x, ids, w)
    assert bank.grouped is True  # (a later step may fit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sums_add_each_tokens_experts_in_the_loops_order(dtype):
    """Each token's experts are added in ascending order, one at a time, as one expert at a time adds them: the two
    ways agree to the bit (a bank without biases; a GPU's index_add_ of all rows at once adds in no fixed order)."""
    bank = _bank(SiluExperts, range(E), seed=3, bias=False).to(dtype)
    x, ids, w = _routes(17, 4, seed=4)
    with torch.no_grad():
        bank.grouped = False
        want = bank(x.to(dtype), ids, w.to(dtype))
        bank.grouped = True
        assert torch.equal(bank(x.to(dtype), ids, w.to(dtype)), want)
