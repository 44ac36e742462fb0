"""recipes/train.py end to end on the real Hydra configs, a tiny Llama folder and a prepared set."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from specheads.evaluation.prompts import chat_heldout_ids

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def load_recipe():
    spec = importlib.util.spec_from_file_location("train_recipe", REPO / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_recipe"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tiny Llama folder with a word-level tokenizer, prepared folder tokenized 'by' it)."""
    from engine_helpers import word_level_target

    return word_level_target(tmp_path_factory.mktemp("train_recipe"), layers=2)


def compose(*overrides: str):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    load_recipe()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hcompose("train", overrides=list(overrides))


def base(model_dir, prepared, out) -> list[str]:
    return [f"target.name_or_path={model_dir}", "target.dtype=float32", f"prepared_dir={prepared}",
            f"output_dir={out}", "data.max_tokens=256", "data.eval_samples=8", "train.max_steps=3",
            "train.eval_every=2", "train.save_every=2", "train.progress=false", "wandb.mode=disabled"]


@pytest.mark.parametrize("method", ["medusa1", "medusa2"])
def test_recipe_trains_each_medusa_method(setup, tmp_path, method):
    model_dir, prepared = setup
    extra = ["method.num_heads=2"] + (["method.lora_r=4", "method.heads_warmup_steps=1"] if method == "medusa2" else [])
    cfg = compose(*base(model_dir, prepared, tmp_path), f"method={method}", *extra)
    summary = load_recipe().run(cfg)
    assert summary["steps"] == 3 and summary["method"] == method
    written = json.loads((tmp_path / "train_summary.json").read_text())
    from specheads.acceptance_math import estimate_tau

    # the τ written is the one the held-out accuracies written beside it imply
    assert written["tau_estimate"] == pytest.approx(estimate_tau(written["eval"])[0]) and "head1_top1_acc" in written["eval"]
    # Bigram baselines from the same split, written beside the head's accuracy.
    assert set(written["baselines"]) == {"bigram_d1_acc", "bigram_d2_acc", "bigram_d3_acc"}
    from specheads.data.features import TokenDataset
    from specheads.data.prepare import load_prepared
    from specheads.training.baselines import bigram_report

    td = TokenDataset(load_prepared(prepared)[0])
    ids = [str(x) for x in td.dataset["id"]]
    held = [ids.index(x) for x in written["heldout_split"]["heldout_ids"]]
    slice_rows = {ids.index(x) for x in chat_heldout_ids(ids)}
    train_rows = [i for i in range(len(ids)) if i not in set(held) | slice_rows]
    assert written["baselines"] == bigram_report(td, train_rows, held)  # fitted and scored on the split recorded
    assert written["beats_bigram"] == (written["eval"]["head0_top1_acc"] > written["baselines"]["bigram_d1_acc"])
    assert (tmp_path / "head" / "config.json").exists() and (tmp_path / "checkpoints" / "step_0000003").is_dir()
    # How the rows were split (the evaluator checks it before its shape choice reads held-out acceptance):
    # 40 rows, 4 held out, the evaluator's chat slice (1 chat of 40) neither trained on nor held out.
    split = written["heldout_split"]
    assert (split["rows"], split["heldout_rows"], split["evaluation_rows_left_out"], split["train_rows"]) == (40, 4, 1, 35)
    assert split["heldout_excludes_evaluation"] and len(split["heldout_ids"]) == 4 and split["dedup"] is None
    if method == "medusa2":
        assert (tmp_path / "head" / "target" / "config.json").exists()
        assert summary["eval"]["drift_kl"] > 0  # three steps moved the adapted target


def test_recipe_logs_to_offline_wandb_and_resumes_finished_run(setup, tmp_path):
    model_dir, prepared = setup
    args = base(model_dir, prepared, tmp_path) + ["wandb.mode=offline", "method.num_heads=1"]
    first = load_recipe().run(compose(*args))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    again = load_recipe().run(compose(*args))  # everything done: resumes at the last step and re-saves
    assert again["resumed_from"].endswith("step_0000003") and again["steps"] == first["steps"]


def test_config_typos_and_offline_medusa2_are_refused(setup, tmp_path):
    model_dir, prepared = setup
    with pytest.raises(Exception, match="max_stepz"):
        compose(*base(model_dir, prepared, tmp_path), "train.max_stepz=3")
    with pytest.raises(Exception, match="num_heads"):
        compose(*base(model_dir, prepared, tmp_path), "method.num_heads=five")
    cfg = compose(*base(model_dir, prepared, tmp_path), "method=medusa2", f"features_dir={tmp_path}")
    with pytest.raises(ValueError, match="online features"):
        load_recipe().run(cfg)


def test_launcher_files_are_valid_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    for name in ("accelerate", "deepspeed_zero2", "deepspeed_zero3"):
        c = load_config_from_file(str(REPO / "conf" / "launcher" / f"{name}.yaml"))
        assert c.distributed_type.value in ("MULTI_GPU", "DEEPSPEED")
        if name.startswith("deepspeed"):
            assert c.deepspeed_config["zero_stage"] == int(name[-1])


