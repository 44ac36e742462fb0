"""scripts/peers/compare_speculators.py: our feature store, converted, reads back through speculators' own
dataset class as the same rows, tokens and hidden states (skipped where speculators is not importable)."""

from __future__ import annotations

import json
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


bench = load_script("scripts/peers/compare_speculators.py")
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
    train, held = bench.heldout_split(ours, 3, 0)
    assert sorted(info["ids"][n_train:]) == sorted(ours.ids[i] for i in held)
    assert info["ids"][:n_train] == [ours.ids[i] for i in train]
    # every row but the evaluator's chat slice, which neither trainer sees
    from specheads.evaluation.prompts import chat_heldout_ids

    assert sorted(info["ids"]) == sorted(set(ours.ids) - set(chat_heldout_ids(ours.ids)))

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


def test_an_equal_token_budget_sets_epochs_on_both_trainers_and_no_clock():
    args = bench.parse_args(["--features", "f", "--prepared", "p", "--epochs", "2", "--their-arg=--log-freq=5"])
    ours = bench.ours_command(args, "bfloat16", 1, Path("out"))
    assert "data.epochs=2" in ours and not any(a.startswith("train.max_minutes") for a in ours)
    data = {"data_path": "d", "hidden_states_path": "h", "aux_layers": [2, 15, 27], "train_data_ratio": 0.97}
    theirs = bench.theirs_flags(args, "bfloat16", 1, data, Path("out"))
    assert theirs[theirs.index("--epochs") + 1] == "2" and theirs[-1] == "--log-freq=5"
    # the time budget stays the default
    timed = bench.parse_args(["--features", "f", "--prepared", "p", "--minutes", "1.5"])
    assert "train.max_minutes=1.5" in bench.ours_command(timed, "float32", 3, Path("out"))
    assert bench.theirs_flags(timed, "float32", 3, data, Path("out"))[theirs.index("--epochs") + 1] == "1000"


DATA = {"data_path": "d", "hidden_states_path": "h", "aux_layers": [2, 15, 27], "train_data_ratio": 0.97,
        "num_train": 400, "train_tokens": 200000}  # rows of 500 tokens on average: about 4 per 2048-token batch


def _family(method: str, *extra: str):
    args = bench.parse_args(["--features", "f", "--prepared", "p", "--epochs", "1", "--method", method, *extra])
    args.mask_token = 7
    return args, bench.ours_command(args, "bfloat16", 1, Path("out")), bench.theirs_flags(args, "bfloat16", 1, DATA,
                                                                                          Path("out"))


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_p_eagle_both_trainers_train_one_architecture_the_evaluator_decodes():
    args, ours, theirs = _family("peagle", "--num-depths", "5")
    assert args.settings == ["bfloat16"] and bench.setting_label(args, "bfloat16", 1) == "bfloat16"
    assert {"method=peagle", "method.num_depths=5", "method.mask_token_id=7", "method.draft_vocab_size=4096",
            "method.freeze_lm_head=true", "method.num_layers=1"} <= set(ours)
    assert not any(a.startswith("method.ttt_steps") for a in ours)
    assert (_flag(theirs, "--speculator-type"), _flag(theirs, "--num-depths"), _flag(theirs, "--mask-token-id"),
            _flag(theirs, "--draft-vocab-size"), _flag(theirs, "--draft-arch"),
            _flag(theirs, "--full-attention-indices")) == ("peagle", "5", "7", "4096", "llama", "0")
    assert {"--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"} <= set(theirs)
    assert _flag(theirs, "--max-anchors") == "2048" and "--ttt-steps" not in theirs


def test_dflash_both_trainers_use_the_whole_vocabulary_d_pace_and_as_many_blocks_per_token():
    args, ours, theirs = _family("dflash", "--anchors", "16", "--block-size", "4")
    assert {"method=dflash", "method.block_size=4", "method.loss=dpace", "method.anchors=16",
            "method.mask_token_id=7", "method.num_layers=1"} <= set(ours)
    assert not any(a.startswith(("method.draft_vocab_size", "method.ttt_steps", "method.freeze")) for a in ours)
    assert "--draft-vocab-size" not in theirs and "--no-sample-from-anchor" in theirs
    assert (_flag(theirs, "--block-size"), _flag(theirs, "--per-position-loss-weight"), _flag(theirs, "--loss-fn"),
            _flag(theirs, "--full-attention-indices")) == ("4", "dpace", "ce", "0")
    # 16 blocks per 500-token row of ours: 16 x 2048 / 500 per packed 2048-token row of theirs
    assert _flag(theirs, "--max-anchors") == str(round(16 * 2048 / 500))


def test_dspark_adds_the_markov_and_confidence_heads_on_d_pace_cross_entropy_alone():
    _, ours, theirs = _family("dspark")
    assert {"method=dspark", "method.loss=dpace", "method.ce_weight=1.0", "method.l1_weight=0.0",
            "method.markov_rank=256", "method.enable_confidence_head=true", "method.anchors=32"} <= set(ours)
    assert "--draft-vocab-size" not in theirs and "--no-sample-from-anchor" in theirs
    assert (_flag(theirs, "--speculator-type"), _flag(theirs, "--loss-fn"), _flag(theirs, "--per-position-loss-weight"),
            _flag(theirs, "--markov-rank"), _flag(theirs, "--dflash-decay-gamma")) == ("dspark", "ce", "dpace", "256",
                                                                                       "1e9")
    assert {"--enable-confidence-head", "--confidence-head-with-markov"} <= set(theirs)


