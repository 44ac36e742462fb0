"""What `specheads train` refuses before the target loads, in-process: a checkpoint of a run with other settings, a
corrupt checkpoint (passed over for an intact one where there is one), missing or wrong data folders, a feature
store of another target, counts out of range. The one-line CLI form of these is in tests/test_cli_errors.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from specheads.errors import ConfigError, InputNotFoundError, UserError
from specheads.training.checkpoint import (CheckpointError, CheckpointMismatchError, CorruptCheckpointError,
                                           check_resume_settings, load_checkpoint, resume_checkpoint, save_checkpoint)
from specheads.training.config import (OptimConfig, TrainConfig, check_data_source, check_settings,
                                       check_store_source)

SETTINGS = {"method": {"name": "medusa1", "num_heads": 5, "aux_layers": None}, "target": {"name_or_path": "org/x"}}


def _accelerator(features: int = 4):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(features, 3), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()))
    return acc


def _save(root: Path, step: int, settings=SETTINGS, features: int = 4) -> Path:
    return save_checkpoint(_accelerator(features), root, step, {"settings": settings} if settings else {})


def _truncate(folder: Path) -> None:
    victim = folder / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-10])


# --------------------------------------------------------------------------- a run with other settings


def test_a_checkpoint_of_other_method_settings_is_refused_by_name(tmp_path):
    folder = _save(tmp_path, 2)
    other = {**SETTINGS, "method": {**SETTINGS["method"], "num_heads": 3}}
    with pytest.raises(CheckpointMismatchError) as e:
        check_resume_settings(folder, other, "output_dir=runs/m1")
    assert isinstance(e.value, UserError)
    assert str(e.value).startswith("output_dir=runs/m1: checkpoint step_0000002 was written by a run with other "
                                   "settings (method.num_heads=5 there, 3 now)")
    assert "give a new output_dir, or train.resume=never" in str(e.value)
    renamed = {**SETTINGS, "method": {**SETTINGS["method"], "name": "eagle3"}}
    with pytest.raises(CheckpointMismatchError, match="method.name=medusa1 there, eagle3 now"):
        check_resume_settings(folder, renamed, "output_dir=runs/m1")


def test_the_same_settings_a_setting_only_one_side_has_and_an_older_checkpoint_pass(tmp_path, monkeypatch):
    folder = _save(tmp_path / "a", 2)
    check_resume_settings(folder, SETTINGS, "output_dir=a")
    newer = {**SETTINGS, "method": {**SETTINGS["method"], "new_option": 1}}  # a setting a newer specheads added
    check_resume_settings(folder, newer, "output_dir=a")
    check_resume_settings(_save(tmp_path / "b", 2, settings=None), newer, "output_dir=b")  # nothing recorded
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    by_path = {**SETTINGS, "target": {"name_or_path": str(tmp_path / "model")}}
    check_resume_settings(_save(tmp_path / "c", 2, settings=by_path), {**SETTINGS, "target": {"name_or_path": "model"}},
                          "output_dir=c")  # a relative and an absolute path to the same folder


def test_an_older_checkpoint_of_other_shapes_is_refused_at_load_as_a_user_error(tmp_path):
    """A checkpoint written before the settings were recorded: the shapes are compared at load, before accelerate
    fails on a size mismatch with a traceback."""
    folder = _save(tmp_path, 2, settings=None, features=4)
    with pytest.raises(CheckpointMismatchError, match=r"holds 'weight' of shape \[3, 4\], the module this run built "
                                                      r"has \[3, 6\].*train.resume=never"):
        load_checkpoint(_accelerator(features=6), folder)


def test_the_engine_records_the_settings_and_refuses_a_resume_with_others(tmp_path):
    from engine_helpers import sources

    from specheads.methods.medusa import Medusa1Method
    from specheads.training.engine import train
    from tests.conftest import make_tiny_target

    def cfg(heads):
        return TrainConfig(output_dir=str(tmp_path), max_steps=1, save_every=1, eval_every=0, wandb_mode="disabled",
                           progress=False, measure_prompts=0, settings={"method": {"num_heads": heads}})

    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256)
    train(Medusa1Method(num_heads=2), target, sources()[0], cfg(2), OptimConfig())
    state = json.loads((tmp_path / "checkpoints" / "step_0000001" / "trainer_state.json").read_text())
    assert state["settings"] == {"method": {"num_heads": 2}}
    with pytest.raises(CheckpointMismatchError, match="method.num_heads=2 there, 3 now"):
        train(Medusa1Method(num_heads=3), target, sources()[0], cfg(3), OptimConfig())


# --------------------------------------------------------------------------- a corrupt checkpoint


def test_auto_passes_over_a_corrupt_newest_checkpoint_with_a_warning(tmp_path, caplog):
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    _truncate(newest)
    with caplog.at_level(logging.WARNING, logger="specheads.training.checkpoint"):
        assert resume_checkpoint(tmp_path, "auto") == older
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"corrupt checkpoint {newest}: model.safetensors has" in warned and "resuming from step_0000002" in warned
    assert newest.is_dir()  # left as it is, never deleted
    assert resume_checkpoint(tmp_path, "never") is None
    assert resume_checkpoint(tmp_path / "none", "auto") is None


def test_no_intact_checkpoint_or_a_corrupt_one_named_is_a_user_error_naming_the_file(tmp_path):
    folder = _save(tmp_path, 2)
    _truncate(folder)
    with pytest.raises(CorruptCheckpointError) as e:
        resume_checkpoint(tmp_path, "auto")
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert f"corrupt checkpoint {folder}: model.safetensors has" in str(e.value)
    assert "no earlier checkpoint" in str(e.value) and "train.resume=never" in str(e.value)
    with pytest.raises(CorruptCheckpointError, match=rf"train.resume={folder}: corrupt checkpoint .*train.resume=auto"):
        resume_checkpoint(tmp_path, str(folder))
    with pytest.raises(InputNotFoundError, match="no such checkpoint folder"):
        resume_checkpoint(tmp_path, str(tmp_path / "step_0000009"))
    assert folder.is_dir()


def test_a_failed_background_write_keeps_its_traceback():
    """Only what is wrong with a checkpoint on disk is a user error; a failed write (a full disk, a bug) is not."""
    assert not issubclass(CheckpointError, UserError)
    assert issubclass(CorruptCheckpointError, CheckpointError) and issubclass(CheckpointMismatchError, CheckpointError)


# --------------------------------------------------------------------------- data folders, before the target loads


def test_data_folders_are_checked_before_the_target_loads(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [(None, str(tmp_path / "nope"), "prepared_dir=.*nope: no such folder"),
             (None, str(tmp_path / "a_file"), "prepared_dir=.*a_file is a file"),
             (None, str(tmp_path / "empty"), "prepared_dir=.*empty holds no prepared set"),
             (str(tmp_path / "nope"), str(tmp_path / "empty"), "features_dir=.*nope: no such folder")]
    for features, prepared, message in cases:
        with pytest.raises(InputNotFoundError, match=message):
            check_data_source(features, prepared)
    with pytest.raises(ConfigError, match="no training data"):
        check_data_source(None, None)


def test_a_store_of_another_targets_size_is_refused_from_its_manifest(tmp_path):
    from transformers import LlamaConfig

    from specheads.data.store import MANIFEST, STORE_FORMAT, StoreMismatchError

    (tmp_path / MANIFEST).write_text(json.dumps({"format": STORE_FORMAT, "target": "small", "hidden_size": 32,
                                                 "num_layers": 2, "shards": []}))
    with pytest.raises(StoreMismatchError) as e:
        check_store_source(str(tmp_path), None, None, LlamaConfig(hidden_size=64, num_hidden_layers=4), "big")
    assert isinstance(e.value, UserError)
    assert "collected from target 'small' (hidden size 32, 2 layers), not from target.name_or_path=big" in str(e.value)
    check_store_source(str(tmp_path), None, None, LlamaConfig(hidden_size=32, num_hidden_layers=2), "small")


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize("setting, value, ok", [
    ("keep_checkpoints", 0, True), ("keep_checkpoints", -1, False),  # 0 keeps all
    ("save_every", 0, True), ("save_every", -1, False),  # 0: only after the last step
    ("log_every", 1, True), ("log_every", 0, False), ("log_every", -1, False),  # 0 was every step, as 1
])
def test_checkpoint_and_log_counts(tmp_path, setting, value, ok):
    cfg = TrainConfig(output_dir=str(tmp_path), **{setting: value})
    if ok:
        check_settings(cfg, OptimConfig(), {}, {})
        return
    with pytest.raises(ConfigError, match=rf"^train.{setting}={value} is out of range"):
        check_settings(cfg, OptimConfig(), {}, {})


@pytest.mark.parametrize("where, setting, value", [
    ("train", "max_steps", 2.5), ("train", "grad_accum", 1.5), ("train", "keep_checkpoints", 2.0),
    ("train", "measure_k", 3.5), ("data", "batch_size", 2.5), ("data", "max_length", 32.5),
    ("data", "pad_to_multiple_of", 8.0), ("method", "num_heads", 4.5), ("method", "ttt_steps", 2.5),
    ("method", "block_size", 16.0),
])
def test_a_float_count_is_refused_in_one_line_naming_it(tmp_path, where, setting, value):
    """Counts that feed range(), slices or tensor sizes (a 2.5-step run never reached its last step's save)."""
    parts = {"train": TrainConfig(output_dir=str(tmp_path)), "optim": OptimConfig(), "method": {}, "data": {}}
    if where == "train":
        setattr(parts["train"], setting, value)
    else:
        parts[where][setting] = value
    with pytest.raises(ConfigError) as e:
        check_settings(parts["train"], parts["optim"], parts["method"], parts["data"])
    said = str(e.value)
    assert said.startswith(f"{where}.{setting}={value} is out of range: give an integer >= ") and "\n" not in said


def test_counts_that_only_meet_comparisons_still_take_a_float(tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path), log_every=2.5, measure_tokens=16.5)
    check_settings(cfg, OptimConfig(warmup_steps=2.5), {"heads_warmup_steps": 1.5}, {"max_tokens": 512.5})


