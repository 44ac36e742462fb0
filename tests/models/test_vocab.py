"""Draft vocabulary: d2t / t2d consistency, frequency order, small data, capping."""

from __future__ import annotations

import pytest
import torch

from specheads.models.vocab import build_draft_vocab, count_loss_tokens, coverage, draft_to_target


def _check(d2t, t2d, target_vocab):
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.numel() == target_vocab
    ids = torch.arange(d2t.numel()) + d2t
    assert torch.equal(ids, t2d.nonzero().squeeze(-1))
    assert int(ids.min()) >= 0 and int(ids.max()) < target_vocab
    assert torch.equal(draft_to_target(torch.arange(d2t.numel()), d2t), ids)


def test_counts_only_loss_masked_tokens():
    rows = [{"input_ids": [5, 6, 7, 7], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [5, 9], "loss_mask": [1, 0]}]
    counts = count_loss_tokens(rows, 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_loss_tokens([{"input_ids": [20], "loss_mask": [1]}], 12)
    with pytest.raises(ValueError, match="differ in length"):
        count_loss_tokens([{"input_ids": [1, 2], "loss_mask": [1]}], 12)


def test_most_frequent_ids_are_chosen():
    counts = torch.zeros(1000, dtype=torch.long)
    counts[[900, 3, 500, 42]] = torch.tensor([50, 40, 30, 1])
    d2t, t2d = build_draft_vocab(counts, 3)
    _check(d2t, t2d, 1000)
    assert t2d.nonzero().squeeze(-1).tolist() == [3, 500, 900]
    assert coverage(counts, t2d) == pytest.approx(120 / 121)


def test_draft_vocab_larger_than_distinct_tokens_is_filled():
    counts = torch.zeros(300, dtype=torch.long)
    counts[[250, 7]] = 5
    d2t, t2d = build_draft_vocab(counts, 10)
    _check(d2t, t2d, 300)
    assert d2t.numel() == 10 and bool(t2d[250]) and bool(t2d[7])


def test_draft_vocab_capped_at_target_vocab_and_bad_sizes():
    counts = torch.arange(64)
    d2t, t2d = build_draft_vocab(counts, 1000)
    _check(d2t, t2d, 64)
    assert d2t.numel() == 64 and bool(t2d.all()) and int(d2t.abs().sum()) == 0
    with pytest.raises(ValueError, match="positive"):
        build_draft_vocab(counts, 0)
    with pytest.raises(ValueError, match="target_vocab_size"):
        build_draft_vocab([{"input_ids": [1], "loss_mask": [1]}], 4)


def test_from_rows_matches_from_counts():
    rows = [{"input_ids": torch.randint(0, 50, (30,)).tolist(), "loss_mask": [1] * 30} for _ in range(4)]
    a = build_draft_vocab(rows, 20, target_vocab_size=50)
    b = build_draft_vocab(count_loss_tokens(rows, 50), 20)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
