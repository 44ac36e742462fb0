"""`specheads collect` refuses a bad setting in one line before any work: every setting's range with nothing read
(``check_config``, which `specheads run` calls too), then an output folder that is a file, a missing chat template,
aux layers the target lacks (its depth from config.json, no weights loaded) and a store in output_dir begun with
other settings or data, all before the target loads."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from specheads.data.store import StoreMismatchError
from specheads.errors import ConfigError
from specheads.overrides import compose
from tests.conftest import make_tiny_model
from tests.data.test_features import make_prepared


@pytest.fixture(scope="module")
def recipe():
    return importlib.import_module("specheads.recipes.collect_hidden_states")  # its schemas, as when it runs


def settings(*overrides: str):
    return compose("collect_hidden_states", ["target.device=cpu", *overrides], "collect")


@pytest.mark.parametrize("override, words", [
    ("target.device=foo", "target.device=foo: not a device here; use auto"),
    ("target.parallel=foo", "target.parallel=foo: use one of none, tp, device_map"),
    ("collect.dtype=int8", "collect.dtype=int8: unknown store dtype; use one of float32, bfloat16, float16, fp8_e4m3"),
    ("collect.max_minutes=-1", "collect.max_minutes=-1 is out of range: give a finite number > 0 (or null)"),
    ("collect.max_minutes=0", "collect.max_minutes=0 is out of range"),
    ("collect.batch_tokens=0", "collect.batch_tokens=0 is out of range: give an integer >= 1"),
    ("collect.max_batch_size=-1", "collect.max_batch_size=-1 is out of range: give an integer >= 1"),
    ("collect.shard_samples=0", "collect.shard_samples=0 is out of range: give an integer >= 1"),
    ("collect.shard_bytes=-5", "collect.shard_bytes=-5 is out of range: give an integer >= 1"),
    ("collect.check_disk=maybe", "collect.check_disk=maybe: use true or false"),
    ("vllm.max_model_len=0", "vllm.max_model_len=0 is out of range"),
    ("engine=sglang", "engine=sglang: use hf"),
    ("method.aux_layers=[1,-1,2]", "method.aux_layers=[1, -1, 2]: -1 is out of range: give an integer >= 0"),
    ("method=medusa2", "method=medusa2 trains the target itself (online only): it has no features to collect"),
])
def test_a_setting_out_of_range_is_refused_with_nothing_read(recipe, override, words):
    with pytest.raises(ConfigError) as e:
        recipe.check_config(settings(override))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_refused(recipe):
    with pytest.raises(ConfigError, match=r"^target.device=cuda: this machine has no CUDA device .*use auto or cpu$"):
        recipe.check_config(settings("target.device=cuda"))


@pytest.mark.parametrize("overrides", [[], ["collect.max_minutes=null", "collect.dtype=bf16"],
                                       ["collect.max_minutes=2.5", "method=eagle1"], ["method.aux_layers=[0,2,3]"]])
def test_the_shipped_settings_and_nulls_pass(recipe, overrides):
    recipe.check_config(settings(*overrides))


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A target folder holding only config.json (4 layers, hidden 64) and a prepared set of 24 rows: what the
    early checks read. Loading this target would fail, so a check that passes here ran before any load."""
    root = tmp_path_factory.mktemp("collect-errors")
    make_tiny_model("llama", layers=4).config.save_pretrained(root / "target")
    return root / "target", make_prepared(root)


def test_aux_layers_the_target_lacks_are_refused_from_its_config(recipe, config_only, tmp_path):
    from specheads.data.prepare import load_prepared

    target, prepared = config_only
    cfg = settings(f"target.name_or_path={target}", "method.aux_layers=[1,99,2]")
    with pytest.raises(ConfigError, match=r"method.aux_layers \[1, 99, 2\]: layer\(s\) \[99\] out of range for "
                                          r"target .* with 4 decoder layers \(0..3\)"):
        recipe.check_before_loading(cfg, load_prepared(prepared)[0], str(tmp_path / "features"))
    assert not (tmp_path / "features").exists()


def write_plan(root, **changes) -> None:
    """A store's plan.json as collection with eagle3 on the config-only target and prepared set begins it."""
    header = {"format": "specheads.features/1", "target": "X", "num_layers": 4, "hidden_size": 64,
              "aux_layers": [1, 2, 3], "has_last": True, "dtype": "bfloat16", "num_samples": 24,
              "num_tokens": None, "plan_hash": "0" * 24, **changes}
    root.mkdir(parents=True)
    (root / "plan.json").write_text(json.dumps(header))


def test_a_store_begun_with_other_settings_or_data_is_refused_before_the_target_loads(recipe, config_only,
                                                                                          tmp_path):
    from specheads.data.features import sample_lengths
    from specheads.data.prepare import load_prepared

    target, prepared = config_only
    dataset = load_prepared(prepared)[0]
    tokens = sum(sample_lengths(dataset))
    cfg = settings(f"target.name_or_path={target}", "method=eagle3")
    same = tmp_path / "same"
    write_plan(same, target=str(target), num_tokens=tokens)
    recipe.check_before_loading(cfg, dataset, str(same))  # a re-run of the same collection goes on
    recipe.check_before_loading(cfg, dataset, str(tmp_path / "new"))  # no store yet
    for name, changes, differs in [
        ("method", {"aux_layers": []}, "aux_layers [] (now [1, 2, 3])"),
        ("dtype", {"dtype": "float32"}, "dtype float32 (now bfloat16)"),
        ("data", {"num_samples": 30}, "num_samples 30 (now 24)"),
        ("target", {"target": "other", "num_layers": 8}, "target other (now "),
    ]:
        write_plan(tmp_path / name, **{"target": str(target), "num_tokens": tokens, **changes})
        with pytest.raises(StoreMismatchError, match="holds a store begun with other settings or data") as e:
            recipe.check_before_loading(cfg, dataset, str(tmp_path / name))
        assert differs in str(e.value) and "collect into a new output_dir" in str(e.value)
    budget = settings(f"target.name_or_path={target}", "method=eagle3", "collect.max_minutes=5")
    recipe.check_before_loading(budget, dataset, str(tmp_path / "data"))  # a budget collects a share of the rows


def test_a_missing_chat_template_is_refused_before_the_target_loads(recipe, config_only, tmp_path):
    from specheads.targets.chat_templates import ChatTemplateError

    target, prepared = config_only
    cfg = settings(f"target.name_or_path={target}", f"prepared_dir={prepared}", f"output_dir={tmp_path / 'f'}",
                   "target.chat_template=nope.jinja")
    with pytest.raises(ChatTemplateError, match="^target.chat_template=nope.jinja: not a file, a shipped template"):
        recipe.collect(cfg)
    assert not (tmp_path / "f").exists()


def test_an_output_folder_that_is_a_file_is_refused_before_the_target_loads(recipe, config_only, tmp_path):
    target, prepared = config_only
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cfg = settings(f"target.name_or_path={target}", f"prepared_dir={prepared}", f"output_dir={a_file}")
    with pytest.raises(ConfigError) as e:
        recipe.collect(cfg)
    assert str(e.value) == f"output_dir={a_file} is a file: give a folder (a new one, or one this stage wrote)"
    assert a_file.read_text() == "x"
