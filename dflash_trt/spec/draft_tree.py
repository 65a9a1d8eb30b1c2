"""Draft trees: greedy verification of several drafts per step, chosen from the drafter's per-slot top tokens.

A DFlash block gives, in one drafter forward, a distribution for every slot 1..K after the anchor. A chain drafts
each slot's argmax; when slot 1's argmax is wrong the whole step yields one token. A tree spends the same target
forward on more rows: of all the paths that pick one of the top `width` tokens at each slot, it verifies the
`nodes` whose product of slot probabilities is highest (best-first, the EAGLE-2 selection: arXiv 2406.16858), so it
goes deep where the drafter is sure and wide where it is not. The set is prefix-closed (a path's probability never
exceeds its prefix's), so it is a tree rooted at the anchor.

Verification by the target's own choice: its argmax (greedy) or its sample (the "match" rule, with the row's
uniform for the node's depth) at each verified node says which child, if any, continues the accepted path; the
emitted tokens are the accepted path's drafts plus the target's token after its last node, exactly the tokens plain
decoding would give (greedy), each drawn from the target's distribution given the tokens before it (sampled). The
"rejection" rule, whose drafts are samples of the drafter, drafts chains.

On the CPU default at one row (`bench speed --dataset cpu-small --tree-nodes`, benchmarks/README.md, session 19) a
chain of K=3 accepts 1.65 tokens a step, a tree of 6 nodes up to 3 deep 1.94: 1.41x plain decoding against 1.31x,
the extra rows nearly free in a memory-bound step.

Node order: node 0 is the root (the anchor), then nodes in the order they were chosen, so every parent precedes its
children (the attention stays causal in node order: layers/attention.py AttentionMetadata.tree_step).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from dflash_trt.device_copy import to_device

MAX_TREE_NODES = 62  # draft nodes per row: the root and its nodes fit a signed 64-bit visibility mask


def check_tree_nodes(nodes: int, name: str) -> None:
    """ValueError naming `name` where a draft tree of `nodes` nodes is past MAX_TREE_NODES (the build, the engine and
    `bench speed` each check before their own work)."""
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"{name}: {nodes} nodes exceed {MAX_TREE_NODES} (at most {MAX_TREE_NODES} nodes: a row's "
                         "root and nodes fit a 64-bit visibility mask)")


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N + 1] node tokens; column 0 is the root (the anchor)
    parents: list[list[int]]  # per row, per node: the parent's node index (-1 for the root)
    depths: torch.Tensor  # [B, N + 1] int64: 0 for the root, a node's slot for the others
    ancestors: torch.Tensor  # [B, N + 1] int64: bit i set where node i is the node itself or one of its ancestors
    node_tokens: list[list[int]]  # tokens on the host

    @property
    def num_nodes(self) -> int:
        """Draft nodes per row (the root excluded)."""
        return self.tokens.shape[1] - 1


def select_paths(logprobs: list[list[list[float]]], nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` rank paths of highest summed log-probability, in the order chosen (best first).

    logprobs[d][r]: log-probability of slot d + 1's r-th most likely token (each slot's list sorted descending). A
    path (r_1, ..., r_k) drafts slot j's r_j-th token at depth j; ties go to the path found first."""
    depth, width = len(logprobs), len(logprobs[0]) if logprobs else 0
    heap = [(-logprobs[0][r], (r,)) for r in range(width)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        d = len(path)
        if d < depth:
            for r in range(width):
                heapq.heappush(heap, (neg - logprobs[d][r], path + (r,)))
    return chosen


def max_nodes(depth: int, width: int) -> int:
    """Paths through `depth` slots of `width` tokens each, capped at MAX_TREE_NODES."""
    return min(MAX_TREE_NODES, sum(width**d for d in range(1, depth + 1)))


def build_tree(anchors: torch.Tensor, top_tokens: torch.Tensor, top_logprobs: torch.Tensor, nodes: int,
               branches: list[list[tuple[int, float]]] | None = None) -> DraftTree:
    """anchors [B]; top_tokens / top_logprobs [B, K, W]: each slot's W most likely draft tokens, best first ->
    a DraftTree of exactly `nodes` draft nodes per row.

    branches[b], where given: a chain of (token, log-probability of the chain up to it) below row b's root from
    another source (spec/context_lookup.py), scored on the drafter's scale. The row's `nodes` then go to the most
    likely of the drafter's paths and the branch's prefixes together (`merge`): a branch takes rows from the
    drafter's least likely paths only where it is the likelier, and shares the nodes both propose."""
    _, k, w = top_tokens.shape
    if not 1 <= nodes <= max_nodes(k, w):
        raise ValueError(f"a draft tree of {nodes} nodes needs 1 <= nodes <= {max_nodes(k, w)} "
                         f"(K={k} slots x {w} tokens each)")
    # Python lists, one tensor each at the end: element-wise tensor writes cost ~5x the whole selection. One read back
    # from the device for all three (on a GPU each read waits for the queued kernels): token ids and fp32
    # log-probabilities are exact in fp64.
    b = anchors.shape[0]
    host = torch.cat([anchors.double()[:, None], top_tokens.double().reshape(b, -1),
                      top_logprobs.double().reshape(b, -1)], dim=1).tolist()
    tokens, depths, ancestors, parents = [], [], [], []
    for row, values in enumerate(host):
        anchor = int(values[0])
        top = [[int(t) for t in values[1 + d * w: 1 + (d + 1) * w]] for d in range(k)]
        lp = [values[1 + (k + d) * w: 1 + (k + d + 1) * w] for d in range(k)]
        ranks = select_paths(lp, nodes)
        paths = [tuple(top[d][r] for d, r in enumerate(path)) for path in ranks]
        if branches is not None:  # scores only where a branch competes for the nodes
            scores = [sum(lp[d][r] for d, r in enumerate(path)) for path in ranks]
            paths = merge(list(zip(paths, scores)), branches[row], nodes)
        index = {(): 0}
        row_tokens, row_depths, row_ancestors, row_parents = [anchor], [0], [1], [-1]
        for j, path in enumerate(paths, start=1):
            parent = index[path[:-1]]
            index[path] = j
            row_parents.append(parent)
            row_tokens.append(path[-1])
            row_depths.append(len(path))
            row_ancestors.append(row_ancestors[parent] | (1 << j))
        tokens.append(row_tokens), depths.append(row_depths), ancestors.append(row_ancestors)
        parents.append(row_parents)
    dev = top_tokens.device
    return DraftTree(to_device(tokens, torch.long, dev), parents, to_device(depths, torch.long, dev),
                     to_device(ancestors, torch.long, dev), tokens)


def merge(drafted: list[tuple[tuple[int, ...], float]], branch: list[tuple[int, float]],
          nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` likeliest distinct token paths of the drafter's (token path, log-probability) list, best first,
    and a branch's prefixes, each source taken in its own order (both are prefix-closed in it, so the result is a
    tree whose parents come before their children)."""
    chain = [(tuple(t for t, _ in branch[: d + 1]), score) for d, (_, score) in enumerate(branch)]
    kept: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    i = j = 0
    while len(kept) < nodes and (i < len(drafted) or j < len(chain)):
        if j < len(chain) and (i == len(drafted) or chain[j][1] > drafted[i][1]):
            path, j = chain[j][0], j + 1
        else:
            path, i = drafted[i][0], i + 1
        if path not in seen:
            seen.add(path)
            kept.append(path)
    return kept


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tree_depth(tokens: list[int], parents: list[int], chain: list[int]) -> int:
    """How many leading tokens of `chain` a tree row (its node tokens and parents) holds as a path from its root."""
    node, depth = 0, 0
    for token in chain:
        node = next((j for j, p in enumerate(parents) if p == node and tokens[j] == token), None)
        if node is None:
            break
        depth += 1
    return depth


def accept_tree(tree: DraftTree, choices: list[list[int]]) -> list[list[int]]:
    """Greedy acceptance: choices[b][j] is the target's token after node j of row b. From the root, follow the
    child whose token is the target's choice at the current node -> per row the accepted path's node indices, root
    first (the emitted tokens are those nodes' drafts after the root, then the choice at the last one)."""
    paths = []
    tokens = tree.node_tokens
    for row, parents in enumerate(tree.parents):
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents[1:], start=1):
            children.setdefault(parent, []).append(node)
        path = [0]
        while True:
            want = choices[row][path[-1]]
            nxt = next((c for c in children.get(path[-1], ()) if tokens[row][c] == want), None)
            if nxt is None:
                break
            path.append(nxt)
        paths.append(path)
    return paths
