"""User errors end a stage with one clean line; every other exception keeps its traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.errors import ConfigError, InputNotFoundError, UserError, user_errors

ROOT = Path(__file__).resolve().parents[1]


def test_a_user_error_is_one_line_and_exit_status_2(capsys, monkeypatch):
    monkeypatch.delenv("SPECHEADS_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        with user_errors("train"):
            raise ConfigError("optim.lr must be positive, got -1\nset optim.lr=1e-4")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("specheads train: error: optim.lr must be positive, got -1; "
                                       "set optim.lr=1e-4\n")


@pytest.mark.parametrize("bug", [ValueError("shapes (2, 3) and (4,) differ"), OSError("errno 5"),
                                 FileNotFoundError("/tmp/internal.cache"), KeyError("k"), RuntimeError("x")])
def test_anything_else_keeps_its_traceback(bug, capsys):
    with pytest.raises(type(bug)) as e:
        with user_errors("train"):
            raise bug
    assert e.value is bug and capsys.readouterr().err == ""


def test_specheads_traceback_shows_the_stack_of_a_user_error(monkeypatch):
    monkeypatch.setenv("SPECHEADS_TRACEBACK", "1")
    with pytest.raises(InputNotFoundError):
        with user_errors("prepare"):
            raise InputNotFoundError("runs/x/prepared is not a prepared dataset")


def test_user_error_types_keep_their_builtin_bases():
    from specheads.data.prepare import DataMismatchError, PrepareError
    from specheads.data.regenerate import JournalError
    from specheads.data.render import TemplateError, ToolTurnError
    from specheads.data.sources import SourceError
    from specheads.data.store import CorruptShardError, StoreError
    from specheads.methods import MethodSettingsError

    for cls, base in [(SourceError, ValueError), (TemplateError, ValueError), (ToolTurnError, TemplateError),
                      (DataMismatchError, ValueError), (PrepareError, ValueError), (JournalError, ValueError),
                      (CorruptShardError, StoreError), (MethodSettingsError, TypeError),
                      (InputNotFoundError, FileNotFoundError), (ConfigError, ValueError)]:
        assert issubclass(cls, UserError) and issubclass(cls, base), cls


def test_method_settings_are_user_errors():
    from specheads.methods import build_method

    for name, kw in [("medusa9", {}), ("medusa1", {"num_headz": 2}), ("medusa1", {"labels": "oracle"}),
                     ("eagle3", {"ttt_steps": 0})]:
        with pytest.raises(UserError):
            build_method(name, **kw)


# --------------------------------------------------------------------------- end to end, as a user meets them


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama saved with a word-level tokenizer, and a prepared folder tokenized 'by' it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specheads.targets import tokenizer_fingerprint
    from tests.conftest import make_tiny_model
    from tests.data.test_features import make_prepared

    root = tmp_path_factory.mktemp("errors")
    model_dir = root / "tiny-llama"
    make_tiny_model("llama", layers=2).save_pretrained(model_dir)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)},
                                                                              unk_token="w0")),
                                  unk_token="w0", eos_token="w1")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(model_dir)
    return model_dir, make_prepared(root, n=30, fingerprint=tokenizer_fingerprint(tok))


def specheads(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "specheads.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def assert_one_clean_line(proc: subprocess.CompletedProcess, stage: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"specheads {stage}: error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_corrupt_feature_shard_is_one_line_naming_the_file_and_the_fix(tiny_model_dir, tmp_path):
    from specheads.data.features import CollectOptions, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.methods.base import FeatureSpec
    from specheads.targets import load_target

    model_dir, prepared = tiny_model_dir
    store = tmp_path / "features"
    collect_hidden_states(load_target(str(model_dir), "float32", "cpu"), load_prepared(prepared)[0],
                          FeatureSpec(aux_layers=(), need_last=True), store, CollectOptions(dtype="float32"))
    (shard,) = sorted((store / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the tensor data
    shard.write_bytes(bytes(data))
    proc = specheads("train", "method=medusa1", "method.num_heads=2", f"target.name_or_path={model_dir}",
                     "target.dtype=float32", "target.device=cpu", f"features_dir={store}", "prepared_dir=null",
                     f"output_dir={tmp_path / 'train'}", "train.max_steps=2", "train.progress=false",
                     "train.measure_prompts=0", "data.eval_samples=0", "wandb.mode=disabled", cwd=tmp_path)
    line = assert_one_clean_line(proc, "train")
    assert str(shard) in line and "corrupt" in line and "SHA-256" in line
    assert "specheads collect" in line  # what to do: re-run the collection, which redoes only that shard


@pytest.mark.slow
def test_a_missing_conversation_file_is_one_line(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    proc = specheads("prepare", f"target.name_or_path={model_dir}", "data=jsonl", f"data.path={tmp_path / 'no.jsonl'}",
                     f"output_dir={tmp_path / 'prepared'}", cwd=tmp_path)
    line = assert_one_clean_line(proc, "prepare")
    assert "conversation file not found" in line and "no.jsonl" in line


@pytest.mark.slow
def test_collect_from_a_folder_that_is_not_prepared_is_one_line(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    (tmp_path / "empty").mkdir()
    proc = specheads("collect", f"target.name_or_path={model_dir}", "target.dtype=float32", "method=medusa1",
                     f"prepared_dir={tmp_path / 'empty'}", f"out_dir={tmp_path / 'features'}", cwd=tmp_path)
    line = assert_one_clean_line(proc, "collect")
    assert "is not a prepared dataset" in line and "specheads prepare" in line


def test_a_required_setting_left_unset_is_one_line(capsys, monkeypatch):
    from omegaconf import MISSING, OmegaConf

    monkeypatch.delenv("SPECHEADS_TRACEBACK", raising=False)
    cfg = OmegaConf.create({"out_dir": MISSING})
    with pytest.raises(SystemExit) as e:
        with user_errors("export"):
            cfg.out_dir
    assert e.value.code == 2
    assert capsys.readouterr().err == ("specheads export: error: out_dir is required and has no default: "
                                       "give out_dir=... on the command line\n")


def test_an_output_folder_that_is_a_file_or_inside_one_is_refused(tmp_path):
    from specheads.errors import check_output_folder

    (tmp_path / "f").write_text("x")
    check_output_folder(tmp_path)  # an existing folder
    check_output_folder(tmp_path / "new" / "deeper")  # folders still to make
    for bad, said in ((tmp_path / "f", "is a file"), (tmp_path / "f" / "x", "which is a file")):
        with pytest.raises(ConfigError, match=said):
            check_output_folder(bad, "run_dir")
