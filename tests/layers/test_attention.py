"""attend(): the grouped CPU path (one query per row at 4+ rows) and the SDPA path equal torch's SDPA
(the oracle) in fp32, over cache views, with and without masks."""

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.layers.attention import _attend_grouped, attend


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
