"""The evaluation's two passes (``specheads/evaluation/passes.py``): speed in the fast kernels, the lossless verdict
from the exact pass; a fast-pass difference at a near tie is a numerical divergence, an exact-pass one a failure."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_tiny_model
from specheads.decoding.drafters import TreeShape
from specheads.decoding.exact import ATTENTION_NAME, row_floor_is_on
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.report import write_report
from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate
from specheads.targets import Target

TOKEN, RUNNER_UP = 100, 200  # the target's greedy token everywhere, and the one a hair below it
GAP = 2.0 ** -20  # their logit gap: a few float32 ulps at 5.0


@pytest.fixture
def near_tie(smollm2_tokenizer):
    """A tiny target whose final norm is zeroed and whose LM head's bias puts TOKEN GAP above RUNNER_UP: every
    position is a near tie, greedy decoding emits TOKEN."""
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[TOKEN] = 5.0
        head.bias[RUNNER_UP] = 5.0 - GAP
        model.model.norm.weight.zero_()
    model.lm_head = head
    return Target(model, smollm2_tokenizer, name="tiny-near-tie")


def _plant(model, fast_only: bool):
    """Kernels whose forwards over several tokens round the runner-up 2·GAP higher than one-token forwards do (a
    verify forward differs, a plain decode's does not): in the fast kernels only, or in every kernel."""
    def hook(module, args, out):
        rows = args[0].reshape(-1, args[0].shape[-1]).shape[0]
        if rows > 1 and not (fast_only and model.config._attn_implementation == ATTENTION_NAME):
            out = out.clone()
            out[..., RUNNER_UP] += 2 * GAP
        return out
    return model.lm_head.register_forward_hook(hook)


def _evaluate(target, monkeypatch, exact_forward="auto", **kw):
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "coding"][:2])
    spec = BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=0, chat=0)
    methods = [MethodSpec("ee", "early_exit", TreeShape("chain", k=2), early_exit_layers=1)]
    return evaluate(target, EvalConfig(methods, spec, max_new_tokens=4, temperatures=(0.0,), batch_sizes=(1,),
                                       repeats=1, exact_forward=exact_forward, cpu_linears="plain", cpu_threads=1,
                                       **kw))


def test_a_fast_pass_difference_at_a_near_tie_is_a_numerical_divergence_the_exact_pass_judges(near_tie, monkeypatch,
                                                                                             tmp_path):
    """Planted: the fast kernels flip the near tie in verify forwards. The fast pass's greedy output differs from
    the fast plain output on every prompt; the exact pass is identical to its reference, so the row is lossless
    exact, each prompt's difference listed as a numerical divergence with the target's top-2 margin (GAP)."""
    handle = _plant(near_tie.model, fast_only=True)
    try:
        report = _evaluate(near_tie, monkeypatch)
    finally:
        handle.remove()
    ll = report["methods"][0]["lossless"]
    assert ll["pass"] == "exact" and ll["exact"] and ll["mismatches"] == [] and ll["checked"] == 2
    assert [d["prompt"] for d in ll["divergences"]] == report["prompt_ids"]
    for d in ll["divergences"]:
        assert (d["index"], d["plain"], d["speculative"]) == (0, TOKEN, RUNNER_UP)
        assert 0 < d["margin"] < 1e-5  # the target's top-2 margin there: a near tie, not a wrong verifier
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| exact (2 numerical divergences in the fast pass) |" in md.split("## Summary")[1]
    assert "Numerical divergence in the fast pass (2 of 2 prompts" in md
    assert "Lossless check (exact pass: greedy vs plain greedy, both in exact forwards, 2 prompts): exact" in md


