"""Verification references on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from specheads.decoding.tree import DraftTree
from specheads.decoding.verify import (verify, verify_chain_sampling, verify_greedy, verify_tree_sampling,
                                       verify_typical)


def onehot_logits(rows, V=6):
    out = torch.full((len(rows), V), -5.0)
    for i, r in enumerate(rows):
        out[i, r] = 5.0
    return out


def test_greedy_walks_the_matching_branch():
    # root children: 2 (node0), 3 (node1); node1's children: 4 (node2), 1 (node3)
    tree = DraftTree(torch.tensor([2, 3, 4, 1]), torch.tensor([-1, -1, 1, 1]))
    logits = onehot_logits([3, 0, 1, 0, 5])  # argmax after root=3, after node1=1, after node3=5
    v = verify_greedy(logits, tree)
    assert v.path == [1, 3] and v.bonus == 5
    assert v.tested == [1, 1] and v.accepted == [1, 1]


def test_greedy_rejects_first():
    tree = DraftTree.chain([2, 2])
    v = verify_greedy(onehot_logits([4, 2, 2]), tree)
    assert v.path == [] and v.bonus == 4 and v.tested == [1] and v.accepted == [0]


def test_chain_sampling_accepts_when_p_equals_q_and_adds_bonus():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(logits[:2].double(), -1)
    tree = DraftTree.chain([1, 2], q)
    v = verify_chain_sampling(logits, tree, 1.0, torch.Generator().manual_seed(1))
    assert v.path == [0, 1] and v.tokens_emitted == 3


def test_chain_sampling_rejects_impossible_token_and_resamples_from_residual():
    logits = torch.tensor([[0.0, 0.0, -1e9, -1e9], [0.0] * 4])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # drafted token 2 has p = 0
    for seed in range(20):
        v = verify_chain_sampling(logits, DraftTree.chain([2], q), 1.0, torch.Generator().manual_seed(seed))
        assert v.path == [] and v.bonus in (0, 1)


def test_tree_sampling_never_emits_a_rejected_child_as_bonus():
    logits = torch.zeros(3, 4)
    tree = DraftTree(torch.tensor([0, 1]), torch.tensor([-1, -1]))
    for seed in range(30):
        v = verify_tree_sampling(logits, tree, 1.0, torch.Generator().manual_seed(seed))
        if not v.path:
            assert v.bonus in (2, 3)


def test_typical_is_greedy_at_zero_and_checks_threshold():
    tree = DraftTree.chain([1, 2])
    logits = onehot_logits([1, 2, 3])
    assert verify_typical(logits, tree, 0.0).path == [0, 1]
    v = verify_typical(logits, tree, 1.0, torch.Generator().manual_seed(0))
    assert v.path == [0, 1]
    flat = torch.zeros(3, 6)  # uniform: p = 1/6 > min(0.09, 0.3 * e^{-ln 6}) = 0.05 -> accepted
    assert verify_typical(flat, tree, 1.0, torch.Generator().manual_seed(0)).path == [0, 1]


def test_dispatch_and_errors():
    tree = DraftTree.chain([1])
    with pytest.raises(ValueError, match="unknown verification"):
        verify("nope", torch.zeros(2, 4), tree, 1.0)
    with pytest.raises(ValueError, match="needs a chain with draft probabilities"):
        verify("chain", torch.zeros(2, 4), tree, 1.0)
    with pytest.raises(ValueError, match=r"\(n\+1, V\)"):
        verify_greedy(torch.zeros(5, 4), tree)
