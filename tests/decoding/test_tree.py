"""Draft trees: static (Medusa) choices, accuracy-built trees, dynamic EAGLE-2 trees."""

from __future__ import annotations

import pytest
import torch

from specheads.decoding.tree import (DraftTree, chain_choices, choices_from_accuracies, dynamic_trees,
                                     normalize_choices, static_tree)


def test_static_tree_from_choices():
    top = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = static_tree(top, normalize_choices([(0, 1), (0,), (1,), (0, 0), (0, 0, 2)]))
    assert tree.tokens.tolist() == [10, 11, 20, 21, 32]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]
    assert tree.depths().tolist() == [1, 1, 2, 2, 3]
    tree.check_distinct_siblings()
    assert static_tree(top, chain_choices(3)).is_chain()


def test_choices_need_parents_and_range():
    with pytest.raises(ValueError, match="lacks its parent"):
        normalize_choices([(0, 1)])
    with pytest.raises(ValueError, match="needs head 2"):
        static_tree(torch.zeros(2, 2, dtype=torch.long), [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])


def test_choices_from_accuracies_picks_highest_path_probability():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]
    ch = choices_from_accuracies(acc, 4)
    # values: (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.18 (1,0)=.1 ...
    assert set(ch) == {(0,), (0, 0), (1,), (0, 1)}
    assert ch == normalize_choices(ch)


def test_dynamic_tree_reranks_by_path_confidence():
    V = 8
    root = torch.log_softmax(torch.tensor([[3.0, 2.0, 0, 0, 0, 0, 0, 0]]), -1)
    table = {0: torch.tensor([0.0, 4.0, 3.0, 0, 0, 0, 0, 0]), 1: torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 5.0])}
    calls = []

    def expand(nodes, tokens, parents):
        calls.append((nodes, tokens, parents))
        return torch.stack([torch.log_softmax(table.get(t, torch.zeros(V)), -1) for t in tokens[0]])[None]

    trees = dynamic_trees(root, expand, depth=2, topk=2, total_tokens=3)
    t = trees[0]
    assert len(calls) == 1 and calls[0][1] == [[0, 1]]
    # path scores: tok0 -0.35, tok1 -1.35, (1 after 0) -0.35-0.35, (7 after 1) -1.35-0.03
    assert t.tokens.tolist() == [0, 1, 1]
    assert t.parents.tolist() == [-1, -1, 0]


def test_tree_validation():
    with pytest.raises(ValueError, match="topological"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="siblings"):
        DraftTree(torch.tensor([1, 1]), torch.tensor([-1, -1])).check_distinct_siblings()


def test_graft_chain_shares_the_existing_prefix_and_keeps_siblings_distinct():
    # root -> 5 (0) -> 7 (2); root -> 6 (1)
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]))
    g = tree.graft_chain([5, 7, 9, 9])
    assert g.tokens.tolist() == [5, 6, 7, 9, 9] and g.parents.tolist() == [-1, -1, 0, 2, 3]
    g.check_distinct_siblings()
    new_root = tree.graft_chain([8, 5])  # a new first token: a new branch from the root
    assert new_root.tokens.tolist() == [5, 6, 7, 8, 5] and new_root.parents.tolist() == [-1, -1, 0, -1, 3]
    new_root.check_distinct_siblings()


def test_graft_chain_that_adds_nothing_keeps_the_tree_and_its_draft_probabilities():
    q = torch.full((2, 4), 0.25, dtype=torch.float64)
    chain = DraftTree.chain([1, 2], q)
    assert chain.graft_chain([1]) is chain and chain.graft_chain([]) is chain
    grown = chain.graft_chain([1, 3])
    assert grown.q is None and not grown.is_chain()  # verified by the target-only walk from now on
    assert grown.tokens.tolist() == [1, 2, 3] and grown.parents.tolist() == [-1, 0, 0]
    assert DraftTree.empty().graft_chain([4, 4]).tokens.tolist() == [4, 4]
    with_extra = DraftTree(torch.tensor([1]), torch.tensor([-1]), extra_tokens=torch.tensor([2]),
                           extra_parents=torch.tensor([-1]))
    with pytest.raises(ValueError, match="extra nodes"):
        with_extra.graft_chain([3])
