"""α/τ aggregation, speed-up formulas and the recommendation."""

from __future__ import annotations

import math

import pytest

from specheads.acceptance_math import chain_tau, leviathan_speedup
from specheads.decoding.generate import RowStats
from specheads.evaluation.metrics import (Run, Summary, by_domain, gpu_speedup, speedup, speedup_paired,
                                         speedup_spread, timed)
from specheads.evaluation.recommend import recommend


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


def test_gpu_speedup_is_the_shared_formula():
    assert gpu_speedup(3.0, 0.5, 2) == 1.5
    assert gpu_speedup(None, 0.5, 2) is None


def test_speedup_is_per_token_time_ratio():
    plain, spec = by_domain([_run("a", [], [], 10, 10, t=2.0)])["all"], by_domain([_run("a", [4], [3], 4, 10, 1.0)])["all"]
    assert math.isclose(speedup(plain, spec), 2.0)


def _s(tokens, seconds):
    return Summary(new_tokens=tokens, decode_time=seconds)


def test_timed_passes_give_median_and_range():
    """Issue 12.4: speeds are the median over timed passes with their range; the speed-up is median
    plain time per token ÷ median speculative time per token, with the range over all pass pairs."""
    plain = [_s(100, 2.0), _s(100, 2.2), _s(100, 1.9)]  # 50, 45.5, 52.6 tok/s
    spec = [_s(100, 1.0), _s(100, 0.9), _s(100, 1.3)]
    t = timed(spec)
    assert t["tokens_per_s"] == pytest.approx(100.0) and t["timed_passes"] == 3
    assert t["tokens_per_s_range"] == pytest.approx([100 / 1.3, 100 / 0.9])
    sp = speedup_spread(plain, spec)
    assert sp["speedup"] == pytest.approx(2.0 / 1.0)
    assert sp["speedup_range"] == pytest.approx([1.9 / 1.3, 2.2 / 0.9])
    assert sp["speedup_range"][0] <= sp["speedup"] <= sp["speedup_range"][1]
    assert speedup_spread([], spec) == {"speedup": None, "speedup_range": None}
    assert speedup_spread([_s(10, 1.0)], [_s(10, 0.5)])["speedup_range"] == pytest.approx([2.0, 2.0])


def test_paired_speedup_is_the_median_of_per_pass_ratios():
    """Issue 13: pass k's plain and speculative decodes saw the same moment of the machine; a pass
    where both ran 3x slower leaves its ratio unchanged (the unpaired spread would not)."""
    plain = [_s(100, 2.0), _s(100, 6.0), _s(100, 2.2)]
    spec = [_s(100, 1.0), _s(100, 3.0), _s(100, 1.0)]  # ratios 2.0, 2.0, 2.2
    sp = speedup_paired(plain, spec)
    assert sp["speedup"] == pytest.approx(2.0) and sp["speedup_range"] == pytest.approx([2.0, 2.2])
    assert speedup_spread(plain, spec)["speedup_range"][0] == pytest.approx(2.0 / 3.0)
    assert speedup_paired([_s(0, 0.0)], [_s(10, 1.0)]) == {"speedup": None, "speedup_range": None}
    with pytest.raises(ValueError, match="2 plain vs 1 speculative"):
        speedup_paired(plain[:2], spec[:1])


def _report(shape, row, drafter="eagle3", plain_T=None):
    plain = {"all": {"target_forwards": row["target_forwards"], "target_time_s": row["target_time_s"]}}
    rep = {"plain": plain, "methods": [{"name": "m", "shape": shape, "drafter": drafter, "c_gpu": 0.01,
                                        "by_temperature": {"0.0": {"all": row}}}]}
    if plain_T is not None:
        rep["plain_by_temperature"] = {"0.0": plain_T}
    return rep


def _row(steps, tested, accepted, nodes, tau, speedup=1.5):
    return {"tested": tested, "accepted": accepted, "nodes_by_depth": nodes, "target_forwards": steps,
            "target_time_s": 1.0, "tau": tau, "alpha": sum(accepted) / sum(tested), "cost_ratio_c": 0.1,
            "draft_forwards_per_step": float(len(nodes)), "speedup": speedup, "speedup_range": [1.4, 1.6]}


