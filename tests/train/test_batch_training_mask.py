"""The batched attention mask of a training step against one written out key by key from its definition."""

import pytest
import torch

from dflash_trt.train.blocks import batch_training_mask


def _mask_by_definition(anchors: list[list[int]], block_size: int) -> torch.Tensor:
    """[n, 1, M, S + M]: S the largest anchor of any sequence, M the most anchors times block_size. Query r of
    sequence i belongs to block r // block_size; while that block is one of the sequence's, the query sees the
    context keys before the block's anchor and every key of its own block, and nothing else; a query past the
    sequence's blocks (padding) sees its own key alone."""
    s = max(max(a) for a in anchors)
    m = max(len(a) for a in anchors) * block_size
    rows = []
    for seq in anchors:
        seq_rows = []
        for r in range(m):
            block = r // block_size
            row = []
            for key in range(s + m):
                if block >= len(seq):
                    row.append(key == s + r)
                elif key < s:
                    row.append(key < seq[block])
                else:
                    row.append((key - s) // block_size == block)
            seq_rows.append(row)
        rows.append([seq_rows])
    return torch.tensor(rows, dtype=torch.bool)


def _random_anchors(gen: torch.Generator, n: int, most: int, length: int, sort: bool) -> list[list[int]]:
    """n sequences of 1..most distinct anchors in [0, length - 2] (each sequence's own length up to `length`); the
    last one has a single anchor and, with n > 1, the first as many as its length allows up to `most`, so that the
    batch pads blocks."""
    out = []
    for i in range(n):
        own_len = int(torch.randint(2, length + 1, (1,), generator=gen))
        k = 1 if i == n - 1 else most if i == 0 else int(torch.randint(1, most + 1, (1,), generator=gen))
        picked = torch.randperm(own_len - 1, generator=gen)[:k]
        out.append((picked.sort().values if sort else picked).tolist())
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_batched_mask_is_each_sequences_mask_padded(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=gen)) if seed else 1
    block_size = [1, 2, 3, 4, 8, 16][int(torch.randint(0, 6, (1,), generator=gen))]
    # unsorted anchors too: the mask reads each block's anchor, whatever the order
    anchors = _random_anchors(gen, n, most=int(torch.randint(2, 8, (1,), generator=gen)),
                              length=int(torch.randint(4, 60, (1,), generator=gen)), sort=seed % 3 != 0)
    got = batch_training_mask([torch.tensor(a) for a in anchors], block_size)
    assert got.dtype == torch.bool
    assert torch.equal(got, _mask_by_definition(anchors, block_size))


def test_sequences_of_different_anchor_counts_and_contexts_pad_both():
    anchors = [[0, 5], [2], [9, 3, 7]]  # an anchor 0 (no context), a lone block, and the longest context
    got = batch_training_mask([torch.tensor(a) for a in anchors], 4)
    assert got.shape == (3, 1, 12, 9 + 12)
    assert torch.equal(got, _mask_by_definition(anchors, 4))
    assert not got[0, 0, :4, :9].any() and got[0, 0, 4:8, :5].all() and not got[0, 0, 4:8, 5:9].any()
    assert got[1, 0, 4:, 9 + 4 :].equal(torch.eye(8, dtype=torch.bool))  # padding queries see only themselves
