"""conf/evaluate.yaml and conf/eval/* compose against the recipe's schema."""

from __future__ import annotations

import importlib.util
import json
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


def test_more_heads_in_one_report(tmp_path):
    """heads.<family>=<dir> adds that head's methods before the main head's; baselines stay last."""
    mod = _load_recipe()
    for fam, model_type in (("medusa", "medusa"), ("eagle1", "specheads_eagle1")):
        (tmp_path / fam).mkdir()
        (tmp_path / fam / "config.json").write_text(json.dumps({"model_type": model_type}))  # as a saved head names it
        (tmp_path / fam / "model.safetensors").write_bytes(b"")  # planned only: the weights are never read
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("evaluate", [f"+heads.medusa={tmp_path / 'medusa'}", f"+heads.eagle1={tmp_path / 'eagle1'}",
                                   "baselines=[ngram]"])
    assert dict(cfg.heads) == {"medusa": str(tmp_path / "medusa"), "eagle1": str(tmp_path / "eagle1")}
    captured = {}

    class Planned(Exception):
        pass

    def fake_evaluate(target, ecfg, **kw):
        captured["cfg"] = ecfg
        raise Planned

    mod.evaluate, mod.load_target = fake_evaluate, lambda *a, **k: None
    with pytest.raises(Planned):
        mod.run(cfg)
    names = [m.name for m in captured["cfg"].methods]
    assert names == ["eagle1-tree", "eagle1-sglang", "eagle1-vllm", "medusa-tree", "medusa-vllm", "ngram-chain4"]


@pytest.mark.parametrize("exact_forward, wanted", [("auto", "calls"), ("on", "calls"), ("off", 4)])
def test_the_target_dtype_is_probed_as_decoding_runs(exact_forward, wanted):
    """The evaluator's target loads with a dtype probe of exact decoding's calls (each dtype at its own row
    floor), and at a verify forward's 4 rows only where exact forwards are off."""
    from specheads.decoding.exact import ExactDecodeCalls

    mod = _load_recipe()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("evaluate", [f"exact_forward={exact_forward}", "baselines=[ngram]"])
    captured = {}

    class Loaded(Exception):
        pass

    def fake_load(*a, probe_rows=None, **k):
        captured["rows"] = probe_rows
        raise Loaded

    mod.load_target = fake_load
    with pytest.raises(Loaded):
        mod.run(cfg)
    rows = captured["rows"]
    assert (isinstance(rows, ExactDecodeCalls) and rows.tokens == 4) if wanted == "calls" else rows == wanted
