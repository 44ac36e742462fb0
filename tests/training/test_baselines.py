import pytest

from specheads.training.baselines import BigramBaseline, bigram_accuracy


def test_bigram_learns_most_frequent_follower_and_respects_mask():
    seqs = [[1, 2, 1, 2, 1, 3], [1, 2, 5, 6]]
    masks = [[1] * 6, [1, 1, 1, 1]]
    b = BigramBaseline(1).fit(seqs, masks)
    assert b.table[1] == 2 and b.table[2] == 1 and b.table[5] == 6
    # Masked-out labels are not counted: 1 -> 3 would win if its label counted twice more.
    b2 = BigramBaseline(1).fit([[1, 3, 1, 3, 1, 2]], [[1, 0, 1, 0, 1, 1]])
    assert b2.table[1] == 2
    assert b.accuracy([[1, 2, 9, 9]], [[0, 1, 1, 1]]) == (1, 3)  # 9 unseen -> fallback (label 2)


def test_skip_bigram_distance_and_row_formats():
    rows = [{"input_ids": [i % 4 for i in range(12)], "loss_mask": [1] * 12}]
    assert bigram_accuracy(rows, rows, distance=2) == 1.0
    cols = {"input_ids": [[0, 1, 0, 2]], "loss_mask": [[1, 1, 1, 1]]}
    assert bigram_accuracy(cols, cols, distance=1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="distance"):
        BigramBaseline(0)
