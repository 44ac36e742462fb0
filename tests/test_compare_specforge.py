"""scripts/peers/compare_specforge.py without SpecForge: our feature store as SpecForge's offline rows (our training and
held-out rows, the same tokens and hidden states, the answer mask at SpecForge's position, our draft vocabulary as its
vocab mapping; DFlash's rows), the check of which side of the final norm the store's last state is on, the target
folder SpecForge's target head reads, and the mapping of our settings to SpecForge's run config (EAGLE-3, DFlash).
With SpecForge importable (``SPECFORGE_SITE=<folder holding it>``): its schema accepts the run configs, and its DFlash
export is read by our evaluator as a head whose states equal SpecForge's."""

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

bench = load_script("scripts/peers/compare_specforge.py")


@pytest.fixture
def store(tiny_target, tmp_path):
    """(prepared folder, feature store, the tiny target saved as a model folder)."""
    prepared = make_prepared(tmp_path, n=30)
    features = tmp_path / "features"
    collect_hidden_states(tiny_target, load_prepared(prepared)[0], FeatureSpec((1, 2, 3), True), features,
                          CollectOptions(dtype="bfloat16", **SMALL))
    target_dir = tmp_path / "target"
    tiny_target.model.save_pretrained(target_dir)
    return prepared, features, target_dir


def test_the_store_converts_to_specforges_offline_rows(store, tmp_path):
    prepared, features, target_dir = store
    info = bench.convert_store(features, prepared, tmp_path / "sf", target_dir, draft_vocab_size=64, eval_samples=3)
    ours = FeatureDataset(features)
    train, held = bench.cs.heldout_split(ours, 3, 0)
    assert info["ids"] == [ours.ids[i] for i in list(train) + list(held)] and info["num_train"] == len(train)
    assert info["last_state"]["state"] == "post-norm"  # what the store holds (HF hidden_states[N])
    H = ours.hidden_size
    for split, rows in (("train", train), ("heldout", held)):
        files = sorted(Path(info[f"{split}_dir"]).rglob("*.ckpt"))
        assert len(files) == len(rows)
        assert all(f.parent.name == "rows_0-2000" for f in files)  # SpecForge's capture layout
        for k, i in enumerate(rows):
            row, want = torch.load(bench.row_file(Path(info[f"{split}_dir"]), k), weights_only=True), ours[i]
            T = want["input_ids"].numel()
            assert set(row) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
            assert torch.equal(row["input_ids"], want["input_ids"].long()) and row["input_ids"].shape == (T,)
            assert row["aux_hidden_state"].shape == (1, T, 3 * H) and row["hidden_state"].shape == (1, T, H)
            assert row["aux_hidden_state"].dtype == row["hidden_state"].dtype == torch.bfloat16
            # a bfloat16 store: the same bytes
            assert torch.equal(row["aux_hidden_state"][0].float(), want["hidden_aux"])
            assert torch.equal(row["hidden_state"][0].float(), want["hidden_last"])
            # SpecForge counts the prediction of token p + 2 with mask[p]; ours counts token j with mask[j]
            assert torch.equal(row["loss_mask"][:-2], want["loss_mask"][2:].long())
            assert row["loss_mask"][-2:].tolist() == [0, 0]
    mapping = torch.load(info["vocab_mapping"], weights_only=True)
    want_d2t, want_t2d = build_draft_vocab(count_loss_tokens(str(prepared), 256, rows=info["ids"][:len(train)]), 64)
    assert set(mapping) == {"d2t", "t2d"} and mapping["t2d"].dtype == torch.bool
    assert torch.equal(mapping["d2t"], want_d2t) and torch.equal(mapping["t2d"], want_t2d)
    assert torch.equal(torch.arange(64) + mapping["d2t"], mapping["t2d"].nonzero().flatten())  # SpecForge's offsets
    assert info["train_tokens"] == sum(ours.lengths[i] for i in train) and info["lm_head_key"] == "lm_head.weight"
    assert bench.convert_store(features, prepared, tmp_path / "sf", target_dir, 64, eval_samples=3) == info  # reused


