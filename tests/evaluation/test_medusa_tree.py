"""The static Medusa tree the evaluator drafts with comes from the head (its training-time
calibration) or a fixed default, never from the prompts being scored; the training-time τ the report
shows has one basis (the target's greedy token) for every head."""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_tiny_target
from specheads.decoding.drafters import TreeShape
from specheads.decoding.tree import choices_from_accuracies
from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.shape_choice import train_tau
from specheads.evaluation.suite import EvalConfig, MethodSpec, build_drafter, evaluate
from specheads.methods.medusa import TREE_FILE, default_choices, write_medusa_tree
from specheads.models.medusa import medusa_for_target

ACC = [[0.5, 0.2, 0.1, 0.05], [0.3, 0.1, 0.05, 0.01], [0.2, 0.05, 0.01, 0.0]]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=256, hidden=32, layers=2)


@pytest.fixture
def heads_dir(target, tmp_path):
    medusa_for_target(target, num_heads=3).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


class NoFeatures:
    """Fails the test if anything reads the target's features outside decoding (fitting on prompts)."""

    def __init__(self, target):
        self.target = target

    def __enter__(self):
        def boom(*a, **k):
            raise AssertionError("the evaluator ran the target on the prompts to fit the tree")
        self.saved = self.target.forward_features
        self.target.forward_features = boom

    def __exit__(self, *exc):
        self.target.forward_features = self.saved


def test_saved_tree_is_used_and_nothing_is_fitted_on_the_prompts(target, heads_dir):
    write_medusa_tree(heads_dir, ACC, num_nodes=5)
    spec = MethodSpec("medusa-tree", "medusa", TreeShape("static"), head_dir=str(heads_dir), medusa_tree_nodes=7)
    with NoFeatures(target):
        drafter = build_drafter(spec, target, prompts=None, ids=None)  # no prompt is even available
    want = tuple(choices_from_accuracies(ACC, 7))  # the saved accuracies at the requested budget
    assert drafter.shape.choices == want and spec.shape.choices == want
    assert TREE_FILE in spec.tree_source


def test_a_tree_of_choices_only_is_used_as_saved(target, heads_dir):
    (heads_dir / TREE_FILE).write_text(json.dumps({"format": "specheads.medusa_tree/1",
                                                   "medusa_choices": [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    spec = MethodSpec("m", "medusa", TreeShape("static"), head_dir=str(heads_dir))
    drafter = build_drafter(spec, target)
    assert drafter.shape.choices == ((0,), (1,), (0, 0), (0, 0, 0))  # depth capped at the 3 heads


def test_without_a_saved_tree_the_default_shape_is_used(target, heads_dir, caplog):
    spec = MethodSpec("medusa-tree", "medusa", TreeShape("static"), head_dir=str(heads_dir), medusa_tree_nodes=9)
    with NoFeatures(target):
        drafter = build_drafter(spec, target, prompts=None, ids=None)
    assert drafter.shape.choices == tuple(default_choices(3, 9))
    assert spec.tree_source.startswith("default") and "uncalibrated default tree" in caplog.text


def test_evaluate_reports_where_the_tree_came_from(target, heads_dir, monkeypatch):
    import specheads.evaluation.suite as suite

    write_medusa_tree(heads_dir, ACC)
    prompts = [EvalPrompt(f"p{i}", "synthetic", input_ids=[3 + i, 17, 42, 9, 100 + i]) for i in range(2)]
    monkeypatch.setattr(suite, "load_benchmarks", lambda spec: prompts)
    spec = MethodSpec("medusa-tree", "medusa", TreeShape("static"), head_dir=str(heads_dir), medusa_tree_nodes=6)
    with NoFeatures(target):
        report = evaluate(target, EvalConfig([spec], max_new_tokens=4, temperatures=(0.0,), batch_sizes=(1,)))
    row = report["methods"][0]
    assert row["shape"] == "static(6)" and TREE_FILE in row["tree_source"] and row["lossless"]["exact"]


def test_train_tau_has_one_basis(tmp_path):
    """Medusa summaries written before the greedy basis (no ``tau_vs_target_greedy``) are not shown
    under the target-greedy label; EAGLE's always had it."""
    head = tmp_path / "head"
    head.mkdir()
    f = tmp_path / "train_summary.json"
    f.write_text(json.dumps({"method": "medusa1", "tau_estimate": 2.5, "eval": {"chain0_acc": 0.9}}))
    assert train_tau(str(head)) is None
    f.write_text(json.dumps({"method": "medusa1", "tau_estimate": 1.8, "eval": {"tau_vs_target_greedy": 1.0}}))
    assert train_tau(str(head)) == 1.8
    f.write_text(json.dumps({"method": "eagle3", "tau_estimate": 2.1, "eval": {}}))
    assert train_tau(str(head)) == 2.1


def test_report_labels_the_training_tau_basis():
    from specheads.evaluation.report import TRAIN_TAU_LABEL, _method_md

    row = {"alpha": 0.5, "tau": 1.5, "tokens_per_s": 10.0, "speedup": 1.1, "cost_ratio_c": 0.1,
           "gpu_speedup_pred": 1.2, "alpha_by_position": [0.5]}
    m = {"name": "medusa-tree", "drafter": "medusa", "shape": "static(6)", "verify": "auto", "c_gpu": 0.01,
         "by_temperature": {"0.0": {"all": row}}, "train_tau": 1.8}
    text = "\n".join(_method_md(m, {}))
    assert "Training-time τ estimate (vs target greedy) 1.80" in text and TRAIN_TAU_LABEL in text