def test_a_family_without_ttt_steps_refuses_a_ttt_setting():
    with pytest.raises(SystemExit):
        bench.parse_args(["--features", "f", "--prepared", "p", "--method", "dflash", "--settings", "bfloat16:3"])
    assert bench.parse_args(["--features", "f", "--prepared", "p"]).settings == ["float32:3", "bfloat16:3"]


@pytest.mark.skipif(MISSING is not None, reason=f"speculators not importable: {MISSING}")
@pytest.mark.parametrize("method", ["peagle", "dflash", "dspark"])
def test_speculators_reads_the_family_flags_as_the_architecture_ours_trains(method):
    from speculators.train.config import TrainConfig

    _, _, theirs = _family(method)
    config = TrainConfig.resolve(theirs).model_dump()
    draft = config["draft"]
    assert (config["speculator_type"], draft["num_layers"], draft["full_attention_indices"], draft["mask_token_id"]) \
        == (method, 1, [0], 7)
    if method == "peagle":
        assert draft["draft_arch"] == "llama" and draft["draft_vocab_size"] == 4096
        assert not (draft["norm_before_residual"] or draft["norm_before_fc"] or draft["norm_output"])
    else:
        assert draft["draft_vocab_size"] is None and config["dflash"]["block_size"] == 8
        assert config["dflash"]["per_position_loss_weight"] == "dpace"
        assert config["loss"]["loss_fn"] == "ce"


def test_both_heads_are_evaluated_on_the_main_jobs_prompts_in_the_same_shapes():
    from omegaconf import OmegaConf

    args = bench.parse_args(["--features", "f", "--prepared", "prep", "--eval-arg", "threads=1"])
    ours = bench.eval_command(args, "/runs/ours", Path("e1"))
    theirs = bench.eval_command(args, "/runs/theirs/checkpoints/0", Path("e2"))
    assert [a for a in ours if not a.startswith(("head_dir=", "output_dir="))] == \
        [a for a in theirs if not a.startswith(("head_dir=", "output_dir="))]
    stage = [str(o) for o in OmegaConf.load(REPO / "conf" / "pipeline.yaml").stages.evaluate]
    prompts = [o for o in stage if o.startswith("eval.") and not o.startswith("eval.max_minutes")]
    assert prompts and all(o in ours for o in prompts)  # the main job's prompt set ...
    assert "eval.max_minutes=null" in ours and "temperatures=[0.0]" in ours  # ... all of it, greedy,
    assert "target.dtype=float32" in ours  # at one precision for both (no timed probe)
    assert "head_shape=tree" in ours and "serving.engines=[vllm]" in ours and ours[-1] == "threads=1"
    assert f"eval.chat_dir={Path('prep').resolve()}" in ours

    report = {"num_prompts": 12, "max_new_tokens": 32, "target_dtype": "torch.float32", "methods": [
        {"name": "eagle3-tree", "shape": "tree(d5,k4,n24)", "lossless": {"exact": True},
         "by_temperature": {"0.0": {"code": {"alpha": 0.6, "tau": 2.2, "prompts": 2, "tokens_per_s": 9.0},
                                    "all": {"alpha": 0.5, "tau": 1.9, "prompts": 12}}}}]}
    got = bench.acceptance(report)
    assert got == {"prompts": 12, "max_new_tokens": 32, "target_dtype": "float32", "methods": [
        {"name": "eagle3-tree", "shape": "tree(d5,k4,n24)", "lossless": True,
         "domains": {"code": {"alpha": 0.6, "tau": 2.2, "prompts": 2}, "all": {"alpha": 0.5, "tau": 1.9, "prompts": 12}}}]}


