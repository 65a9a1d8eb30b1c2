"""Draft trees (spec/draft_tree.py): the best-first selection against an exhaustive ranking of every path, the tree's
structure against its parents, greedy acceptance against a search over every root path."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.spec.draft_tree import (accept_tree, build_tree, common_prefix, max_nodes, merge, select_paths,
                                         tree_depth)


def _logprobs(draw_values: list[float], depth: int, width: int) -> list[list[float]]:
    rows = [sorted(draw_values[d * width : (d + 1) * width], reverse=True) for d in range(depth)]
    return [[math.log(v) for v in row] for row in rows]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(depth=st.integers(1, 4), width=st.integers(1, 4), data=st.data())
def test_selection_is_the_highest_scoring_paths(depth, width, data):
    values = data.draw(st.lists(st.floats(1e-3, 1.0), min_size=depth * width, max_size=depth * width, unique=True))
    lp = _logprobs(values, depth, width)
    every = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    score = {p: sum(lp[i][r] for i, r in enumerate(p)) for p in every}
    nodes = data.draw(st.integers(1, len(every)))
    chosen = select_paths(lp, nodes)
    assert len(chosen) == nodes == len(set(chosen))
    best = sorted(score.values(), reverse=True)[:nodes]
    assert sorted((score[p] for p in chosen), reverse=True) == pytest.approx(best)
    for i, p in enumerate(chosen):  # prefix-closed, and a parent is chosen before its children
        assert len(p) == 1 or p[:-1] in chosen[:i]


def test_a_confident_drafter_goes_deep_and_an_unsure_one_goes_wide():
    sure = [[math.log(0.95), math.log(0.04)]] * 4
    unsure = [[math.log(0.4), math.log(0.35)]] + [[math.log(0.5), math.log(0.3)]] * 3
    assert select_paths(sure, 4) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    assert set(select_paths(unsure, 3)) == {(0,), (1,), (0, 0)}


# 2 rows, K = 3 slots, 3 tokens per slot; row 1 is sure of slot 1, row 0 is not
_TOKENS = torch.tensor([[[10, 11, 12], [20, 21, 22], [30, 31, 32]],
                        [[40, 41, 42], [50, 51, 52], [60, 61, 62]]])
_PROBS = torch.tensor([[[0.5, 0.4, 0.1], [0.6, 0.3, 0.1], [0.6, 0.3, 0.1]],
                       [[0.9, 0.05, 0.05], [0.8, 0.1, 0.1], [0.7, 0.2, 0.1]]])


def _tree(nodes=5, branches=None):
    return build_tree(torch.tensor([1, 2]), _TOKENS, _PROBS.log(), nodes, branches)


def test_a_tree_holds_the_anchor_then_its_nodes_with_depths_and_ancestor_bits():
    tree = _tree()
    assert tree.num_nodes == 5
    assert tree.tokens[:, 0].tolist() == [1, 2]
    for row in range(2):
        parents = tree.parents[row]
        assert parents[0] == -1
        for j in range(1, 6):
            p = parents[j]
            assert 0 <= p < j
            assert tree.depths[row, j] == tree.depths[row, p] + 1
            assert int(tree.ancestors[row, j]) == int(tree.ancestors[row, p]) | (1 << j)
            slot = int(tree.depths[row, j]) - 1
            assert int(tree.tokens[row, j]) // 10 == row * 3 + slot + 1  # one of its own slot's tokens
    # row 1 (sure) drafts slots 1, 2, 3 of the top tokens first; row 0 also tries slot 1's second token
    assert tree.tokens[1, 1:4].tolist() == [40, 50, 60]
    assert 11 in tree.tokens[0].tolist()


def _accept_by_search(tree, choices) -> list[list[int]]:
    """Every root-to-node path whose every node carries the target's choice after its parent; the deepest."""
    out = []
    for row, parents in enumerate(tree.parents):
        best = [0]
        for node in range(1, len(parents)):
            path = [node]
            while parents[path[0]] != -1:
                path.insert(0, parents[path[0]])
            ok = all(int(tree.tokens[row, c]) == int(choices[row, p]) for p, c in zip(path, path[1:]))
            if ok and len(path) > len(best):
                best = path
        out.append(best)
    return out


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data())
def test_acceptance_follows_the_targets_choices_as_deep_as_the_tree_allows(data):
    tree = _tree(nodes=data.draw(st.integers(1, 9)))
    n = tree.num_nodes + 1
    # choices drawn among the tree's own tokens (so paths do continue) and a token no node has
    pool = sorted(set(tree.tokens.flatten().tolist())) + [99]
    choices = torch.tensor([[data.draw(st.sampled_from(pool)) for _ in range(n)] for _ in range(2)])
    assert accept_tree(tree, choices.tolist()) == _accept_by_search(tree, choices)


