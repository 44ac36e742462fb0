"""Every Hydra config composes, and the pipeline's stage overrides compose against the real recipes."""

import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF, RECIPES = ROOT / "conf", ROOT / "recipes"
PRIMARY = {"prepare_data.py": "prepare_data", "collect_hidden_states.py": "collect_hidden_states",
           "train.py": "train", "evaluate.py": "evaluate", "export.py": "export", "pipeline.py": "pipeline",
           "serve_eval.py": "serve_eval"}


def load_recipe(name: str):
    """Import a recipe script as a module (its import registers its ConfigStore schemas)."""
    sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(name).stem}", RECIPES / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def schemas():
    for recipe in PRIMARY:
        load_recipe(recipe)


def compose_cfg(config_name: str, overrides=()):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


@pytest.mark.parametrize("config_name", PRIMARY.values())
def test_primary_configs_compose(config_name):
    cfg = compose_cfg(config_name, ["head_dir=x", "output_dir=y"] if config_name == "export" else [])
    assert cfg.target.name_or_path == "smollm2"


@pytest.mark.parametrize("group", ["target", "data", "regenerate", "method", "optim", "eval"])
def test_every_group_option_composes(group):
    options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert options, f"conf/{group} is empty"
    primary = {"data": "prepare_data", "regenerate": "prepare_data", "method": "train", "optim": "train",
               "eval": "evaluate", "target": "prepare_data"}[group]
    for option in options:
        extra = {"target/hf": ["target.name_or_path=/m"], "data/jsonl": ["data.path=x"], "data/hf": ["data.path=x"],
                 "regenerate/endpoint": ["regenerate.endpoint.url=http://127.0.0.1:8000/v1"]}
        cfg = compose_cfg(primary, [f"{group}={option}", *extra.get(f"{group}/{option}", [])])
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_override_typo_is_an_error():
    with pytest.raises(Exception, match="max_lenght"):
        compose_cfg("prepare_data", ["data.max_lenght=3"])


@pytest.mark.parametrize("method, offline", [("eagle3", True), ("eagle1", True), ("medusa1", True), ("medusa2", False),
                                             ("peagle", True), ("dspark", True), ("domino", True)])
def test_pipeline_stage_overrides_compose_against_each_recipe(method, offline, tmp_path):
    pipeline = load_recipe("pipeline.py")
    cfg = compose_cfg("pipeline", [f"head={method}", f"offline={str(offline).lower()}", f"run_dir={tmp_path}"])
    stages = pipeline.stage_commands(cfg)
    names = [s[0] for s in stages]
    assert names == (["prepare", "collect"] if offline else ["prepare"]) + ["train", "evaluate", "export"]
    for _, recipe, overrides in stages:
        stage_cfg = compose_cfg(PRIMARY[recipe], overrides)
        OmegaConf.to_container(stage_cfg, resolve=True, throw_on_missing=True)
    train_cfg = compose_cfg("train", dict((s[0], s[2]) for s in stages)["train"])
    assert train_cfg.method.name == method and str(tmp_path) in train_cfg.output_dir
    assert (train_cfg.features_dir is not None) == offline
    eval_cfg = compose_cfg("evaluate", dict((s[0], s[2]) for s in stages)["evaluate"])
    # the hybrid's n-gram table reads the run's own store (offline) or prepared dataset (online)
    assert eval_cfg.head_ngram_table == str(tmp_path / ("features" if offline else "prepared"))
    assert eval_cfg.head_ngram_extend == 1 and eval_cfg.head_ngram == 4
    if method in ("dflash", "domino"):  # a CPU budget's block drafter: ModelOpt's block size, its decay, 32 blocks
        assert (train_cfg.method.block_size, train_cfg.method.gamma, train_cfg.method.anchors) == (8, 4.0, 32)


@pytest.mark.parametrize("head, store", [("eagle3", "eagle3"), ("peagle", "eagle3"), ("dflash", "eagle3"),
                                         ("dspark", "eagle3"), ("domino", "eagle3"), ("eagle1", "eagle1"),
                                         ("medusa1", "medusa1")])
def test_heads_that_fuse_target_layers_share_eagle3s_store(head, store, tmp_path):
    """One collection serves every head that fuses several target layers (a head-to-head on one run_dir): their
    collect stage stores EAGLE-3's features; the others collect their own."""
    pipeline = load_recipe("pipeline.py")
    cfg = compose_cfg("pipeline", [f"head={head}", f"run_dir={tmp_path}"])
    collect = dict((s[0], s[2]) for s in pipeline.stage_commands(cfg))["collect"]
    assert f"method={store}" in collect


@pytest.mark.parametrize("group", ["method", "optim"])
def test_a_group_offers_only_its_files_and_its_schema_still_applies(group):
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(str(CONF), version_base="1.3"):
        offered = sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    assert offered == sorted(p.stem for p in (CONF / group).glob("*.yaml"))  # no *_schema entries
    with pytest.raises(Exception, match="num_headz|lrr"):  # the schemas, now under schema/, still catch typos
        compose_cfg("train", ["method=medusa1", "method.num_headz=2"] if group == "method" else ["optim.lrr=1"])