def test_the_shifted_mask_trains_the_same_tokens_at_every_ttt_step():
    from specheads.methods.ttt import step_rows

    ours = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 1])
    T = ours.numel()
    theirs = bench.specforge_loss_mask(ours)
    batch = {"input_ids": torch.arange(T)[None], "loss_mask": ours[None], "attention_mask": torch.ones(1, T)}
    for k in range(4):
        _, t = step_rows(batch, k)
        ours_tokens = sorted((t + 2 + k).tolist())  # our step k at row t predicts token t + 2 + k
        # SpecForge: step k reads its mask shifted left k times, and position p predicts token p + k + 2
        shifted = torch.cat([theirs[k:], torch.zeros(k, dtype=theirs.dtype)])
        theirs_tokens = sorted((shifted.nonzero().flatten() + k + 2).tolist())
        assert theirs_tokens == ours_tokens and ours_tokens


def test_the_final_norm_check_tells_a_post_norm_state_from_a_pre_norm_one(tiny_target):
    model = tiny_target.model
    # a uniform norm weight (a fresh model's ones) scales each row only, which leaves the argmax alike: no verdict
    ones = model.model.norm.weight.float()
    states = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    flat = bench.final_norm_check([(states, (states @ model.lm_head.weight.float().T).argmax(-1))],
                                  model.lm_head.weight.float(), ones, model.config.rms_norm_eps)
    assert flat["state"] is None and flat["agree_as_is"] == flat["agree_normed"] == 1.0
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(2)) * 3)
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, inp, out: seen.update(pre=inp[0][0]))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hook.remove()
    argmax = out.logits[0].argmax(-1)
    head = model.lm_head.weight.float()
    norm, eps = model.model.norm.weight.float(), model.config.rms_norm_eps
    post = bench.final_norm_check([(out.hidden_states[-1][0], argmax)], head, norm, eps)
    pre = bench.final_norm_check([(seen["pre"], argmax)], head, norm, eps)
    assert post["state"] == "post-norm" and post["agree_as_is"] == 1.0
    assert pre["state"] == "pre-norm" and pre["agree_normed"] == 1.0
    # the norm the conversion applies to a pre-norm state gives the post-norm one
    torch.testing.assert_close(bench.rms_norm(seen["pre"], norm, eps), out.hidden_states[-1][0])
    with pytest.raises(SystemExit, match="neither"):
        bench.final_norm_check([(torch.randn(40, head.shape[1]), argmax)], head, norm, eps)


