"""head_method=dspark in the evaluator: the block as a chain with every draft verified and as the confidence
schedules it, both lossless (the evaluator's exact check) beside a baseline, tau reported for each."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.decoding.drafters import TreeShape
from specheads.errors import UserError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, build_drafter, check_head_kind, evaluate, plan_methods
from specheads.models.dspark import DSparkConfig, DSparkModel
from specheads.targets import Target
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    return Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab")


@pytest.fixture(scope="module")
def dspark_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    torch.manual_seed(0)
    m = DSparkModel(DSparkConfig.from_target(target, block_size=4, aux_layers=(0, 1), markov_rank=8))
    with torch.no_grad():
        m.markov_head.markov_w2.weight.normal_(0, 0.5)
        m.confidence_head.proj.bias.fill_(1.0)  # confidences near 0.7-0.8: the schedule cuts some chains
    m.save_pretrained(root / "head")
    (root / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.2}))
    return root


def test_evaluate_a_dspark_head_with_and_without_its_schedule(target, dspark_dir, monkeypatch):
    import specheads.evaluation.suite as suite

    methods = plan_methods("dspark", str(dspark_dir), ["ngram"], chain_k=3, dspark_threshold=0.6)
    assert [(m.name, m.drafter, m.shape.label(), m.confidence_threshold) for m in methods] == [
        ("dspark-chain3", "dspark", "chain3", None), ("dspark-sched0.6", "dspark", "chain3", 0.6),
        ("ngram-chain3", "ngram", "chain3", None)]
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=8, temperatures=(0.0, 1.0), batch_sizes=(1, 2),
                                         batch_prompts=2, repeats=1))
    rows = {m["name"]: m for m in report["methods"]}
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["batch"]["2"]["matches_batch1_plain"], m["name"]
    full, sched = (rows[n]["by_temperature"]["0.0"]["all"] for n in ("dspark-chain3", "dspark-sched0.6"))
    for row in (full, sched):
        assert row["draft_forwards_per_step"] == 1.0
        assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])
    assert sched["tau"] <= full["tau"] + 1e-9  # a shorter verified chain never accepts more per forward


def test_the_drafter_is_built_from_the_head_folder_and_its_family_is_checked(target, dspark_dir):
    full, sched = plan_methods("dspark", str(dspark_dir), [], dspark_threshold=0.25)
    d = build_drafter(sched, target)
    assert d.name == "dspark" and d.shape == TreeShape("chain", k=3) and d.threshold == 0.25
    assert build_drafter(full, target).threshold is None
    with pytest.raises(UserError, match="another family"):
        check_head_kind("dflash", str(dspark_dir))