def test_recipe_reads_an_offline_feature_store(setup, tmp_path):
    from specheads.data.features import CollectOptions, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.targets import load_target
    from specheads.methods.base import FeatureSpec

    model_dir, prepared = setup
    store = tmp_path / "features"
    collect_hidden_states(load_target(str(model_dir)), load_prepared(prepared)[0], FeatureSpec(need_last=True),
                          store, CollectOptions(dtype="float32", estimate_time=False, check_disk=False))
    out = tmp_path / "run"
    cfg = compose(*base(model_dir, prepared, out), f"features_dir={store}", "method.num_heads=2",
                  "optim.warmup_steps=0", "optim.lr=0.01")
    summary = load_recipe().run(cfg)
    from specheads.acceptance_math import estimate_tau

    assert summary["steps"] == 3 and summary["tau_estimate"] == pytest.approx(estimate_tau(summary["eval"])[0])
    # The store's token rows (features unread) are the prepared rows they were collected from.
    from specheads.data.features import FeatureDataset, TokenDataset
    from specheads.training.baselines import bigram_report
    from specheads.training.batches import split_rows

    fd, td = FeatureDataset(store), TokenDataset(load_prepared(prepared)[0])
    where = {str(i): k for k, i in enumerate(td.dataset["id"])}
    tr, held = load_recipe().keep_chat_heldout_out(fd, *split_rows(len(fd), min(8, len(fd) // 10), 0))
    as_prepared = bigram_report(td, [where[fd.ids[i]] for i in tr], [where[fd.ids[i]] for i in held])
    assert summary["baselines"] == as_prepared
    assert fd.token_rows(held)[0] == td.token_rows([where[fd.ids[i]] for i in held])[0]


def test_the_evaluators_chat_slice_is_never_trained_on():
    from engine_helpers import token_dataset
    from specheads.evaluation.prompts import chat_heldout_ids

    ds = token_dataset(250)  # ids s0..s249: the last 1% as sorted strings is 3 rows
    held_ids = chat_heldout_ids([f"s{i}" for i in range(250)])
    assert held_ids == {"s97", "s98", "s99"}
    rows = [int(i[1:]) for i in held_ids]
    train_idx, eval_idx = load_recipe().keep_chat_heldout_out(ds, list(range(240)), list(range(240, 250)))
    # neither trained on nor held out: no measurement before scoring (the shape choice's) reads them
    assert not set(rows) & (set(train_idx) | set(eval_idx))
    assert len(train_idx) == 237 and eval_idx == list(range(240, 250))
    # a held-out row of the slice (the random split drew it) is left out too
    train_idx, eval_idx = load_recipe().keep_chat_heldout_out(ds, list(range(1, 250)), [0, rows[0]])
    assert eval_idx == [0] and len(train_idx) == 250 - 1 - 3


def test_recipe_caps_the_onednn_primitive_cache_before_training(setup, tmp_path, monkeypatch):
    from specheads.training.accelerator import limit_onednn_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    model_dir, prepared = setup
    args = base(model_dir, prepared, tmp_path) + ["method.num_heads=1"]
    load_recipe().run(compose(*args))  # null: oneDNN's own default stays
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    load_recipe().run(compose(*args, "train.onednn_cache=32", f"output_dir={tmp_path / 'capped'}"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    with pytest.raises(ValueError, match="onednn_cache"):
        limit_onednn_cache(-1)


def test_a_chats_per_turn_samples_stay_on_one_side_of_the_split():
    import datasets

    from engine_helpers import progression_rows
    from specheads.data.features import TokenDataset
    from specheads.evaluation.prompts import chat_heldout_ids

    rows = progression_rows(300)
    rows["id"] = [f"c{i // 3:03d}@turn{2 * (i % 3) + 1}" for i in range(300)]  # 100 chats, 3 samples each
    ds = TokenDataset(datasets.Dataset.from_dict(rows))
    assert chat_heldout_ids(rows["id"]) == {"c099@turn1", "c099@turn3", "c099@turn5"}  # 1% of the chats, whole
    train_idx, eval_idx = load_recipe().keep_chat_heldout_out(ds, [i for i in range(300) if i != 4], [4])
    assert eval_idx == [3, 4, 5]  # chat c001 (row 4 held out); the evaluator's c099 is neither trained on nor held out
    assert not set(train_idx) & {3, 4, 5, 297, 298, 299} and len(train_idx) == 294


def test_a_store_of_part_of_a_prepared_set_leaves_the_prepared_sets_chat_slice_out(setup, tmp_path):
    """``specheads run`` trains on a store collected within a time budget (part of the prepared rows) and names
    the prepared set too (``prepared_dir``): the chat slice left out is the evaluator's, the last 1% of the
    *prepared* set's chats, not of the store's rows; a held-out row of that slice would make the evaluator
    refuse the head's measured acceptance (its shape choice reads it)."""
    from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.evaluation.prompts import chat_heldout_ids
    from specheads.methods.base import FeatureSpec
    from specheads.targets import load_target

    model_dir, prepared = setup
    ds = load_prepared(prepared)[0]
    all_ids = [str(x) for x in ds["id"]]
    sliced = chat_heldout_ids(all_ids)
    keep = [i for i, x in enumerate(all_ids) if x not in sliced][: len(all_ids) // 2] + \
        [i for i, x in enumerate(all_ids) if x in sliced]  # half the rows, the prepared slice among them
    store = tmp_path / "features"
    collect_hidden_states(load_target(str(model_dir)), ds.select(keep), FeatureSpec(need_last=True), store,
                          CollectOptions(dtype="float32", estimate_time=False, check_disk=False))
    fd = FeatureDataset(store)
    assert len(fd) < len(all_ids)
    recipe = load_recipe()
    cfg = compose(*base(model_dir, prepared, tmp_path / "run"), f"features_dir={store}")
    assert sorted(recipe._prepared_ids(cfg, fd)) == sorted(all_ids)
    rows = [i for i, x in enumerate(fd.ids) if x in sliced]
    train_idx, eval_idx = recipe.keep_chat_heldout_out(fd, list(range(len(fd))), rows,
                                                       recipe._prepared_ids(cfg, fd))
    assert rows and not set(rows) & (set(train_idx) | set(eval_idx))
