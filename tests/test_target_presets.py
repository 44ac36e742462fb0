"""Target presets (conf/target/<name>.yaml): each composes into the recipes, and its EAGLE-3 settings bind to a
tiny random model of the same config class, layer count and query/key-value head ratio, so a preset cannot
name layers (or a draft vocabulary) its target does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "conf" / "target").glob("*.yaml") if p.stem not in ("hf", "smollm2"))
TINY_VOCAB = 512


def compose(config: str, *overrides: str):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from tests.training.test_train_recipe import load_recipe

    load_recipe()  # registers the train schemas
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hcompose(config, overrides=list(overrides))


def test_the_presets_users_train_most_are_there():
    assert {"llama3_1_8b", "llama3_3_70b", "qwen3_8b", "qwen3_30b_a3b", "gpt_oss_20b", "gemma3_12b"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_into_every_recipe(preset):
    from omegaconf import OmegaConf

    raw = yaml.safe_load((REPO / "conf" / "target" / f"{preset}.yaml").read_text())
    train = OmegaConf.to_container(compose("train", f"target={preset}", "method=eagle3"), resolve=True)
    assert train["method"]["aux_layers"] == raw["eagle3"]["aux_layers"]
    assert train["method"]["draft_vocab_size"] == raw["eagle3"]["draft_vocab_size"]
    assert train["method"]["ttt_steps"] == raw["train_preset"]["ttt_steps"]
    assert train["optim"]["lr"] == raw["train_preset"]["lr"] and train["data"]["epochs"] == raw["train_preset"].get("epochs")  # a CPU preset trains by the clock
    assert train["data"]["max_tokens"] == raw["train_preset"]["max_tokens"]
    collect = OmegaConf.to_container(compose("collect_hidden_states", f"target={preset}"), resolve=True)
    assert collect["method"]["aux_layers"] == raw["eagle3"]["aux_layers"]
    assert collect["target"]["parallel"] in ("none", "tp", "device_map")
    prepare = compose("prepare_data", f"target={preset}")
    assert OmegaConf.to_container(prepare.target.chat_template_kwargs) == raw["chat_template_kwargs"]


def test_presets_leave_the_default_target_alone():
    from omegaconf import OmegaConf

    train = OmegaConf.to_container(compose("train", "method=eagle3"), resolve=True)
    assert train["method"]["aux_layers"] is None and train["method"]["ttt_steps"] == 3
    assert train["optim"]["lr"] == 1e-3 and train["data"]["epochs"] is None and train["data"]["max_tokens"] == 4096


def tiny_like(arch: dict):
    """A tiny random model of the preset's config class with its layer count and head ratio."""
    from transformers import AutoModelForCausalLM

    from tests.families.family_models import family_config

    group = arch["num_attention_heads"] // arch["num_key_value_heads"]
    heads = min(group, 8)
    config = family_config(arch["model_type"], vocab=TINY_VOCAB, hidden=64, layers=3, heads=heads, kv_heads=1)
    config.num_hidden_layers = arch["num_hidden_layers"]
    if getattr(config, "layer_types", None):  # the family's pattern, repeated over every layer
        pattern = list(config.layer_types)
        config.layer_types = [pattern[i % len(pattern)] for i in range(arch["num_hidden_layers"])]
    config.tie_word_embeddings = arch["tie_word_embeddings"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_eagle3_settings_fit_a_tiny_model_of_its_architecture(preset, tmp_path):
    from specheads.methods import build_method
    from specheads.targets import Target
    from tests.training.engine_helpers import progression_rows

    raw = yaml.safe_load((REPO / "conf" / "target" / f"{preset}.yaml").read_text())
    arch, eagle3 = raw["architecture"], raw["eagle3"]
    target = Target(tiny_like(arch), None, name=f"tiny-{preset}")
    assert target.num_layers == arch["num_hidden_layers"] and target.model.config.model_type == arch["model_type"]
    # the draft vocabulary keeps the preset's share of the target vocabulary
    draft = max(16, round(TINY_VOCAB * eagle3["draft_vocab_size"] / arch["vocab_size"]))
    data = progression_rows(8, length=24, vocab=TINY_VOCAB)
    method = build_method("eagle3", aux_layers=eagle3["aux_layers"], draft_vocab_size=draft, ttt_steps=2,
                          vocab_data=[{"input_ids": i, "loss_mask": m} for i, m in zip(data["input_ids"], data["loss_mask"])])
    method.bind(target)
    assert tuple(method.feature_spec.aux_layers) == tuple(eagle3["aux_layers"])
    assert max(eagle3["aux_layers"]) < arch["num_hidden_layers"]
    model = method.build(target)
    n = min(len(data["input_ids"][0]), len(data["input_ids"][1]))
    batch = {"input_ids": torch.tensor([r[:n] for r in data["input_ids"][:2]]),
             "loss_mask": torch.tensor([r[:n] for r in data["loss_mask"][:2]])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    from specheads.data.features import add_features

    loss = method.loss(model, add_features(batch, target, method.feature_spec), target).loss
    assert torch.isfinite(loss) and loss.requires_grad
    json.dumps(raw)  # the preset is plain data


def test_a_preset_naming_a_layer_its_target_lacks_is_refused():
    from specheads.methods import build_method
    from specheads.targets import Target

    arch = yaml.safe_load((REPO / "conf" / "target" / "llama3_1_8b.yaml").read_text())["architecture"]
    target = Target(tiny_like({**arch, "num_hidden_layers": 16}), None, name="tiny-16")
    method = build_method("eagle3", aux_layers=[2, 16, 29], draft_vocab_size=64, vocab_data=None)
    from specheads.errors import ConfigError

    with pytest.raises(ConfigError, match=r"layer\(s\) \[16, 29\] out of range for target 'tiny-16' with 16"):
        method.bind(target)


def test_epochs_set_the_optimizer_steps():
    from specheads.errors import ConfigError
    from tests.training.test_train_recipe import load_recipe

    steps = load_recipe().steps_for_epochs
    assert steps(10, 7, 2, 1) == 35 and steps(0.5, 10, 1, 2) == 3 and steps(1, 1, 8, 4) == 1
    with pytest.raises(ConfigError, match="data.epochs must be positive"):
        steps(-1, 10, 1, 1)


def test_the_reasoning_preset_trains_under_a_launch_of_an_even_number_of_processes(monkeypatch):
    """qwen3_8b_reasoning splits each row over 2 processes: its train settings pass in a launch of 2 and are
    refused in one process before any work (``specheads run``'s check of its stages runs the same check)."""
    from specheads.errors import ConfigError
    from tests.training.test_train_recipe import load_recipe

    cfg = compose("train", "target=qwen3_8b_reasoning", "method=eagle3", "output_dir=x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    load_recipe().check_config(cfg)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="train.sequence_parallel=2 does not divide the 1 launched processes"):
        load_recipe().check_config(cfg)
