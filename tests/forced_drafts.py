"""Forced drafts: make the proposer propose the true greedy continuation with random corruptions, so
that long accepted prefixes, partial rejections and rollbacks all happen (a random drafter accepts
almost nothing). The drafter still runs, so its cache bookkeeping is exercised too."""

import torch

from dflash_trt.spec.proposer import Proposal


def force_drafts(engine, truth_by_slot: dict[int, list[int]], error_rate: float, seed: int = 0) -> None:
    """truth_by_slot[row] = prompt + reference continuation of the request in cache row `row`."""
    proposer = engine.runner.proposer
    real = proposer.propose
    g = torch.Generator().manual_seed(seed)

    def propose(rows, features, feature_positions, anchors, anchor_positions, num_draft, sampling=None):
        out = real(rows, features, feature_positions, anchors, anchor_positions, num_draft, sampling)
        drafts = out.draft_tokens.clone()
        for i, (row, pos) in enumerate(zip(rows.tolist(), anchor_positions.tolist())):
            full = truth_by_slot[row]
            for j in range(num_draft):
                truth = full[pos + 1 + j] if pos + 1 + j < len(full) else 0
                wrong = torch.rand(1, generator=g).item() < error_rate
                drafts[i, j] = (truth + 1) % 90 if wrong else truth
        return Proposal(drafts, out.draft_probs)

    proposer.propose = propose
