"""Training blocks (arXiv 2602.06036 §4.2, Fig. 4): random anchors, the block-sparse mask, decay weights.

One training sequence holds its context features plus N blocks [anchor, MASK x (B-1)], one per anchor
sampled inside the response. Keys are laid out [context (S tokens) | block_0 | ... | block_{N-1}]:
- a query of block j sees context keys t < anchor_j (strictly before its anchor: the anchor's own
  features do not exist yet at inference time) and every key of block j (bidirectionally);
- blocks never see each other.
Slot k (1..B-1) of block j is labelled with the token at anchor_j + k; the anchor slot has no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100
GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's choices


def decay_gamma(block_size: int) -> float:
    return GAMMA_BY_BLOCK_SIZE.get(block_size, 7.0 * block_size / 16)


def decay_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for block slots k = 1..B-1 -> [B - 1]."""
    gamma = decay_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class TrainBlocks:
    anchors: torch.Tensor  # [N] positions of the anchors
    block_ids: torch.Tensor  # [N * B] anchor token then mask ids
    block_positions: torch.Tensor  # [N * B] absolute positions
    labels: torch.Tensor  # [N * B] target token or IGNORE
    weights: torch.Tensor  # [N * B] decay weight (0 where ignored)


def sample_blocks(
    token_ids: torch.Tensor,  # [T] prompt + response
    response_start: int,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator,
    gamma: float | None = None,
) -> TrainBlocks | None:
    """Random distinct anchors in [response_start, T - 2] (each block has at least one label)."""
    t = token_ids.numel()
    lo, hi = response_start, t - 2
    if hi < lo:
        return None
    candidates = torch.arange(lo, hi + 1)
    n = min(num_anchors, candidates.numel())
    anchors = candidates[torch.randperm(candidates.numel(), generator=generator)[:n]].sort().values
    return blocks_at(token_ids, anchors, block_size, mask_token_id, gamma)


def blocks_at(
    token_ids: torch.Tensor,  # [T] prompt + response
    anchors: torch.Tensor,  # [N] sorted distinct positions <= T - 2
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
) -> TrainBlocks:
    """The blocks [token at anchor, MASK x (B-1)] at the given anchors, labelled with the tokens that follow."""
    t, n = token_ids.numel(), anchors.numel()
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets).reshape(-1)  # [N * B]
    block_ids = torch.full((n, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = token_ids[anchors]
    labels = torch.full((n, block_size), IGNORE, dtype=torch.long)
    inside = positions.view(n, block_size) < t
    labels[inside] = token_ids[positions.view(n, block_size)[inside]]
    labels[:, 0] = IGNORE
    w = torch.cat([torch.zeros(1), decay_weights(block_size, gamma)])[None].expand(n, -1).clone()
    w[labels == IGNORE] = 0.0
    return TrainBlocks(anchors, block_ids.reshape(-1), positions, labels.reshape(-1), w.reshape(-1))


def next_step_anchors(anchors: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Where a greedy decoding step from each anchor would leave the next one: the first wrong slot's position.

    correct [N, B-1] says whether slot k's draft (k = 1..B-1) equals the label (False where there is none). A
    step from anchor a accepts the drafts before the first wrong slot j and commits the target's own token
    there, which anchors the next step: a + j, or a + B after a fully accepted block.
    """
    wrong = torch.cat([~correct, torch.ones_like(correct[:, :1])], dim=1)
    return anchors + 1 + wrong.int().argmax(dim=1)


def training_mask(context_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean [N * B, context_len + N * B]: True where a block query may attend."""
    n = anchors.numel()
    block_of_query = torch.arange(n).repeat_interleave(block_size)  # [N * B]
    ctx = torch.arange(context_len)[None, :] < anchors[block_of_query][:, None]
    same_block = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([ctx, same_block], dim=1)


def batch_training_mask(anchors: list[torch.Tensor], block_size: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Each sequence's training_mask for its anchors, padded into one boolean [n, 1, M, S + M] on
    `device`: S the longest context (the largest anchor), M the most block queries (anchors times block_size).

    Sequence i keeps its context columns at 0.. and its block columns at S..; a padding query (past its sequence's
    blocks) sees only its own key, so that its softmax stays finite, and nothing else sees it.
    """
    padded = torch.nn.utils.rnn.pad_sequence(list(anchors), batch_first=True)  # anchor 0 pads: no context
    s, m = int(padded.max()), padded.shape[1] * block_size
    counts = torch.tensor([a.numel() for a in anchors]).to(device)
    padded = padded.to(device)
    block = torch.arange(m, device=device) // block_size  # [M] each query's (and key's) block
    real = block < counts[:, None]  # [n, M]
    # Both parts written into the mask in place: concatenating them copies the whole mask once more.
    mask = torch.empty(len(anchors), m, s + m, dtype=torch.bool, device=device)
    torch.lt(torch.arange(s, device=device), padded[:, block][:, :, None], out=mask[:, :, :s])
    own = torch.eye(m, dtype=torch.bool, device=device)
    torch.logical_and(block[:, None] == block, real[:, :, None] | own, out=mask[:, :, s:])
    return mask[:, None]