def test_the_target_folder_gets_the_index_and_lm_head_key_specforges_target_head_reads(store, tmp_path):
    _, _, target_dir = store
    folder = Path(bench.specforge_target(target_dir, tmp_path / "sf-target"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as st:
        assert set(index["weight_map"]) == set(st.keys())
    assert (folder / "model.safetensors").resolve() == (target_dir / "model.safetensors").resolve()
    assert bench.specforge_target(folder, tmp_path / "again") == str(folder.resolve())  # has an index: used as it is
    weights = bench.target_weights(target_dir)
    assert weights["lm_head_key"] == "lm_head.weight" and weights["lm_head"].shape == (256, 64)
    draft = bench.draft_config(target_dir, 64)
    assert draft["num_hidden_layers"] == 1 and draft["draft_vocab_size"] == 64 and draft["vocab_size"] == 256
    assert (draft["hidden_size"], draft["num_attention_heads"], draft["num_key_value_heads"]) == (64, 4, 2)


def test_our_settings_map_to_specforges_run_config(tmp_path):
    args = bench.parse_args(["--features", "f", "--prepared", "p", "--epochs", "2", "--max-tokens", "400",
                             "--lr", "0.002", "--warmup-steps", "3", "--their-arg=training.log_interval=5"])
    # 40 training rows of 100 tokens: our batches of 400 tokens hold 4 rows, 10 steps an epoch
    data = {"num_train": 40, "lengths": [100] * 40 + [90] * 4, "max_length": 100, "aux_layers": [2, 15, 27],
            "train_dir": "tr", "heldout_dir": "he", "vocab_mapping": "vm.pt",
            "lm_head_key": "model.embed_tokens.weight"}
    cfg = bench.with_overrides(bench.specforge_config(args, 5, data, tmp_path, "tgt", "draft.json"), args.their_arg)
    t = cfg["training"]
    assert t["batch_size"] == 4 and t["num_epochs"] == 2 and t["ttt_length"] == 5 and t["learning_rate"] == 0.002
    total = (40 // 4) * 2
    assert int(t["warmup_ratio"] * total) == 3  # SpecForge's warm-up steps: int(ratio * total steps)
    assert t["save_interval"] == t["eval_interval"] == total and t["max_grad_norm"] == bench.OUR_MAX_GRAD_NORM
    assert (t["attention_backend"], t["fsdp_sharding"], t["log_interval"]) == ("sdpa", "NO_SHARD", 5)
    m, d = cfg["model"], cfg["data"]
    assert m["aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang's ids: decoder-layer outputs, ours minus one
    assert m["vocab_mapping_path"] == "vm.pt" and m["lm_head_key"] == "model.embed_tokens.weight"
    assert m["torch_dtype"] == "bfloat16" and m["target_model_path"] == "tgt"
    assert (d["hidden_states_path"], d["eval_hidden_states_path"], d["max_length"]) == ("tr", "he", 100)
    assert d["dataloader_num_workers"] == 0
    # ours starts random and trains its LM head, as SpecForge's does: the matching overrides come last
    ours = bench.cs.ours_command(args, "bfloat16", 5, tmp_path)
    for override in bench.MATCH_OURS:
        key = override.partition("=")[0]
        assert [a for a in ours if a.startswith(key + "=")][-1] == override
    assert "data.epochs=2" in ours and "method.ttt_steps=5" in ours and "train.mixed_precision=bf16" in ours
    with pytest.raises(SystemExit, match="bfloat16 only"):
        bench.parse_setting("float32:3")


def test_aux_layers_other_than_the_default_are_written_into_the_export(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert not bench.add_aux_layers(tmp_path, [2, 15, 27], 30)
    assert "eagle_config" not in json.loads((tmp_path / "config.json").read_text())
    assert bench.add_aux_layers(tmp_path, [3, 10, 20], 30)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 9, 19]}


def test_the_report_is_a_trainer_comparison_specheads_record_files(tmp_path):
    from specheads.record import _json_kind, trainer_compare_entry

    args = bench.parse_args(["--features", "f", "--prepared", "p", "--specforge-site", str(tmp_path)])
    (tmp_path / "specforge-0.2.0.dist-info").mkdir()
    data = {"num_train": 40, "num_heldout": 4, "train_tokens": 4000, "hidden_dtype": "bfloat16", "plan_hash": "x",
            "last_state": {"state": "post-norm"}}
    run = {"setting": "bfloat16:ttt3", "trainer": "theirs", "rc": 0, "steps": 10, "tokens": 4000, "train_s": 2.0,
           "tokens_per_s": 2000.0, "steady_tokens_per_s": 2100.0, "peak_rss_mib": 900.0, "peak_anon_mib": 800.0,
           "first_loss": 9.0, "last_loss": 5.0, "heldout": {"loss": 4.0, "top1_step0": 0.3}}
    out = bench.report(args, tmp_path, data, [run])
    assert (out["kind"], out["peer"], out["versions"]["specforge"]) == ("trainer_compare", "specforge", "0.2.0")
    assert out["store"]["last_state"] == {"state": "post-norm"} and out["budget"] == {"epochs": 1}
    assert _json_kind(json.loads(json.dumps(out))) == "trainer_compare"
    entry = trainer_compare_entry(out)
    assert entry["peer"] == "specforge" and entry["runs"][0]["heldout"] == {"loss": 4.0, "top1_step0": 0.3}


# --------------------------------------------------------------------------- --method dflash


def dflash_args(*extra: str):
    args = bench.parse_args(["--features", "f", "--prepared", "p", "--method", "dflash", *extra])
    args.mask_token = 5  # main() sets it: compare_speculators' mask_token (our default rule)
    return args


def final(command: list[str], key: str) -> str:
    """The value a Hydra command line gives ``key`` (its last override wins)."""
    return [a for a in command if a.startswith(key + "=")][-1].partition("=")[2]


def test_the_store_converts_to_specforges_dflash_rows(store, tmp_path):
    prepared, features, target_dir = store
    info = bench.convert_store(features, prepared, tmp_path / "sf", target_dir, 64, eval_samples=3, method="dflash")
    ours = FeatureDataset(features)
    train, held = bench.cs.heldout_split(ours, 3, 0)
    assert info["ids"] == [ours.ids[i] for i in list(train) + list(held)] and info["left_out"] == []
    assert info["vocab_mapping"] is None and info["last_state"] == {"state": "unused"}  # data labels, whole vocab
    for split, rows in (("train", train), ("heldout", held)):
        for k, i in enumerate(rows):
            row, want = torch.load(bench.row_file(Path(info[f"{split}_dir"]), k), weights_only=True), ours[i]
            assert set(row) == {"input_ids", "loss_mask", "hidden_states"}  # SpecForge's DFlash feature keys
            assert torch.equal(row["input_ids"], want["input_ids"].long())
            assert torch.equal(row["loss_mask"], want["loss_mask"].long())  # unshifted: both count token a+j at a+j
            assert row["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(row["hidden_states"][0].float(), want["hidden_aux"])
    # an EAGLE-3 conversion of the same store is another format: not reused as DFlash rows
    again = bench.convert_store(features, prepared, tmp_path / "sf", target_dir, 64, eval_samples=3)
    assert again["method"] == "eagle3" and again["vocab_mapping"]


def test_rows_without_two_consecutive_answer_tokens_are_left_out_as_specforge_does():
    item = {"id": "x", "input_ids": torch.arange(6), "hidden_aux": torch.zeros(6, 12),
            "loss_mask": torch.tensor([0, 1, 0, 1, 0, 0])}
    assert bench.dflash_row(item) is None  # SpecForge's offline reader raises on it; its own prep filters it
    item["loss_mask"] = torch.tensor([0, 0, 0, 1, 1, 0])
    assert bench.dflash_row(item)["hidden_states"].shape == (1, 6, 12)


def test_dflash_settings_map_to_specforges_dflash_run_and_draft_config(store, tmp_path):
    _, _, target_dir = store
    args = dflash_args("--epochs", "2", "--max-tokens", "400", "--warmup-steps", "3")
    assert args.settings == ["bfloat16"] and bench.parse_setting(args.settings[0]) == ("bfloat16", 1)
    data = {"num_train": 40, "lengths": [100] * 44, "max_length": 100, "aux_layers": [1, 2, 3],
            "train_dir": "tr", "heldout_dir": "he", "vocab_mapping": None, "lm_head_key": "lm_head.weight"}
    cfg = bench.specforge_config(args, 1, data, tmp_path, "tgt", "draft.json")
    m, t = cfg["model"], cfg["training"]
    assert (t["strategy"], t["num_anchors"], t["loss_type"], t["loss_decay_gamma"]) == ("dflash", 32, "dflash", 4.0)
    assert m["mask_token_id"] == 5 and "vocab_mapping_path" not in m and "ttt_length" not in t
    assert t["batch_size"] == 4 and t["save_interval"] == t["eval_interval"] == 20 and "max_steps" not in t
    draft = bench.dflash_draft_config(target_dir, [1, 2, 3], args.block_size, args.mask_token)
    assert draft["architectures"] == ["DFlashDraftModel"] and draft["model_type"] == "qwen3"
    assert (draft["num_hidden_layers"], draft["layer_types"], draft["block_size"]) == (1, ["full_attention"], 8)
    assert draft["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 5}  # decoder-layer outputs
    assert draft["vocab_size"] == 256 and "draft_vocab_size" not in draft  # the whole vocabulary
    assert (draft["hidden_size"], draft["num_attention_heads"], draft["num_key_value_heads"], draft["head_dim"]) == (
        64, 4, 2, 16)
    # ours: one full-attention layer, block 8, 32 anchors a row, the mask token, SpecForge's data labels and loss
    ours = bench.cs.ours_command(args, "bfloat16", 1, tmp_path)
    assert {k: final(ours, k) for k in ("method", "method.num_layers", "method.block_size", "method.anchors",
                                        "method.mask_token_id", "method.labels", "method.loss", "method.gamma",
                                        "method.init_layer_from_target", "train.mixed_precision")} == {
        "method": "dflash", "method.num_layers": "1", "method.block_size": "8", "method.anchors": "32",
        "method.mask_token_id": "5", "method.labels": "data", "method.loss": "ce", "method.gamma": "4.0",
        "method.init_layer_from_target": "false", "train.mixed_precision": "bf16"}
    assert not any(a.startswith(("method.ttt_steps", "method.draft_vocab_size", "method.freeze_lm_head")) for a in ours)
    dpace = dflash_args("--loss", "dpace", "--max-tokens", "400", "--warmup-steps", "3")
    t = bench.specforge_config(dpace, 1, data, tmp_path, "tgt", "draft.json")["training"]
    assert (t["loss_type"], t["loss_decay_gamma"]) == ("dpace", None)
    assert final(bench.cs.ours_command(dpace, "bfloat16", 1, tmp_path), "method.loss") == "dpace"


def test_a_step_cap_stops_both_and_the_schedules_are_checked_first(tmp_path):
    data = {"num_train": 40, "lengths": [100] * 44, "max_length": 100, "aux_layers": [1, 2, 3],
            "train_dir": "tr", "heldout_dir": "he", "vocab_mapping": None, "lm_head_key": "lm_head.weight"}
    args = dflash_args("--max-tokens", "400", "--max-steps", "5", "--warmup-steps", "2")
    t = bench.specforge_config(args, 1, data, tmp_path, "tgt", "draft.json")["training"]
    assert t["max_steps"] == t["save_interval"] == t["eval_interval"] == 5 and int(t["warmup_ratio"] * 5) == 2
    ours = bench.cs.ours_command(args, "bfloat16", 1, tmp_path)
    assert final(ours, "train.max_steps") == "5" and final(ours, "data.epochs") == "null"  # data.epochs sets steps
    with pytest.raises(SystemExit, match="warm-up"):  # SpecForge's cosine would divide by zero
        bench.specforge_steps(dflash_args("--max-tokens", "400", "--max-steps", "5", "--warmup-steps", "5"), data)
    with pytest.raises(SystemExit, match="--max-steps 11"):  # one epoch is 10 steps
        bench.specforge_steps(dflash_args("--max-tokens", "400", "--max-steps", "11"), data)


@pytest.mark.parametrize("method, why", [("peagle", "flex attention"), ("dspark", "anchor \\+ k \\+ 1")])
def test_the_families_specforge_cannot_compare_are_refused_with_the_reason(method, why, capsys):
    assert sorted((*bench.METHODS, *bench.REFUSED)) == sorted(bench.cs.METHODS)  # each family compared or refused
    with pytest.raises(SystemExit):
        bench.parse_args(["--features", "f", "--prepared", "p", "--method", method])
    assert __import__("re").search(why, capsys.readouterr().err.replace("\n", " "))


def test_dflash_reports_specforges_accuracy_under_its_own_name(tmp_path):
    val = {"eval/avg_loss": 3.0, "eval/avg_acc": 0.2}
    assert bench.their_heldout(dflash_args(), val) == {"loss": 3.0, "top1_all_slots": 0.2}
    eagle3 = bench.parse_args(["--features", "f", "--prepared", "p"])
    assert bench.their_heldout(eagle3, val) == {"loss": 3.0, "top1_step0": 0.2}
    out = bench.report(dflash_args("--max-steps", "4"), tmp_path, None, [])
    assert out["method"] == "dflash" and out["budget"] == {"epochs": 1, "max_steps": 4}
    assert {k: out["settings"][k] for k in ("block_size", "anchors", "mask_token_id", "labels", "loss", "gamma")} == {
        "block_size": 8, "anchors": 32, "mask_token_id": 5, "labels": "data", "loss": "ce", "gamma": 4.0}


# --------------------------------------------------------------------------- against SpecForge itself (skipped without)


@pytest.fixture
def specforge(monkeypatch):
    """SpecForge 0.2 from ``SPECFORGE_SITE`` (a folder holding it, the script's --specforge-site) or the path."""
    import os

    if os.environ.get("SPECFORGE_SITE"):
        monkeypatch.syspath_prepend(os.environ["SPECFORGE_SITE"])
    return pytest.importorskip("specforge.config.schema", reason="SpecForge is not importable (set SPECFORGE_SITE)")


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_specforges_schema_accepts_the_run_configs(specforge, method, tmp_path):
    short = ["--max-tokens", "400", "--warmup-steps", "3"]  # 40 rows of 100 tokens: 10 steps
    args = dflash_args(*short) if method == "dflash" else bench.parse_args(["--features", "f", "--prepared", "p",
                                                                            *short])
    data = {"num_train": 40, "lengths": [100] * 44, "max_length": 100, "aux_layers": [1, 2, 3],
            "train_dir": "tr", "heldout_dir": "he", "vocab_mapping": "vm.pt", "lm_head_key": "lm_head.weight"}
    cfg = specforge.Config.model_validate(bench.specforge_config(args, 3, data, tmp_path, "tgt", "draft.json"))
    assert cfg.mode == "offline" and cfg.training.strategy == method
    if method == "dflash":
        assert (cfg.training.num_anchors, cfg.training.loss_type, cfg.model.mask_token_id) == (32, "dflash", 5)


def test_specforges_dflash_export_is_read_and_decoded_as_it_trained(specforge, store, tiny_target, tmp_path):
    """SpecForge builds its DFlash draft from our draft config and exports it (``specforge export --to hf``); our
    evaluator reads that folder as a DFlash head of the same settings whose states equal SpecForge's forward."""
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    from specheads.export.foreign import foreign_format, load_foreign_head
    from specheads.models.dflash import block_attention_mask

    _, _, target_dir = store
    draft_path = tmp_path / "draft_config.json"
    draft_path.write_text(json.dumps(bench.dflash_draft_config(target_dir, [1, 2, 3], 4, 5)))
    config = AutoDraftModelConfig.from_file(str(draft_path))
    config._attn_implementation = "sdpa"  # what its builder sets from training.attention_backend
    torch.manual_seed(0)
    theirs = AutoDraftModel.from_config(config).eval()
    for p in theirs.parameters():  # away from the init's ones and zeros, at the bf16 values its export writes
        p.data.add_(torch.randn_like(p) * 0.1)
        p.data.copy_(p.data.bfloat16().float())
    torch.save({"draft_state_dict": theirs.state_dict(), "strategy": "dflash"}, tmp_path / "training_state.pt")
    export_to_hf(str(tmp_path / "training_state.pt"), str(draft_path), str(tmp_path / "export"))
    assert foreign_format(tmp_path / "export") == "dflash"
    ours = load_foreign_head(tmp_path / "export", tiny_target).float().attach(tiny_target).eval()
    assert (ours.config.aux_layers, ours.block_size, ours.config.mask_token_id) == ([1, 2, 3], 4, 5)

    S, anchors = 12, torch.tensor([[3, 7]])
    aux = torch.randn(1, S, 3 * 64, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(2))
    block_ids = ours.block_inputs(ids.gather(1, anchors)).reshape(1, -1)
    block_pos = (anchors[:, :, None] + torch.arange(4)).reshape(1, -1)
    with torch.no_grad():
        want = theirs(position_ids=torch.cat([torch.arange(S)[None], block_pos], 1),
                      noise_embedding=tiny_target.raw_embedding(block_ids), target_hidden=aux,
                      attention_mask=create_dflash_sdpa_mask(anchors, torch.ones(1, 2, dtype=torch.bool), S, 4, "cpu"))
        cache = ours.extend_context(ours.new_cache(), ours.fuse(aux), torch.arange(S)[None])
        got = ours.norm(ours.decode(block_ids, block_pos, cache, block_attention_mask(anchors, 4, S)))
    torch.testing.assert_close(got, want)
