"""scripts/peers/compare_modelopt.py without ModelOpt: our feature store as ModelOpt's offline rows (our training and
held-out rows, the same tokens and hidden states, the answer mask at ModelOpt's position for EAGLE-3 and as it is for
DFlash, our draft vocabulary as ModelOpt loads it), the mapping of our settings to ModelOpt's DFlash config and to ours,
the refused families and the report, a trainer comparison against ModelOpt. With ModelOpt importable
(``MODELOPT_SITE=<folder holding it>``): its DFlash draft, built from the script's config, exported and read by our
evaluator as a head whose states equal ModelOpt's forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states
from specheads.data.prepare import load_prepared
from specheads.methods.base import FeatureSpec
from specheads.models.vocab import build_draft_vocab, count_loss_tokens
from tests.conftest import load_script
from tests.data.test_features import SMALL, make_prepared
from tests.test_compare_specforge import final, store  # noqa: F401  (store: a fixture)

bench = load_script("scripts/peers/compare_modelopt.py")


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


# --------------------------------------------------------------------------- --method dflash


def dflash_args(*extra: str):
    args = bench.parse_args(["--features", "f", "--prepared", "p", "--method", "dflash", *extra])
    args.mask_token = 5  # main() sets it: compare_speculators' mask_token (our default rule)
    return args


def test_the_store_converts_to_modelopts_dflash_rows(store, tmp_path):
    prepared, features, _ = store
    info = bench.convert_store(features, prepared, tmp_path / "mo", 256, 64, eval_samples=3, method="dflash")
    ours = FeatureDataset(features)
    train, held = bench.cs.heldout_split(ours, 3, 0)
    assert info["ids"] == [ours.ids[i] for i in list(train) + list(held)] and info["method"] == "dflash"
    files = sorted(Path(info["train_dir"]).glob("*.pt")) + sorted(Path(info["heldout_dir"]).glob("*.pt"))
    for f, i in zip(files, list(train) + list(held), strict=True):
        row, want = torch.load(f, weights_only=True), ours[i]
        assert torch.equal(row["loss_mask"], want["loss_mask"].long())  # unshifted: both count token a+k at a+k
        assert torch.equal(row["aux_hidden_states"].float(), want["hidden_aux"])
        assert torch.equal(row["hidden_states"].float(), want["hidden_last"])  # its reader requires the key
    # an EAGLE-3 conversion of the same store is another format: not reused as DFlash rows
    again = bench.convert_store(features, prepared, tmp_path / "mo", 256, 64, eval_samples=3)
    assert again["method"] == "eagle3" and torch.load(Path(again["train_dir"]) / "000000.pt")["loss_mask"][-1] == 0


def test_modelopt_pads_dflash_rows_to_a_multiple_of_the_block_that_fits_every_anchor():
    assert bench.train_length("eagle3", 100, 8) == 100
    assert [bench.train_length("dflash", n, 8) for n in (1, 2, 9, 10, 100)] == [8, 16, 16, 24, 112]


def test_dflash_settings_map_to_modelopts_dflash_config_and_ours(store, tmp_path):
    _, _, target_dir = store
    args = dflash_args("--epochs", "2", "--max-tokens", "400", "--warmup-steps", "3", "--target", str(target_dir))
    assert args.settings == ["bfloat16"] and bench.cs.parse_setting(args.settings[0]) == ("bfloat16", 1)
    data = {"max_length": 100, "aux_layers": [1, 2, 3], "train_dir": "tr", "heldout_dir": "he", "d2t": "d2t.pt"}
    flags = bench.modelopt_flags(args, "bfloat16", 1, data, tmp_path)
    assert (flags["method"], flags["train_len"], flags["batch_rows"], flags["aux_ids"]) == ("dflash", 112, 3, [0, 1, 2])
    assert "ttt" not in flags and "d2t" not in flags  # the whole vocabulary, no TTT steps
    cfg = bench.dflash_config(flags)
    assert {k: cfg[k] for k in ("dflash_block_size", "dflash_num_anchors", "dflash_mask_token_id",
                                "dflash_self_logit_distillation", "dflash_loss_objective",
                                "dflash_loss_decay_factor", "dflash_use_torch_compile")} == {
        "dflash_block_size": 8, "dflash_num_anchors": 32, "dflash_mask_token_id": 5,
        "dflash_self_logit_distillation": False, "dflash_loss_objective": "decay", "dflash_loss_decay_factor": 4.0,
        "dflash_use_torch_compile": False}
    assert cfg["dflash_architecture_config"] == {  # the tiny target's layer shape, one layer
        "num_hidden_layers": 1, "hidden_act": "silu", "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    # ours: one full-attention layer, block 8, 32 anchors a row, the mask token, the data's labels and the same loss
    ours = bench.cs.ours_command(args, "bfloat16", 1, tmp_path)
    assert {k: final(ours, k) for k in ("method", "method.num_layers", "method.block_size", "method.anchors",
                                        "method.mask_token_id", "method.labels", "method.loss", "method.gamma",
                                        "method.init_layer_from_target", "train.mixed_precision", "data.epochs",
                                        "optim.lr", "optim.warmup_steps")} == {
        "method": "dflash", "method.num_layers": "1", "method.block_size": "8", "method.anchors": "32",
        "method.mask_token_id": "5", "method.labels": "data", "method.loss": "ce", "method.gamma": "4.0",
        "method.init_layer_from_target": "false", "train.mixed_precision": "bf16", "data.epochs": "2",
        "optim.lr": "0.0015", "optim.warmup_steps": "3"}
    assert (flags["epochs"], flags["lr"], flags["warmup_steps"], flags["max_steps"]) == (2, 0.0015, 3, None)
    dpace = dflash_args("--loss", "dpace", "--max-steps", "4")
    flags = bench.modelopt_flags(dpace, "float32", 1, data, tmp_path)
    assert (flags["objective"], flags["gamma"], flags["max_steps"]) == ("dpace", 0.0, 4)
    ours = bench.cs.ours_command(dpace, "float32", 1, tmp_path)
    assert (final(ours, "method.loss"), final(ours, "train.max_steps"), final(ours, "data.epochs")) == (
        "dpace", "4", "null")


@pytest.mark.parametrize("method, why", [("peagle", "megatron_eagle.py:526"), ("dspark", "hf_dspark.py:194")])
def test_the_families_modelopt_cannot_compare_are_refused_with_the_reason(method, why, capsys):
    assert sorted((*bench.METHODS, *bench.REFUSED)) == sorted(bench.cs.METHODS)  # each family compared or refused
    with pytest.raises(SystemExit):
        bench.parse_args(["--features", "f", "--prepared", "p", "--method", method])
    assert why in capsys.readouterr().err.replace("\n", " ")


def test_dflash_reports_modelopts_accuracy_under_its_own_name(tmp_path):
    val = {"loss": 3.0, "acc_step0": 0.2, "tokens": 10}
    assert bench.their_heldout(dflash_args(), val) == {"loss": 3.0, "top1_all_slots": 0.2}
    eagle3 = bench.parse_args(["--features", "f", "--prepared", "p"])
    assert eagle3.settings == ["float32:1"] and bench.their_heldout(eagle3, val) == {"loss": 3.0, "full_acc_step0": 0.2}
    out = bench.report(dflash_args("--max-steps", "4"), tmp_path, None, [])
    assert (out["method"], out["peer"], out["budget"]) == ("dflash", "modelopt", {"epochs": 1, "max_steps": 4})
    matched = {"block_size": 8, "anchors": 32, "mask_token_id": 5, "labels": "data", "loss": "ce", "gamma": 4.0}
    assert matched.items() <= out["settings"].items()


# --------------------------------------------------------------------------- against ModelOpt itself (skipped without)


@pytest.fixture
def modelopt(monkeypatch):
    """ModelOpt 0.47, from ``MODELOPT_SITE`` (the folder given to the script as --modelopt-site) or the path."""
    for site in filter(None, [__import__("os").environ.get("MODELOPT_SITE")]):
        monkeypatch.syspath_prepend(site)
    return pytest.importorskip("modelopt.torch.speculative", reason="ModelOpt is not importable (set MODELOPT_SITE)")


def test_modelopts_dflash_export_is_read_and_decoded_as_it_trained(modelopt, store, tiny_target, tmp_path):
    """ModelOpt builds its offline DFlash draft from the script's config (one layer fed our three aux layers) and
    exports it; our evaluator reads that folder as a DFlash head of the same settings whose states equal ModelOpt's
    forward over the same blocks, context and mask."""
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    from specheads.export.foreign import foreign_format, load_foreign_head
    from specheads.models.dflash import block_attention_mask

    _, _, target_dir = store
    flags = {"method": "dflash", "target": str(target_dir), "aux_ids": [0, 1, 2], "block_size": 4, "anchors": 2,
             "mask_token": 5, "objective": "decay", "gamma": 4.0}
    bench._shim_transformers("dflash")
    theirs = load_vlm_or_llm(str(target_dir), use_offline_training=True, dtype=torch.float32, device_map="cpu")
    bench.convert_dflash(theirs, flags)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.dflash_module.parameters():  # away from the init's ones and zeros
            p.add_(torch.randn_like(p) * 0.1)
    export_speculative_decoding(theirs, export_dir=str(tmp_path / "export"))
    assert foreign_format(tmp_path / "export") == "dflash"
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["num_target_layers"] == 0 and cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # offline export
    ours = load_foreign_head(tmp_path / "export", tiny_target).float().attach(tiny_target).eval()
    assert (ours.config.aux_layers, ours.block_size, ours.config.mask_token_id) == ([1, 2, 3], 4, 5)

    S, anchors, keep = 12, torch.tensor([[3, 7]]), torch.ones(1, 2, dtype=torch.bool)
    aux = torch.randn(1, S, 3 * 64, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(2))
    block_ids = ours.block_inputs(ids.gather(1, anchors)).reshape(1, -1)
    block_pos = (anchors[:, :, None] + torch.arange(4)).reshape(1, -1)
    with torch.no_grad():
        want = theirs.dflash_module(noise_embedding=tiny_target.raw_embedding(block_ids), target_hidden=aux,
                                    position_ids=torch.cat([torch.arange(S)[None], block_pos], 1),
                                    attention_mask=theirs._build_draft_attention_mask(S, anchors, keep, 2,
                                                                                       torch.float32, "cpu"))
        assert torch.equal(theirs._build_noise_embedding(ids, anchors, keep, 2), tiny_target.raw_embedding(block_ids))
        cache = ours.extend_context(ours.new_cache(), ours.fuse(aux), torch.arange(S)[None])
        got = ours.norm(ours.decode(block_ids, block_pos, cache, block_attention_mask(anchors, 4, S)))
    torch.testing.assert_close(got, want)
