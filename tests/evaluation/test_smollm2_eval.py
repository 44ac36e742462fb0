"""The evaluator on the real SmolLM2: baselines are lossless on real prompts (slow)."""

from __future__ import annotations

import pytest

from specheads.decoding.drafters import TreeShape
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate

pytestmark = pytest.mark.slow


def test_smollm2_baselines_lossless(smollm2):
    methods = [MethodSpec("ngram", "ngram", TreeShape("chain", k=3)),
               MethodSpec("ee", "early_exit", TreeShape("chain", k=2), early_exit_layers=6)]
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=1, chat=0)
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    suite.load_benchmarks = lambda s: [p for p in real(s) if p.domain == "code"][:1]
    try:
        report = evaluate(smollm2, EvalConfig(methods, spec, max_new_tokens=12, temperatures=(0.0,),
                                              batch_sizes=(1,)))
    finally:
        suite.load_benchmarks = real
    for m in report["methods"]:
        assert m["lossless"]["exact"], m["lossless"]
        row = m["by_temperature"]["0.0"]["all"]
        assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])
    assert report["plain"]["all"]["tau"] == 1.0  # no drafts: one token per forward, exactly
