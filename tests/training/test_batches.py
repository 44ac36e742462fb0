"""DatasetBatches: padded batch shapes keep every sample's tokens and masks."""

import pytest

from specheads.training.batches import DatasetBatches
from tests.training.engine_helpers import token_dataset


def test_pad_to_multiple_of_rounds_lengths_up_and_keeps_the_rows():
    ds = token_dataset(12, length=21)
    plain = [load() for load in DatasetBatches(ds, max_tokens=128, seed=1).batches(0)]
    padded = [load() for load in DatasetBatches(ds, max_tokens=128, seed=1, pad_to_multiple_of=16).batches(0)]
    assert len(plain) == len(padded)
    assert any(b["input_ids"].shape[1] % 16 for b in plain)  # the unpadded lengths are not multiples already
    for a, b in zip(plain, padded):
        T = a["input_ids"].shape[1]
        assert b["input_ids"].shape[1] % 16 == 0 and b["input_ids"].shape[1] >= T
        for key in ("input_ids", "attention_mask", "loss_mask"):
            assert b[key][:, :T].tolist() == a[key].tolist()
            assert not b[key][:, T:].any()  # padding: no token, attended nowhere, no loss
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        DatasetBatches(ds, pad_to_multiple_of=0)
