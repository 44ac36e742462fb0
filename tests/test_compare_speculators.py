"""scripts/bench/compare_speculators.py: our feature store, converted, reads back through speculators' own
dataset class as the same rows, tokens and hidden states (skipped where speculators is not importable)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states
from specheads.data.prepare import load_prepared
from specheads.methods.base import FeatureSpec
from tests.conftest import load_script
from tests.data.test_features import SMALL, make_prepared

REPO = Path(__file__).resolve().parents[1]


bench = load_script("scripts/bench/compare_speculators.py")
MISSING = bench.speculators_missing()


@pytest.mark.skipif(MISSING is not None, reason=f"speculators not importable: {MISSING}")
def test_converted_store_reads_back_through_speculators(tiny_target, tmp_path):
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    prepared = make_prepared(tmp_path, n=30)
    store = tmp_path / "features"
    collect_hidden_states(tiny_target, load_prepared(prepared)[0], FeatureSpec((0, 2, 3), True), store,
                          CollectOptions(dtype="bfloat16", **SMALL))
    info = bench.convert_store(store, prepared, tmp_path / "spec", vocab_size=256, draft_vocab_size=64,
                               eval_samples=3)
    ours = FeatureDataset(store)
    row = {sid: i for i, sid in enumerate(ours.ids)}
    n_train = info["num_train"]
    _, held = bench.heldout_split(ours, 3, 0)
    assert sorted(info["ids"][n_train:]) == sorted(ours.ids[i] for i in held) and len(info["ids"]) == len(ours)

    for split, ids in (("train", info["ids"][:n_train]), ("val", info["ids"][n_train:])):
        theirs = ArrowDataset(max_len=2048, datapath=info["data_path"], on_missing="raise", split=split,
                              transfer=FileTransfer(Path(info["hidden_states_path"])),
                              train_ratio=info["train_data_ratio"], hidden_states_dtype=torch.float32)
        assert len(theirs) == len(ids)
        for k, sid in enumerate(ids):
            got, want = theirs[k], ours[row[sid]]
            torch.testing.assert_close(got["input_ids"], want["input_ids"], rtol=0, atol=0)
            torch.testing.assert_close(got["loss_mask"], want["loss_mask"], rtol=0, atol=0)
            # bfloat16 on both sides: the same bytes, so exact
            torch.testing.assert_close(got["hidden_states"].float(), want["hidden_aux"], rtol=0, atol=0)
            torch.testing.assert_close(got["verifier_last_hidden_states"].float(), want["hidden_last"], rtol=0, atol=0)

    d2t = np.load(Path(info["data_path"]) / "d2t-64.npy")
    t2d = np.load(Path(info["data_path"]) / "t2d-64.npy")
    assert t2d.shape == (256,) and t2d.sum() == 64 and (np.arange(64) + d2t == np.flatnonzero(t2d)).all()
    # a second call with the same settings reuses the folder
    assert bench.convert_store(store, prepared, tmp_path / "spec", 256, 64, eval_samples=3) == info