def test_an_exact_pass_difference_is_a_lossless_failure(near_tie, monkeypatch, tmp_path):
    """Planted after the proof: every kernel flips the near tie in verify forwards, the exact forwards too. The exact
    pass differs from its reference on every prompt: a failure, never a divergence."""
    import specheads.evaluation.suite as suite

    handles = []
    real_settle = suite.settle_exact
    monkeypatch.setattr(suite, "settle_exact", lambda model, *a, **k: (real_settle(model, *a, **k),
                                                                       handles.append(_plant(model, False)))[0])
    try:
        report = _evaluate(near_tie, monkeypatch)
    finally:
        for h in handles:
            h.remove()
    ll = report["methods"][0]["lossless"]
    assert ll["pass"] == "exact" and not ll["exact"] and ll["divergences"] == []
    assert [m["prompt"] for m in ll["mismatches"]] == report["prompt_ids"]
    assert all((m["index"], m["speculative"]) == (0, RUNNER_UP) for m in ll["mismatches"])
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| 2 mismatches |" in md.split("## Summary")[1] and "2 MISMATCHES" in md


def test_without_an_exact_pass_the_fast_pass_judges_and_the_report_says_so(near_tie, monkeypatch, tmp_path):
    """exact_forward=off: no exact pass; the fast pass's difference is the verdict's (a mismatch, its margin beside
    it) and the lossless column says it is the fast pass's alone."""
    handle = _plant(near_tie.model, fast_only=True)
    try:
        report = _evaluate(near_tie, monkeypatch, exact_forward="off")
    finally:
        handle.remove()
    assert report["passes"]["exact"] is None and report["passes"]["figures"]["lossless"] == "fast"
    ll = report["methods"][0]["lossless"]
    assert ll["pass"] == "fast" and not ll["exact"] and len(ll["mismatches"]) == 2 and ll["divergences"] == []
    assert all(m["margin"] < 1e-5 for m in ll["mismatches"])
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| lossless (fast pass only) |" in md and "Lossless check (fast pass only" in md


def test_speed_is_timed_in_the_fast_kernels_and_each_column_names_its_pass(smollm2_tokenizer, monkeypatch, tmp_path):
    """Every decode the evaluator times (plain and speculative) runs on the target's own attention with the row
    floor lifted; the exact pass's decodes run in exact forwards; report.json and report.md name the pass of each
    figure."""
    import specheads.evaluation.passes as passes
    import specheads.evaluation.suite as suite

    target = Target(make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0), smollm2_tokenizer,
                    name="tiny")
    seen = {"suite": [], "passes": []}

    def recording(where, real):
        def generate(runner, drafter, *a, **k):
            m = runner.model
            seen[where].append((drafter is not None, m.config._attn_implementation, row_floor_is_on(m)))
            return real(runner, drafter, *a, **k)
        return generate

    monkeypatch.setattr(suite, "speculative_generate", recording("suite", suite.speculative_generate))
    monkeypatch.setattr(passes, "speculative_generate", recording("passes", passes.speculative_generate))
    report = _evaluate(target, monkeypatch)
    assert {(a, f) for _, a, f in seen["suite"]} == {("eager", False)}  # plain and speculative, timed and warm-ups
    assert {s for s, _, _ in seen["suite"]} == {True, False}
    assert {(s, a, f) for s, a, f in seen["passes"]} == {(False, ATTENTION_NAME, True), (True, ATTENTION_NAME, True)}
    assert sum(s for s, _, _ in seen["passes"]) == 2  # the row's exact pass: one decode per prompt, untimed
    assert report["exact_forward"]["row_floor"] >= 1 and report["exact_forward"]["proven"]
    figures = report["passes"]["figures"]
    assert figures["speedup"] == figures["tau"] == figures["verify_cost_curve"] == "fast"
    assert figures["lossless"] == "exact" and report["passes"]["fast"]["attention"] == "eager"
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["passes"] == report["passes"]
    md = (tmp_path / "report.md").read_text()
    header = next(line for line in md.split("## Summary")[1].splitlines() if line.startswith("| method"))
    assert "speed-up (CPU, fast pass, T=0.0)" in header and "lossless (exact pass)" in header
    assert "**Fast pass** (timed)" in md and "**Exact pass** (untimed, T=0)" in md