@pytest.mark.slow
def test_our_trainer_alone_trains_one_epoch_of_the_training_rows_and_reports_for_the_record(tmp_path, monkeypatch):
    """``--only ours --epochs 1`` (speculators not needed): every training token once, the JSON a record."""
    from specheads.record import Checkout, record
    from specheads.targets import load_target
    from specheads.targets.model import default_eagle3_layers
    from tests.training.engine_helpers import word_level_target

    model_dir, prepared = word_level_target(tmp_path, layers=4)
    store = tmp_path / "features"
    collect_hidden_states(load_target(str(model_dir)), load_prepared(prepared)[0],
                          FeatureSpec(default_eagle3_layers(4), True), store,
                          CollectOptions(dtype="float32", estimate_time=False, check_disk=False))
    out = tmp_path / "report.json"
    bench.main(["--features", str(store), "--prepared", str(prepared), "--target", str(model_dir), "--only", "ours",
                "--epochs", "1", "--settings", "float32:1", "--draft-vocab-size", "64", "--max-tokens", "256",
                "--eval-samples", "4", "--warmup-steps", "1", "--threads", "1", "--workdir", str(tmp_path / "work"),
                "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["kind"] == "speculators_compare" and report["budget"] == {"epochs": 1}
    [run] = report["runs"]
    assert run["rc"] == 0 and run["trainer"] == "ours" and "data.epochs=1" in run["command"]
    ours = FeatureDataset(store)
    train_idx, _ = bench.heldout_split(ours, 4, 0)
    assert run["tokens"] == sum(ours[i]["input_ids"].numel() for i in train_idx)  # each training token once
    assert run["heldout"]["top1_step0"] is not None and Path(run["head_dir"], "head", "config.json").exists()
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps({"runs": []}))
    entry = record(out, results, Checkout(commit="0" * 40, dirty=False))
    assert entry["kind"] == "trainer_compare" and entry["peer"] == "speculators"
    assert entry["runs"][0]["tokens"] == run["tokens"]

    # --reuse: the same runs evaluated again, nothing trained; the report keeps the first call's settings
    seen = []
    figures = {"prompts": 12, "max_new_tokens": 32, "target_dtype": "float32", "methods": []}
    monkeypatch.setattr(bench, "run_eval", lambda args, r, root: seen.append((r["head_dir"], root)) or figures)
    again = tmp_path / "again.json"
    bench.main(["--reuse", str(out), "--json", str(again)])
    second = json.loads(again.read_text())
    assert seen == [(run["head_dir"], tmp_path / "work")] and second["runs"][0]["eval"] == figures
    assert second["budget"] == {"epochs": 1} and second["runs"][0]["steps"] == run["steps"]



def test_served_heads_ours_exported_for_vllm_theirs_given_as_written(tmp_path, monkeypatch):
    """--serve: our head goes through `specheads export engine=vllm`, theirs is handed to serve-eval as its trainer
    wrote it; both beside the evaluation report of the same head, on the same prompts, with the engine's figures
    read back per domain."""
    args = bench.parse_args(["--features", "f", "--prepared", "prep", "--serve"])
    assert args.serve and not args.evaluate  # evaluation runs first only for a head without one (finish)
    commands = []

    def measure(cmd, env, log_path, interval=0.2):
        commands.append(cmd)
        out = next((a.split("=", 1)[1] for a in cmd if a.startswith("output_dir=")), None)
        if "serve-eval" in cmd:
            Path(out).mkdir(parents=True)
            Path(out, "serve_report.json").write_text(json.dumps({
                "num_prompts": 2, "engine": {"version": "0.32.0"}, "head_source": "speculators",
                "domains": {"all": {"spec": {"tau": 1.5, "reach": [0.4, 0.1, 0.0]}, "identical": 2, "compared": 2,
                                    "speedup": 1.1}},
                "evaluator": {"domains": {"all": {"tau_evaluator": 1.45}}}}))
        return {"rc": 0, "wall_s": 1.0}

    monkeypatch.setattr(bench, "measure", measure)
    (tmp_path / "eval-ours-bfloat16-ttt1").mkdir()
    (tmp_path / "eval-ours-bfloat16-ttt1" / "report.json").write_text("{}")
    ours = bench.run_serve(args, {"trainer": "ours", "setting": "bfloat16:ttt1", "head_dir": "/runs/ours"}, tmp_path)
    export, serve = commands
    assert "export" in export and "engine=vllm" in export and "head_dir=/runs/ours" in export
    assert f"export_dir={tmp_path / 'export-ours-bfloat16-ttt1'}" in serve and "num_speculative_tokens=3" in serve
    assert f"eval_report={tmp_path / 'eval-ours-bfloat16-ttt1' / 'report.json'}" in serve
    assert ours["domains"]["all"] == {"tau": 1.5, "reach": [0.4, 0.1, 0.0], "identical": 2, "compared": 2,
                                      "speedup": 1.1, "tau_evaluator": 1.45}
    assert ours["engine"] == "0.32.0" and ours["prompts"] == 2
    ours_serve = serve
    commands.clear()
    theirs = bench.run_serve(args, {"trainer": "theirs", "setting": "bfloat16:ttt1",
                                    "head_dir": "/runs/theirs/checkpoints/0"}, tmp_path)
    (serve,) = commands  # no export: their folder as written, and no evaluation report beside it here
    assert "export_dir=/runs/theirs/checkpoints/0" in serve and not any(a.startswith("eval_report=") for a in serve)
    assert [a for a in serve if not a.startswith(("export_dir=", "output_dir=", "eval_report="))] == \
        [a for a in ours_serve if not a.startswith(("export_dir=", "output_dir=", "eval_report="))]
    assert theirs["head_source"] == "speculators"
    # reusing an earlier report with --serve alone keeps its evaluations; --reuse alone evaluates again
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "trainer_compare", "peer": "speculators", "workdir": str(tmp_path),
                               "args": vars(bench.parse_args(["--features", "f", "--prepared", "prep"])), "runs": []}))
    assert not bench.reused(bench.parse_args(["--reuse", str(old), "--serve"]))[0].evaluate
    assert bench.reused(bench.parse_args(["--reuse", str(old)]))[0].evaluate