@pytest.mark.parametrize("setting, value", [("lr", float("inf")), ("lr", float("nan")), ("eps", float("inf")),
                                            ("weight_decay", float("inf"))])
def test_a_non_finite_number_is_refused(tmp_path, setting, value):
    """inf passed the old check (inf > 0); nan never did (nan > 0 is False)."""
    with pytest.raises(ConfigError, match=rf"^optim\.{setting}={value} is out of range: give a finite number "):
        check_settings(TrainConfig(output_dir=str(tmp_path)), OptimConfig(**{setting: value}), {}, {})


def test_a_beta_and_a_ratio_keep_their_intervals(tmp_path):
    train = TrainConfig(output_dir=str(tmp_path))
    check_settings(train, OptimConfig(betas=(0.0, 0.999), min_lr_ratio=1.0), {"offpath_weight": 0.0}, {})
    with pytest.raises(ConfigError, match=r"^optim\.betas=1\.0 is out of range: give a finite number in \[0, 1\)$"):
        check_settings(train, OptimConfig(betas=(0.9, 1.0)), {}, {})
    with pytest.raises(ConfigError, match=r"^method\.lk_weight=1\.5 is out of range: give a finite number in \[0, 1\]"):
        check_settings(train, OptimConfig(), {"lk_weight": 1.5}, {})
