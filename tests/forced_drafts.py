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

    def propose(rows, features, context, anchors, anchor_positions, num_draft, sampling=None, **options):
        out = real(rows, features, context, anchors, anchor_positions, num_draft, sampling, **options)
        drafts = out.draft_tokens.clone()
        for i, (row, pos) in enumerate(zip(rows.tolist(), anchor_positions.tolist())):
            full = truth_by_slot[row]
            for j in range(num_draft):
                truth = full[pos + 1 + j] if pos + 1 + j < len(full) else 0
                wrong = torch.rand(1, generator=g).item() < error_rate
                drafts[i, j] = (truth + 1) % 90 if wrong else truth
        return Proposal(drafts, out.draft_probs, out.draft_logprobs)

    proposer.propose = propose


def force_tree_drafts(engine, truth_by_slot: dict[int, list[int]], seed: int = 0) -> None:
    """For draft trees: every slot's distribution puts the true token at rank 0 (55%), 1 (20%), 2 (10%), 3 (5%) or
    outside the top four (10%), so trees accept deep paths, paths off the chain of top tokens, and nothing."""
    proposer = engine.runner.proposer
    real = proposer._slot_logits
    vocab = proposer.draft_vocab
    index = None if vocab is None else {int(t): i for i, t in enumerate(vocab.tolist())}
    g = torch.Generator().manual_seed(seed)

    def slot_logits(rows, features, context, anchors, anchor_positions, num_draft, host=None):
        logits = real(rows, features, context, anchors, anchor_positions, num_draft, host)
        fake = torch.rand(logits.shape, generator=g) - 20.0
        width = fake.shape[-1]
        for i, (row, pos) in enumerate(zip(rows.tolist(), anchor_positions.tolist())):
            full = truth_by_slot[row]
            for j in range(num_draft):
                truth = full[pos + 1 + j] if pos + 1 + j < len(full) else 0
                t = truth if index is None else index.get(truth)
                rank = int(torch.multinomial(torch.tensor([0.55, 0.2, 0.1, 0.05, 0.1]), 1, generator=g))
                decoys = [d for d in torch.randperm(width, generator=g)[:5].tolist() if d != t][:rank]
                for n, d in enumerate(decoys):
                    fake[i, j, d] = 10.0 - n
                if t is not None:
                    fake[i, j, t] = 10.0 - rank + 0.5 if rank < 4 else -30.0
        return fake.to(logits.dtype)

    proposer._slot_logits = slot_logits


def force_lookup_drafts(engine, truth_by_slot: dict[int, list[int]], seed: int = 0) -> None:
    """For context lookup branches: each step's branch is the true continuation (50%), the truth with one token
    wrong at a random depth (30%) or nothing (20%), scored as likely as the drafter's top paths, so branches are
    accepted whole, in part and not at all, and share nodes with the drafter's tree or replace some."""
    g = torch.Generator().manual_seed(seed)

    def branches(seqs, max_len):
        out = []
        for s in seqs:
            full, pos = truth_by_slot[s.slot], s.num_tokens
            branch = [full[pos + j] if pos + j < len(full) else 0 for j in range(max_len)]
            u = torch.rand(1, generator=g).item()
            if u < 0.2:
                branch = []
            elif u < 0.5 and branch:
                wrong = int(torch.randint(len(branch), (1,), generator=g))
                branch[wrong] = (branch[wrong] + 1) % 90
            out.append([(t, -0.3 * (d + 1)) for d, t in enumerate(branch)])
        return out

    engine.runner._lookup_branches = branches
