"""The n-gram table (most frequent next token per n-gram of a corpus), as built, chained and loaded."""

from __future__ import annotations

import pytest
import torch

from specheads.decoding.ngram_table import NgramTable


def test_most_frequent_next_token_per_ngram_longest_order_first():
    # (1, 2, 3) is followed by 4 twice and by 5 once; (2, 3) also by 6 after a 0
    table = NgramTable.build([([1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3, 4, 0, 2, 3, 6, 0, 2, 3, 6], None)])
    assert table.next_token([7, 1, 2, 3]) == 4
    assert table.next_token([0, 2, 3]) == 6  # the 3-gram (0, 2, 3) decides, not the 2-gram (2, 3)
    assert table.next_token([8, 2, 3]) == 4  # no (8, 2, 3): the 2-gram (2, 3) (4 twice, 6 twice, 5 once: first seen)
    assert table.next_token([7, 7]) is None and table.next_token([]) is None
    assert table.chain([1, 2, 3], 3) == [4, 9, 1]  # (2,3,4) -> 9, (3,4,9) -> 1
    assert table.chain([1, 2, 3], 0) == [] and table.chain([42], 3) == []


def test_next_tokens_given_as_labels_replace_the_corpus_tokens():
    # the target's argmax after each prefix, not the token the corpus has there
    table = NgramTable.build([([1, 2, 3, 4], [11, 12, 13, 14])])
    assert table.next_token([1, 2]) == 12 and table.next_token([1, 2, 3]) == 13 and table.next_token([3, 4]) == 14
    assert table.chain([1, 2], 2) == [12]  # (2, 12) was never seen


def test_min_count_drops_rare_ngrams():
    rows = [([1, 2, 3, 1, 2, 3, 4, 5, 6], None)]
    assert NgramTable.build(rows, min_count=2).next_token([1, 2]) == 3
    assert NgramTable.build(rows, min_count=2).next_token([4, 5]) is None
    assert NgramTable.build(rows, min_count=1).next_token([4, 5]) == 6


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="orders"):
        NgramTable.build([([1, 2], None)], orders=())
    with pytest.raises(ValueError, match="orders"):
        NgramTable.build([([1, 2], None)], orders=(2, 0))
    with pytest.raises(ValueError, match="min_count"):
        NgramTable.build([([1, 2], None)], min_count=0)
    with pytest.raises(ValueError, match="3 tokens but 2 next"):
        NgramTable.build([([1, 2, 3], [4, 5])])


def test_loaded_from_a_feature_store_with_the_targets_argmax_or_from_prepared_tokens(tiny_target, tmp_path):
    from tests.data.test_features import collect, make_prepared

    from specheads.data.features import FeatureDataset
    from specheads.data.prepare import load_prepared
    from specheads.data.store import StoreMismatchError
    from specheads.errors import InputNotFoundError
    from specheads.evaluation.suite import load_ngram_table
    from tests.conftest import make_tiny_target

    path = make_prepared(tmp_path)
    data = load_prepared(path)[0]
    collect(tiny_target, data, tmp_path / "store", dtype="float32")
    rows = {r["id"]: r["input_ids"] for r in data}

    # the store's table reads the target's argmax, the prepared one the corpus's next tokens
    from_store = load_ngram_table(str(tmp_path / "store"), tiny_target)
    with torch.no_grad():
        argmax = {i: tiny_target.model(torch.tensor([ids])).logits[0].argmax(-1).tolist() for i, ids in rows.items()}
    order = FeatureDataset(tmp_path / "store").ids  # the store's row order (ties go to the first seen)
    assert from_store.tables == NgramTable.build([(rows[i], argmax[i]) for i in order]).tables
    assert from_store.tables != NgramTable.build([(r, None) for r in rows.values()]).tables
    from_prepared = load_ngram_table(str(path), tiny_target)
    assert from_prepared.tables == NgramTable.build([(r, None) for r in rows.values()]).tables

    # evaluated chats are left out
    some = "conv-3"
    without = load_ngram_table(str(path), tiny_target, exclude_ids={some})
    assert without.tables == NgramTable.build([(r, None) for i, r in rows.items() if i != some]).tables
    assert len(without) < len(from_prepared)

    # a token budget reads the leading rows only (at least one)
    lengths = {r["id"]: len(r["input_ids"]) for r in data}
    first = [i for i in order][:3]
    capped = load_ngram_table(str(tmp_path / "store"), tiny_target, max_tokens=sum(lengths[i] for i in first))
    assert capped.tables == NgramTable.build([(rows[i], argmax[i]) for i in first]).tables
    ids_in_order = [str(i) for i in data["id"]]
    one = load_ngram_table(str(path), tiny_target, max_tokens=1)
    assert one.tables == NgramTable.build([(rows[ids_in_order[0]], None)]).tables
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        load_ngram_table(str(path), tiny_target, max_tokens=0)

    with pytest.raises(InputNotFoundError, match="no such folder"):
        load_ngram_table(str(tmp_path / "nowhere"), tiny_target)
    with pytest.raises(StoreMismatchError, match="config hash"):
        load_ngram_table(str(tmp_path / "store"), make_tiny_target("llama", hidden=32))
