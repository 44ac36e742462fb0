"""scripts/bench/compare_modelopt.py: our feature store as ModelOpt's offline rows (no ModelOpt needed): our training
and held-out rows, the same tokens and hidden states, the answer mask shifted to ModelOpt's position, our draft
vocabulary as ModelOpt loads it; the report a trainer comparison against ModelOpt."""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states
from specheads.data.prepare import load_prepared
from specheads.methods.base import FeatureSpec
from specheads.models.vocab import build_draft_vocab, count_loss_tokens
from tests.conftest import load_script
from tests.data.test_features import SMALL, make_prepared

bench = load_script("scripts/bench/compare_modelopt.py")


def test_the_store_converts_to_modelopts_offline_rows(tiny_target, tmp_path):
    prepared = make_prepared(tmp_path, n=30)
    store = tmp_path / "features"
    collect_hidden_states(tiny_target, load_prepared(prepared)[0], FeatureSpec((1, 2, 3), True), store,
                          CollectOptions(dtype="bfloat16", **SMALL))
    info = bench.convert_store(store, prepared, tmp_path / "mo", vocab_size=256, draft_vocab_size=64, eval_samples=3)
    ours = FeatureDataset(store)
    train, held = bench.cs.heldout_split(ours, 3, 0)
    assert info["ids"] == [ours.ids[i] for i in list(train) + list(held)] and info["num_train"] == len(train)
    files = sorted(Path(info["train_dir"]).glob("*.pt")) + sorted(Path(info["heldout_dir"]).glob("*.pt"))
    assert len(files) == len(train) + len(held)
    for f, i in zip(files, list(train) + list(held)):
        row, want = torch.load(f, weights_only=True), ours[i]
        assert torch.equal(row["input_ids"], want["input_ids"].long())
        assert row["hidden_states"].dtype == torch.bfloat16  # the store's bytes: exact once read as float32
        assert torch.equal(row["hidden_states"].float(), want["hidden_last"])
        assert torch.equal(row["aux_hidden_states"].float(), want["hidden_aux"])
        # ModelOpt counts the prediction made at p (of token p + 1) with mask[p]; ours counts token j with mask[j]
        assert torch.equal(row["loss_mask"][:-1], want["loss_mask"][1:].long()) and row["loss_mask"][-1] == 0
    d2t = torch.load(info["d2t"], weights_only=True)
    want_d2t, t2d = build_draft_vocab(count_loss_tokens(str(prepared), 256, rows=info["ids"][:len(train)]), 64)
    assert d2t.dtype == torch.int64 and torch.equal(d2t, want_d2t)
    assert torch.equal(torch.arange(64) + d2t, t2d.nonzero().flatten())  # target id = i + d2t[i], as ModelOpt maps
    assert bench.convert_store(store, prepared, tmp_path / "mo", 256, 64, eval_samples=3) == info  # reused

    args = bench.parse_args(["--features", str(store), "--prepared", str(prepared), "--max-tokens", "256"])
    flags = bench.modelopt_flags(args, "float32", 2, {**info, "max_length": 100}, tmp_path / "run")
    assert flags["aux_ids"] == [0, 1, 2] and flags["batch_rows"] == 2 and flags["ttt"] == 2  # decoder-layer outputs
    assert args.our_arg[:3] == bench.MATCH_OURS  # ours starts random and trains its LM head, as ModelOpt's does

    from specheads.record import trainer_compare_entry

    report = bench.report(args, tmp_path, info, [])  # what --json writes, as specheads record files it
    assert (report["kind"], report["peer"], report["budget"]) == ("trainer_compare", "modelopt", {"epochs": 1})
    assert trainer_compare_entry(report)["peer"] == "modelopt" and "speculators" not in report["versions"]