def test_a_tree_holds_at_most_the_paths_its_slots_allow():
    assert len(_tree(nodes=39).parents[0]) == 40  # 3 + 9 + 27 paths through 3 slots of 3 tokens
    with pytest.raises(ValueError, match="40 nodes"):
        _tree(nodes=40)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_branch_and_the_drafters_paths_share_the_nodes_by_likelihood(data):
    """merge: of the drafter's paths (best first) and the branch's prefixes (scores never rising), the `nodes` most
    likely distinct token paths, a path both propose counted once at its higher score; a tree (prefix-closed)."""
    depth, width = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    values = data.draw(st.lists(st.floats(1e-3, 1.0), min_size=depth * width, max_size=depth * width, unique=True))
    lp = _logprobs(values, depth, width)
    tokens = [[10 * (d + 1) + r for r in range(width)] for d in range(depth)]  # slot d's rank-r token
    drafted = [(tuple(tokens[d][r] for d, r in enumerate(p)), sum(lp[d][r] for d, r in enumerate(p)))
               for p in select_paths(lp, max_nodes(depth, width))]
    chain_tokens = data.draw(st.lists(st.sampled_from([10, 11, 20, 21, 30, 99]), min_size=0, max_size=4))
    steps = data.draw(st.lists(st.floats(0.01, 2.0), min_size=len(chain_tokens), max_size=len(chain_tokens),
                               unique=True))
    branch = [(t, -sum(steps[: d + 1])) for d, t in enumerate(chain_tokens)]
    nodes = data.draw(st.integers(1, len(drafted)))
    kept = merge(drafted, branch, nodes)
    score: dict = {}
    for path, sc in drafted + [(tuple(chain_tokens[: d + 1]), sc) for d, (_, sc) in enumerate(branch)]:
        score[path] = max(sc, score.get(path, -math.inf))
    assert len(kept) == len(set(kept)) == nodes
    assert sorted(score[p] for p in kept) == pytest.approx(sorted(score.values())[::-1][:nodes][::-1])
    for i, p in enumerate(kept):
        assert len(p) == 1 or p[:-1] in kept[:i]


def test_a_likely_branch_takes_the_drafters_least_likely_nodes_and_shares_the_rest():
    """build_tree with a branch: row 0's branch starts on its top slot-1 token and leaves the tree after it; likelier
    than the drafter's last paths, it replaces them; row 1's unlikely branch changes nothing."""
    plain = _tree(5)
    top0 = int(plain.tokens[0, 1])
    branches = [[(top0, math.log(0.9)), (77, math.log(0.8)), (78, math.log(0.7))], [(99, math.log(0.01))]]
    tree = _tree(5, branches)
    assert tree.num_nodes == 5
    assert tree_depth(tree.tokens[0].tolist(), tree.parents[0], [top0, 77, 78]) == 3  # shared, then its own two
    assert tree_depth(tree.tokens[1].tolist(), tree.parents[1], [99]) == 0
    assert torch.equal(tree.tokens[1], plain.tokens[1]) and tree.parents[1] == plain.parents[1]
    for row in range(2):
        for j in range(1, 6):
            p = tree.parents[row][j]
            assert 0 <= p < j and tree.depths[row, j] == tree.depths[row, p] + 1
            assert int(tree.ancestors[row, j]) == int(tree.ancestors[row, p]) | (1 << j)
    choices = torch.zeros(2, 6, dtype=torch.long)  # the target agrees with the branch all the way
    node77 = next(j for j in range(6) if int(tree.tokens[0, j]) == 77)
    node78 = next(j for j in range(6) if int(tree.tokens[0, j]) == 78)
    choices[0, 0], choices[0, 1], choices[0, node77], choices[0, node78] = top0, 77, 78, 5
    assert accept_tree(tree, choices.tolist())[0] == [0, 1, node77, node78]


def test_common_prefix_counts_leading_agreement():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7], [7]) == 1