def test_recommend_chains_only_within_the_measured_length():
    """Issue 12.5: a chain of 3 is recommended a length in 1..3 (the old code reused the last α up
    to K = 8), its τ predictions are 1 + Σ P(L ≥ j) with P(L ≥ j) = accepted_j / steps, and the
    prediction at K = 3 is shown beside the measured τ and speed-up."""
    row = _row(10, [10, 8, 5], [8, 5, 2], [10, 10, 10], tau=2.5)
    rec = recommend(_report("chain3", row), ks=(1, 2, 4, 8))["m"]["0.0"]["all"]
    assert rec["kind"] == "chain" and rec["measured_depth"] == 3
    assert [p["k"] for p in rec["predictions"]] == [1, 2, 3]  # 4 and 8 were never drafted; 3 ran
    assert rec["predictions"][1]["tau_pred"] == pytest.approx(1 + 0.8 + 0.5)
    assert rec["predicted_tau"] == pytest.approx(chain_tau([0.8, 0.5, 0.2], "joint")) == pytest.approx(2.5)
    assert rec["measured_tau"] == 2.5 and rec["measured_speedup"] == 1.5
    assert rec["measured_speedup_range"] == [1.4, 1.6]
    assert rec["best_k_gpu"] in (1, 2, 3) and rec["best_k_cpu"] in (1, 2, 3)
    # chain lengths scale the draft forwards (one per draft), Leviathan's closed form shown beside
    assert rec["predictions"][0]["draft_forwards_per_step"] == pytest.approx(1.0)
    assert rec["predictions"][0]["leviathan_gpu"] == pytest.approx(leviathan_speedup(row["alpha"], 0.01, 1))


def test_recommend_trees_by_depth_from_acceptance_per_step():
    """Issue 12.5: a tree row is recommended a depth with its token budget, from P(L ≥ d) =
    accepted_d / steps. Per-depth α of a tree (accepted ÷ tested, where a step reaches depth d only
    below an accepted node that has children) multiplied out overstates τ; it is not used."""
    # 10 steps of a depth-3 tree with 4+3+2 nodes: depth 1 accepted 9 times, but only 6 of those
    # nodes had children; depth 2 accepted 5 of 6, depth 3 accepted 1 of 2.
    row = _row(10, [10, 6, 2], [9, 5, 1], [40, 30, 20], tau=2.5)
    rec = recommend(_report("tree(d3,k2,n9)", row), ks=(1, 2, 3, 4, 5, 6, 8))["m"]["0.0"]["all"]
    assert rec["kind"] == "tree" and [p["k"] for p in rec["predictions"]] == [1, 2, 3]
    taus = [p["tau_pred"] for p in rec["predictions"]]
    assert taus == pytest.approx([1.9, 2.4, 2.5])
    product = 1 + 0.9 + 0.9 * 5 / 6 + 0.9 * 5 / 6 * 0.5
    assert product > taus[-1] + 0.3  # what multiplying per-depth α would have claimed
    assert [p["tokens_per_step"] for p in rec["predictions"]] == pytest.approx([4.0, 7.0, 9.0])
    assert rec["predicted_tau"] == pytest.approx(rec["measured_tau"])
    # Medusa drafts every depth in one forward: cutting the tree does not cut the draft forwards
    med = recommend(_report("static(9)", dict(row, draft_forwards_per_step=1.0), drafter="medusa"))["m"]["0.0"]["all"]
    assert {p["draft_forwards_per_step"] for p in med["predictions"]} == {1.0}


def test_recommend_verify_cost_uses_plain_at_the_same_temperature():
    row = _row(10, [10], [5], [10], tau=1.5)
    plain_T = {"all": {"target_forwards": 10, "target_time_s": 0.5}}
    rec = recommend(_report("chain1", row, plain_T=plain_T))["m"]["0.0"]["all"]
    assert rec["verify_cost_cpu"] == pytest.approx(2.0)
