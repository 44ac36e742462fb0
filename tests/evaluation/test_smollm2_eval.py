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
        # one timed pass, and the layout and thread count set (their timed choices: tests/decoding): lossless-ness
        # is what is under test here
        report = evaluate(smollm2, EvalConfig(methods, spec, max_new_tokens=12, temperatures=(0.0,),
                                              batch_sizes=(1,), repeats=1, cpu_linears="packed", cpu_threads=1))
    finally:
        suite.load_benchmarks = real
    for m in report["methods"]:
        assert m["lossless"]["exact"], m["lossless"]
        row = m["by_temperature"]["0.0"]["all"]
        assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])
    assert report["plain"]["all"]["tau"] == 1.0  # no drafts: one token per forward, exactly


def test_smollm2_in_the_dtype_this_machine_picks_is_lossless_where_bfloat16_once_was_not(monkeypatch):
    """The real target loaded as the evaluate stage loads it (``target.dtype=auto``: bfloat16 where the probe finds
    it faster, as on a CPU with AVX-512 and bfloat16 kernels), the n-gram baseline on the four prompts whose
    greedy outputs once diverged from plain decoding there (at tokens 10-29, the target's margins 0 to 0.125):
    the report's lossless check (the exact pass's) must be exact, with the exact forwards proven on this machine."""
    import specheads.evaluation.suite as suite
    from specheads.decoding.exact import ExactDecodeCalls
    from specheads.targets import load_target

    target = load_target("smollm2", "auto", "cpu", probe_rows=ExactDecodeCalls(tokens=4))
    wanted = {"mtbench/111/t1", "mtbench/91/t1", "HumanEval/0", "HumanEval/1"}
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.id in wanted])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=2, chat=0)
    report = evaluate(target, EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=4))], spec,
                                         max_new_tokens=32, temperatures=(0.0,), batch_sizes=(1,), repeats=1))
    assert sorted(report["prompt_ids"]) == sorted(wanted)
    ex = report["exact_forward"]
    assert ex["proven"] and ex["proof"]["unequal"] == 0, ex
    (m,) = report["methods"]
    ll = m["lossless"]
    # the verdict is the exact pass's; the fast pass may round a near-tie otherwise (a numerical divergence, reported
    # with the target's top-2 margin there, which must then be a near-tie in this dtype's rounding)
    assert {k: ll[k] for k in ("checked", "mismatches", "exact", "pass")} == \
        {"checked": 4, "mismatches": [], "exact": True, "pass": "exact"}, ll
    assert all(d["margin"] <= 0.25 for d in ll["divergences"]), ll["divergences"]
