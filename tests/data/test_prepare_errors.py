"""The prepare stage refuses, before any work, what it cannot read or must not overwrite, and leaves nothing
half written behind: a folder of other files as output_dir (replacing it would delete them), a source path of
the wrong kind, data.num_proc below 1; a failed run removes its work folder, and an earlier prepared set stays
whole until the new one is complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from specheads.data import prepare as prep
from specheads.data.prepare import (META_FILE, PrepareConfig, PrepareError, check_prepare_output, load_prepared,
                                    prepare, write_prepared)
from specheads.data.sources import SourceError, check_source, check_sources
from specheads.errors import ConfigError
from specheads.targets import Target
from tests.test_cli_errors import in_process, one_line, specheads

ROWS = {"id": ["a", "b"], "input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 1]], "domain": ["chat"] * 2}


def write_chats(path, n=4):
    path.write_text("\n".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i} " * (3 + i)}]})
        for i in range(n)))
    return path


def siblings(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name + "."))


@pytest.fixture
def target(smollm2_tokenizer):
    return Target.tokenizer_only(smollm2_tokenizer, "smollm2")


def test_an_output_folder_of_other_files_is_refused_and_kept(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir=.*/o holds files that are not a prepared dataset \(e\.g\. "
                                          r"notes\.txt\): give a new or empty folder, or the output_dir of an"):
        check_prepare_output(out)
    write_prepared(ROWS, {}, tmp_path / "p")
    (tmp_path / "p" / "notes.txt").write_text("x")  # a prepared set with a file of the user's in it
    with pytest.raises(ConfigError, match="notes.txt"):
        check_prepare_output(tmp_path / "p")
    import datasets

    datasets.Dataset.from_dict({"x": [1]}).save_to_disk(str(tmp_path / "hf"))  # a dataset, but not a prepared one
    with pytest.raises(ConfigError, match=f"without {META_FILE}"):
        check_prepare_output(tmp_path / "hf")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_prepare_output(tmp_path / "f")
    (tmp_path / "empty").mkdir()
    write_prepared(ROWS, {}, tmp_path / "q")
    for fine in ("new", "empty", "q"):
        check_prepare_output(tmp_path / fine)
    assert (out / "notes.txt").read_text() == "x"


def test_cli_refuses_a_folder_of_other_files_before_any_work(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    line = one_line(specheads("prepare", "data=jsonl", f"data.path={write_chats(tmp_path / 'c.jsonl')}",
                              f"output_dir={out}", cwd=tmp_path), "prepare")
    assert f"output_dir={out} holds files that are not a prepared dataset (e.g. notes.txt)" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and siblings(out) == []


def test_an_earlier_prepared_set_is_replaced_whole_or_kept_whole(target, tmp_path, monkeypatch):
    out = tmp_path / "o"
    write_prepared(ROWS, {"target": "old"}, out)
    cfg = PrepareConfig(source="jsonl", path=str(write_chats(tmp_path / "c.jsonl")), num_samples=None, num_proc=1)
    real_replace = os.replace

    def failing_move_in(src, dst):
        if str(src).endswith("/data"):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(prep.os, "replace", failing_move_in)
    with pytest.raises(OSError, match="disk gone"):
        prepare(target, cfg, out)
    monkeypatch.undo()
    ds, meta = load_prepared(out)
    assert meta["target"] == "old" and ds["id"] == ["a", "b"] and siblings(out) == []
    meta = prepare(target, cfg, out)
    ds, meta2 = load_prepared(out)
    assert meta2 == meta and len(ds) == 4 and siblings(out) == []


@pytest.mark.parametrize("content, error, match", [
    (b"\n\n  \n", PrepareError, "no usable conversation"),
    (b'{"a": 1}\n[1]\n', PrepareError, "not a conversation"),
    (b'{"messages": []}\n\xff\xfe\xfa\n', SourceError, "not UTF-8"),
])
def test_a_failed_run_leaves_no_work_folder_and_no_save_line(target, tmp_path, capfd, content, error, match):
    (tmp_path / "c.jsonl").write_bytes(content)
    out = tmp_path / "o"
    with pytest.raises(error, match=match):
        prepare(target, PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_proc=1), out)
    assert not out.exists() and siblings(out) == []
    assert "Saving the dataset" not in capfd.readouterr().err


def test_stale_work_folders_of_dead_runs_are_removed(target, tmp_path):
    out = tmp_path / "o"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 2 * prep.STALE_TMP_SECONDS
    for pid in (dead.pid, os.getppid()):  # a run killed long ago, and one still running
        folder = tmp_path / f"o.tmp{pid}"
        folder.mkdir()
        (folder / "rows.arrow").write_text("x")
        for path in (folder / "rows.arrow", folder):
            os.utime(path, (old, old))
    prepare(target, PrepareConfig(source="jsonl", path=str(write_chats(tmp_path / "c.jsonl")), num_proc=1), out)
    assert siblings(out) == [f"o.tmp{os.getppid()}"]


def test_a_recent_work_folder_of_a_dead_run_is_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"o.tmp{dead.pid}").mkdir()  # maybe a run on another machine that shares the folder
    prep._remove_stale_tmp(tmp_path / "o")
    assert (tmp_path / f"o.tmp{dead.pid}").is_dir()


def test_a_source_path_of_the_wrong_kind_is_one_clear_error(tmp_path):
    jsonl = write_chats(tmp_path / "c.jsonl")
    with pytest.raises(SourceError, match=r"data.path=.*c.jsonl is a file: data=hf reads a dataset name or a folder "
                                          r"saved with `save_to_disk`; for a JSON lines file .* use data=jsonl"):
        check_source("hf", str(jsonl))
    with pytest.raises(SourceError, match=r"data.path=.* is a folder: data=jsonl reads a JSON lines file"):
        check_source("jsonl", str(tmp_path))
    with pytest.raises(SourceError, match="is a folder that `save_to_disk` did not write"):
        check_source("hf", str(tmp_path))
    with pytest.raises(SourceError, match="is empty"):
        (tmp_path / "e.jsonl").write_text("")
        check_source("jsonl", str(tmp_path / "e.jsonl"))
    write_prepared(ROWS, {}, tmp_path / "p")
    with pytest.raises(SourceError, match="a dataset saved with `save_to_disk` is read by data=hf"):
        check_source("jsonl", str(tmp_path / "p"))
    with pytest.raises(SourceError, match=r"data.parts\[1\].path=.* is a folder: data.parts\[1\].source=jsonl"):
        check_sources("mixture", None, [{"name": "a", "source": "jsonl", "path": str(jsonl), "num_samples": 1},
                                        {"name": "b", "source": "jsonl", "path": str(tmp_path), "num_samples": 1}])
    check_source("jsonl", str(jsonl))
    check_source("hf", str(tmp_path / "p"))
    check_source("sharegpt", None)


@pytest.mark.parametrize("num_proc", [0, -3])
def test_num_proc_below_one_is_refused(num_proc):
    with pytest.raises(ConfigError, match=rf"data.num_proc={num_proc}: .*1 or more\), or null for every core"):
        PrepareConfig(num_proc=num_proc)
    assert PrepareConfig(num_proc=None).num_proc is None and PrepareConfig(num_proc=1).num_proc == 1


def test_the_run_refuses_num_proc_below_one_before_its_first_stage(capsys):
    from tests.test_overrides import pipeline

    p = pipeline()
    with pytest.raises(SystemExit) as e:
        p.check_stages(p.stage_arguments(["prepare.data.num_proc=0"]))
    assert e.value.code == 2 and "the prepare stage: data.num_proc=0: " in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_refused_before_preparing(tmp_path):
    """In process (``in_process``: the recipe's own steps): prepare's CLI wiring is proven by the real run of
    test_cli_refuses_a_folder_of_other_files_before_any_work."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = in_process("prepare", "target.device=cuda", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert "target.device=cuda: this machine has no CUDA device" in one_line(proc, "prepare")
    assert not (tmp_path / "out").exists()


def test_a_max_length_past_the_targets_context_is_one_line_before_any_work(tmp_path):
    """SmolLM2 reads 8192 positions: 8193 is refused naming the limit and where it comes from, nothing written;
    8192 itself prepares (the rows are kept up to the context, not cut at a preset's 2048)."""
    chats = tmp_path / "c.jsonl"
    chats.write_text(json.dumps({"id": "long", "messages": [
        {"role": "user", "content": "Count on."}, {"role": "assistant", "content": "1 2 3 " * 900}]}))
    data = ["data=jsonl", f"data.path={chats}"]
    line = one_line(in_process("prepare", *data, "data.max_length=8193", f"output_dir={tmp_path / 'o'}",
                               cwd=tmp_path), "prepare")  # in process, as the test above; the success is a real run
    assert "data.max_length=8193 is longer than target 'smollm2' can read (8192 tokens: max_position_embeddings " \
           "8192 in its config); give at most 8192" in line, line
    assert not (tmp_path / "o").exists() and siblings(tmp_path / "o") == []
    proc = specheads("prepare", *data, "data.max_length=8192", f"output_dir={tmp_path / 'p'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, meta = load_prepared(tmp_path / "p")
    assert meta["max_length"] == 8192 and meta["num_truncated"] == 0 and meta["num_tokens"] > 2048


def test_the_context_is_the_configs_and_the_tokenizers_only_where_no_config_names_one():
    from types import SimpleNamespace

    from specheads.targets.context import check_fits_context, context_limit

    config = SimpleNamespace(max_position_embeddings=40960)
    tok = SimpleNamespace(model_max_length=131072)
    assert context_limit(config, tok).tokens == 40960  # Qwen3-8B's pair: the config's is the model's
    assert context_limit(None, tok).tokens == 131072
    assert context_limit(None, SimpleNamespace(model_max_length=int(1e30))) is None  # transformers' "unset"
    assert context_limit(None, None) is None
    check_fits_context("data.max_length", 40960, context_limit(config, tok), "t")
    check_fits_context("data.max_length", 10**6, None, "t")  # no limit known: nothing to refuse
    with pytest.raises(ConfigError, match=r"data.max_length=40961 is longer than target 't' can read \(40960 tokens"):
        check_fits_context("data.max_length", 40961, context_limit(config, tok), "t")
