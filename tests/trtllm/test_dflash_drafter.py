"""The TensorRT-LLM drafter hook: its flash_attn_with_kvcache-compatible attention (runs anywhere) and
the lazy registration (needs tensorrt_llm)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash_trt.kernels.draft_attention import draft_attention_ref
from dflash_trt.trtllm.dflash_drafter import draft_attention_with_kvcache, register_dflash_drafter

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def _nhd_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, n, h, kvh, d, slots, s = 2, 4, 4, 2, 8, 3, 20
    q = torch.randn(b, n, h, d, generator=g)
    k, v = torch.randn(b, n, kvh, d, generator=g), torch.randn(b, n, kvh, d, generator=g)
    k_cache, v_cache = torch.randn(slots, s, kvh, d, generator=g), torch.randn(slots, s, kvh, d, generator=g)
    return q, k_cache, v_cache, k, v, torch.tensor([9, 3], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)


# flash-attn zeroes the right window of a causal call, so upstream's causal sliding layers' (W-1, W-1) is W causal
@pytest.mark.parametrize("causal, window_size, window", [(False, (-1, -1), 0), (True, (4, 0), 5), (False, (2, 2), 3),
                                                         (True, (4, 4), 5), (True, (-1, -1), 0)])
def test_flash_attn_contract_maps_onto_draft_attention_and_appends_the_block(causal, window_size, window):
    q, kc, vc, k, v, seqlens, slots = _nhd_inputs()
    # the oracle reads the untouched cache in the op's [slots, KVH, S, D] layout with the window spelled W
    want = draft_attention_ref(q, k, v, kc.transpose(1, 2).clone(), vc.transpose(1, 2).clone(), slots.long(), seqlens,
                               0.25, causal, window)
    got = draft_attention_with_kvcache(q, kc, vc, k, v, seqlens, slots, causal=causal, window_size=window_size,
                                       softmax_scale=0.25)
    torch.testing.assert_close(got, want)
    # like flash-attn, the block's K/V now sit right after each row's context in its slot
    torch.testing.assert_close(kc[2, 9:13], k[0])
    torch.testing.assert_close(vc[0, 3:7], v[1])


@pytest.mark.parametrize("window_size", [(4, 1), (-1, 3), (3, -1)])
def test_window_shapes_that_no_dflash_drafter_uses_are_refused(window_size):
    q, kc, vc, k, v, seqlens, slots = _nhd_inputs()
    before = kc.clone()
    with pytest.raises(ValueError, match=f"window_size=\\({window_size[0]}, {window_size[1]}\\) with causal=False"):
        draft_attention_with_kvcache(q, kc, vc, k, v, seqlens, slots, causal=False, window_size=window_size)
    assert torch.equal(kc, before)  # refused before the cache is touched


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed: the missing-package error cannot happen")
def test_registration_without_tensorrt_llm_says_what_to_install():
    with pytest.raises(RuntimeError, match="TensorRT-LLM 1.3.0rc20 .NVIDIA's wheel index"):
        register_dflash_drafter()


@pytest.mark.trtllm
@pytest.mark.skipif(not HAS_TRTLLM, reason="needs tensorrt_llm (NVIDIA's wheel index or NGC container, not PyPI)")
def test_registered_builder_is_the_one_tensorrt_llm_looks_up():
    from tensorrt_llm._torch.models.modeling_utils import get_registered_draft_model_builder
    from tensorrt_llm._torch.speculative.interface import SpeculativeDecodingMode

    builder = register_dflash_drafter()
    assert get_registered_draft_model_builder(SpeculativeDecodingMode.DFLASH) is builder
