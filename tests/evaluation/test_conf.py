"""conf/evaluate.yaml and conf/eval/* compose against the recipe's schema."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


def _load_recipe():
    spec = importlib.util.spec_from_file_location("evaluate_recipe", ROOT / "recipes" / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # registers the schema
    return mod


@pytest.mark.parametrize("evalset", ["default", "full", "tiny"])
def test_compose(evalset):
    _load_recipe()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("evaluate", [f"eval={evalset}"])
    assert cfg.eval.max_new_tokens > 0 and list(cfg.baselines) == ["ngram", "early_exit"]


def test_typo_is_an_error():
    _load_recipe()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        with pytest.raises(Exception, match="chain_kk"):
            compose("evaluate", ["chain_kk=3"])
