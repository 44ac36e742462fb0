"""A head trained here, served by vLLM's CPU build: greedy output identical to plain decoding, the engine's
acceptance per position equal to the evaluator's chain measurement within sampling noise, and a planted broken
head (its weights shuffled) caught by the same comparison.

Tolerance: a difference is flagged beyond 3 standard errors of the difference (``serve_eval.compare``: binomial
per position, τ's from each side's accepted-length distribution). Both sides decode the same prompts greedily, so
their drafts differ only where float32 kernels tip a near-tie."""

from __future__ import annotations

import pytest

from tests.engine.conftest import assert_accepts_as_evaluated, evaluator_comparison, serve_eval

# one worker runs both, so the session fixtures (a trained head, its evaluation) are built once
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]


def test_served_head_is_lossless_and_accepts_as_the_evaluator_measured(work, exported, eval_report):
    report = serve_eval(work, exported, "serve", f"eval_report={eval_report}")
    every = report["domains"]["all"]
    assert every["identical"] == every["compared"] == report["num_prompts"] == 9
    assert every["spec"]["drafts"] > 0
    assert every["spec"]["reach"][0] > 0.05, ("the head accepts too few drafts to compare (a short training?): "
                                              f"give SPECHEADS_ENGINE_HEAD=<a trained head>; {every['spec']}")
    row = evaluator_comparison(report)
    assert row["evaluator_steps"] > 100 and row["engine_drafts"] > 100
    assert_accepts_as_evaluated(row)
    assert report["engine"]["env"]["LD_PRELOAD"].split(":")[0].endswith("libiomp5.so")


def test_a_shuffled_head_is_caught(work, shuffled, eval_report):
    report = serve_eval(work, shuffled, "serve-shuffled", f"eval_report={eval_report}", "plain=false")
    row = evaluator_comparison(report)
    assert row["tau_flagged"] and row["positions"][0]["flagged"], row
    assert row["tau_engine"] < row["tau_evaluator"]
