"""head_method=peagle in the evaluator: one chain of K per step (K read from the head's config), lossless, beside a
baseline; the method planner refuses a folder of another family."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.decoding.drafters import TreeShape
from specheads.errors import UserError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, build_drafter, check_head_kind, evaluate, plan_methods
from specheads.models.peagle import PEagleConfig, PEagleModel
from specheads.targets import Target
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    return Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab")


@pytest.fixture(scope="module")
def peagle_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("peagle")
    torch.manual_seed(0)
    m = PEagleModel(PEagleConfig.from_target(target, draft_vocab_size=64, aux_layers=(0, 1), num_depths=3))
    ids = torch.arange(64)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    m.set_draft_vocab(torch.zeros(64, dtype=torch.long), t2d)
    m.save_pretrained(root / "head")
    (root / "train_summary.json").write_text(json.dumps({"tau_estimate": 1.2}))
    return root


def test_evaluate_a_peagle_head_beside_a_baseline(target, peagle_dir, monkeypatch):
    import specheads.evaluation.suite as suite

    methods = plan_methods("peagle", str(peagle_dir), ["ngram"], chain_k=3)
    assert [(m.name, m.drafter, m.shape.label()) for m in methods] == [
        ("peagle-chain3", "peagle", "chain3"), ("ngram-chain3", "ngram", "chain3")]
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0)
    report = evaluate(target, EvalConfig(methods, spec, max_new_tokens=8, temperatures=(0.0, 1.0), batch_sizes=(1, 2),
                                         batch_prompts=2, repeats=1))
    head = report["methods"][0]
    assert head["name"] == "peagle-chain3" and head["drafter"] == "peagle"
    for m in report["methods"]:
        assert m["lossless"]["exact"] and m["batch"]["2"]["matches_batch1_plain"], m["name"]
    row = head["by_temperature"]["0.0"]["all"]
    assert row["draft_forwards_per_step"] == 1.0  # K tokens from one forward
    assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])


def test_the_drafter_is_built_from_the_head_folder_and_its_family_is_checked(target, peagle_dir):
    spec = plan_methods("peagle", str(peagle_dir), [])[0]
    d = build_drafter(spec, target)
    assert d.name == "peagle" and d.shape == TreeShape("chain", k=3)
    with pytest.raises(UserError, match="another family"):
        check_head_kind("eagle3", str(peagle_dir))
