"""`specheads plan` refuses a bad setting in one line before the probe runs: a size that is not positive (a zero
probe divided by zero), a device this machine lacks, a store dtype no store has, a disk folder that does not exist
and a JSON file that is a folder."""

from __future__ import annotations

import importlib

import pytest
import torch

from specheads.errors import ConfigError
from specheads.overrides import compose


@pytest.fixture(scope="module")
def recipe():
    return importlib.import_module("specheads.recipes.plan")


def settings(*overrides: str):
    return compose("plan", list(overrides), "plan")


@pytest.mark.parametrize("override, words", [
    ("plan.probe_tokens=0", "plan.probe_tokens=0 is out of range: give an integer >= 1"),
    ("plan.device_gib=0", "plan.device_gib=0 is out of range: give a finite number > 0"),
    ("plan.train_tokens=0", "plan.train_tokens=0 is out of range: give an integer >= 1"),
    ("collect.batch_tokens=-1", "collect.batch_tokens=-1 is out of range: give an integer >= 1"),
    ("plan.processes=1.5", "plan.processes=1.5 is out of range: give an integer >= 1"),
    ("plan.tokens_per_sample=-3", "plan.tokens_per_sample=-3 is out of range: give a finite number > 0"),
    ("plan.num_samples=0", "plan.num_samples=0 is out of range"),
    ("plan.device=tpu", "plan.device=tpu: not a device here; use auto (a GPU when present, else the CPU), cpu, cuda"),
    ("collect.dtype=int8", "collect.dtype=int8: unknown store dtype; use one of float32, bfloat16, float16, fp8_e4m3"),
    ("plan.engine=sglang", "plan.engine=sglang: use vllm"),
])
def test_a_setting_out_of_range_is_refused_with_nothing_read(recipe, override, words):
    with pytest.raises(ConfigError) as e:
        recipe.check_config(settings(override))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_probe_without_cuda_is_refused(recipe):
    with pytest.raises(ConfigError, match=r"^plan.device=cuda: this machine has no CUDA device .*use auto or cpu$"):
        recipe.check_config(settings("plan.device=cuda"))


def test_the_shipped_settings_pass(recipe):
    recipe.check_config(settings())
    recipe.check_config(settings("plan.tokens_per_sample=900.5", "plan.device=cpu", "collect.dtype=fp8"))


def test_a_disk_folder_that_does_not_exist_or_a_json_that_is_a_folder_is_refused(recipe, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for override, words in [(f"plan.disk_dir={tmp_path / 'nope'}", "does not exist: give an existing folder"),
                            (f"plan.disk_dir={a_file}", "is a file: give the folder the store would go to"),
                            (f"plan.json={tmp_path}", f"is a folder: give a file name, e.g. plan.json={tmp_path}/"),
                            (f"plan.json={a_file}/plan.json", f"is inside {a_file}, which is a file")]:
        with pytest.raises(ConfigError) as e:
            recipe.check_paths(settings(override))
        assert str(e.value).startswith(f"{override}") and words in str(e.value), str(e.value)
    recipe.check_paths(settings(f"plan.disk_dir={tmp_path}", f"plan.json={tmp_path / 'new' / 'plan.json'}"))
    recipe.check_paths(settings("plan.disk_dir=runs", "plan.json=null"))  # a folder a stage makes here
    assert a_file.read_text() == "x"


def test_make_plan_refuses_a_zero_probe_before_dividing_by_it():
    from specheads.planning import make_plan

    with pytest.raises(ConfigError, match=r"^probe_tokens=0 is out of range: give a finite number > 0$"):
        make_plan(target_name="t", config=None, method_name="eagle3", method_settings={}, dtype="float32",
                  store_dtype="bfloat16", num_samples=10, tokens_per_sample=10.0, epochs=1.0, batch_tokens=64,
                  device="cpu", probe_tokens=0)
