"""α/τ aggregation, speed-up formulas and the recommendation."""

from __future__ import annotations

import math

from specheads.decoding.generate import RowStats
from specheads.evaluation.metrics import (Run, by_domain, expected_tokens, gpu_speedup, leviathan_speedup,
                                          speedup)
from specheads.evaluation.recommend import predict_chain, recommend


def _run(domain, tested, accepted, steps, emitted, t=1.0):
    s = RowStats(steps=steps, emitted=emitted, tested=tested, accepted=accepted, draft_forwards=steps * 2)
    return Run("p", domain, s, emitted, t, t / 2, t / 4)


def test_alpha_tau_per_domain_and_overall():
    runs = [_run("a", [10, 6], [6, 3], 10, 19), _run("b", [5], [1], 5, 6)]
    d = by_domain(runs)
    assert math.isclose(d["a"].alpha, 9 / 16) and d["a"].alpha_by_position == [0.6, 0.5]
    assert math.isclose(d["all"].alpha, 10 / 21)
    assert math.isclose(d["all"].tau, 25 / 15)
    assert d["all"].tested == [15, 6]
    assert math.isclose(d["a"].cost_ratio, (0.25 / 20) / (0.5 / 10))


def test_leviathan_formulas_agree():
    a, c, k = 0.7, 0.1, 4
    assert math.isclose(expected_tokens([a], k), (1 - a ** (k + 1)) / (1 - a))
    assert math.isclose(leviathan_speedup(a, c, k), expected_tokens([a], k) / (1 + c * k))
    assert math.isclose(leviathan_speedup(1.0, 0.0, 3), 4.0)
    assert gpu_speedup(3.0, 0.5, 2) == 1.5


def test_speedup_is_per_token_time_ratio():
    plain, spec = by_domain([_run("a", [], [], 10, 10, t=2.0)])["all"], by_domain([_run("a", [4], [3], 4, 10, 1.0)])["all"]
    assert math.isclose(speedup(plain, spec), 2.0)


def test_recommend_picks_best_k():
    preds = predict_chain([0.9, 0.8, 0.5], 0.8, c_cpu=0.3, v_cpu=1.2, c_gpu=0.05, ks=(1, 2, 3, 4))
    assert [p["k"] for p in preds] == [1, 2, 3, 4]
    assert preds[1]["tau_pred"] == 1 + 0.9 + 0.72
    row = {"alpha_by_position": [0.9, 0.8], "alpha": 0.85, "cost_ratio_c": 0.0, "tau": 2.5, "speedup": 1.8,
           "target_forwards": 10, "target_time_s": 1.0}
    report = {"plain": {"all": {"target_forwards": 10, "target_time_s": 1.0}},
              "methods": [{"name": "m", "c_gpu": 0.0, "by_temperature": {"0.0": {"all": row}}}]}
    rec = recommend(report, ks=(1, 2, 4))["m"]["0.0"]["all"]
    assert rec["best_k_gpu"] == 4 and rec["verify_cost_cpu"] == 1.0 and rec["measured_tau"] == 2.5
