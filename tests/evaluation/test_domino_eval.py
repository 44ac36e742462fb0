"""head_method=domino in the evaluator: the block as a chain corrected left to right, lossless at T = 0 and T = 1
(the evaluator's exact check) beside a baseline, batched rows matching batch 1, tau reported."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, build_drafter, evaluate, plan_methods
from specheads.models.domino import DominoConfig, DominoModel
from specheads.targets import Target
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    return Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab")


@pytest.fixture(scope="module")
def domino_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("domino")
    torch.manual_seed(0)
    m = DominoModel(DominoConfig.from_target(target, block_size=4, aux_layers=(0, 1)))
    with torch.no_grad():
        m.embed_proj[2].weight.normal_(0, 0.5)  # a correction that moves the drafts
    m.save_pretrained(root / "head")
    (root / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.2}))
    return root


def test_evaluate_a_domino_head(target, domino_dir, monkeypatch):
    import specheads.evaluation.suite as suite

    methods = plan_methods("domino", str(domino_dir), ["ngram"], chain_k=3)
    assert [(m.name, m.drafter, m.shape.label()) for m in methods] == [
        ("domino-chain3", "domino", "chain3"), ("ngram-chain3", "ngram", "chain3")]
    assert build_drafter(methods[0], target).name == "domino"
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=8, temperatures=(0.0, 1.0), batch_sizes=(1, 2),
                                         batch_prompts=2, repeats=1))
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["batch"]["2"]["matches_batch1_plain"], m["name"]
    row = {m["name"]: m for m in report["methods"]}["domino-chain3"]["by_temperature"]["0.0"]["all"]
    assert row["draft_forwards_per_step"] == 1.0
    assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])


def test_the_run_ends_without_vllms_serve_stage(tmp_path, monkeypatch):
    """vLLM has no Domino drafter (no vLLM folder is exported): ``serve=auto`` leaves the serve stage out even where
    an engine is found; an EAGLE-3 head there is served."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("recipe_pipeline_domino", root / "recipes" / "pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pipeline
    spec.loader.exec_module(pipeline)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(root / "tests" / "serving" / "fake_python.sh")
    monkeypatch.setenv("SPECHEADS_ENGINE_VENV", str(tmp_path / "venv"))
    assert pipeline.serve_stage_wanted("auto", "eagle3") is True
    assert pipeline.serve_stage_wanted("auto", "domino") is False
