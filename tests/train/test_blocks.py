"""Training blocks, the block-sparse mask and the decay weights, against their definitions."""

import math

import torch

from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import DFlashConfig, new_drafter
from dflash_trt.train.blocks import IGNORE, decay_weights, next_step_anchors, sample_blocks, training_mask


def test_mask_on_a_small_case_matches_the_definition():
    # context of 5 tokens, two blocks of 3 with anchors at positions 2 and 4
    m = training_mask(5, torch.tensor([2, 4]), 3).int()
    expected = torch.tensor([
        # ctx 0..4       block 0   block 1
        [1, 1, 0, 0, 0,  1, 1, 1,  0, 0, 0],  # block 0 sees context strictly before its anchor (t < 2)
        [1, 1, 0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 1, 1, 0,  0, 0, 0,  1, 1, 1],  # block 1: t < 4, and only itself
        [1, 1, 1, 1, 0,  0, 0, 0,  1, 1, 1],
        [1, 1, 1, 1, 0,  0, 0, 0,  1, 1, 1],
    ])
    assert torch.equal(m, expected)


def test_decay_weights_follow_the_paper():
    w = decay_weights(16)  # gamma 7 for B=16: w_k = exp(-(k-1)/7), k = 1..15
    assert w.shape == (15,)
    assert math.isclose(w[0].item(), 1.0) and math.isclose(w[7].item(), math.exp(-1.0), rel_tol=1e-6)
    assert math.isclose(decay_weights(10)[5].item(), math.exp(-1.0), rel_tol=1e-6)  # gamma 5 for B=10
    assert math.isclose(decay_weights(8)[4].item(), math.exp(-1.0), rel_tol=1e-6)  # gamma 4 for B=8


def test_blocks_take_anchors_in_the_response_and_label_the_next_tokens():
    ids = torch.arange(100, 120)  # 20 tokens, response from position 8
    b = sample_blocks(ids, 8, num_anchors=5, block_size=4, mask_token_id=7, generator=torch.Generator().manual_seed(0))
    assert b.anchors.numel() == 5 and int(b.anchors.min()) >= 8 and int(b.anchors.max()) <= 18
    blocks = b.block_ids.view(5, 4)
    assert torch.equal(blocks[:, 0], ids[b.anchors]) and bool((blocks[:, 1:] == 7).all())
    labels = b.labels.view(5, 4)
    assert bool((labels[:, 0] == IGNORE).all())
    for j, a in enumerate(b.anchors.tolist()):
        for k in range(1, 4):
            assert labels[j, k].item() == (ids[a + k].item() if a + k < 20 else IGNORE)
    assert bool((b.weights[b.labels == IGNORE] == 0).all())


def test_the_next_step_starts_at_the_first_wrong_draft():
    gen = torch.Generator().manual_seed(1)
    anchors = torch.randint(0, 50, (200,), generator=gen)
    correct = torch.rand(200, 7, generator=gen) < 0.7
    correct[:3] = True  # whole blocks accepted
    for a, c, got in zip(anchors.tolist(), correct.tolist(), next_step_anchors(anchors, correct).tolist()):
        accepted = 0
        while accepted < 7 and c[accepted]:
            accepted += 1
        assert got == a + accepted + 1  # the accepted drafts, then the target's own token, which anchors the next step


def test_training_forward_equals_the_inference_forward_block_by_block():
    cfg = DFlashConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=48, block_size=4, mask_token_id=0, target_layer_ids=[0, 1])
    d = new_drafter(cfg, seed=3, init_std=0.2).eval()
    feats = torch.randn(1, 12, 64)
    anchors = torch.tensor([3, 7, 10])
    positions = (anchors[:, None] + torch.arange(4)).reshape(1, -1)
    embeds = torch.randn(1, 12, 32)
    with torch.no_grad():
        train_out = d.forward_train(feats, torch.arange(12)[None], embeds, positions,
                                    training_mask(12, anchors, 4)[None, None])[0].view(3, 4, 32)
        for j, a in enumerate(anchors.tolist()):
            cache = d.make_cache(1, 32)
            rows = torch.tensor([0])
            d.project_context(feats[:, :a], AttentionMetadata.causal_step(rows, torch.arange(a)[None]), cache)
            meta = AttentionMetadata.block_step(rows, positions[:, 4 * j : 4 * j + 4], torch.tensor([a + 4]))
            infer = d.forward_block(embeds[:, 4 * j : 4 * j + 4], meta, cache)[0]
            assert (infer - train_out[j]).abs().max() < 1e-5
