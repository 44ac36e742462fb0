"""Choosing a head's chain length from this machine's verify cost curve and held-out acceptance."""

from __future__ import annotations

import json

import pytest

from specheads.evaluation.shape_choice import choose_shape, measured_fans, measured_reach, monotone_curve


def test_choose_chain_trades_acceptance_for_verify_cost():
    reach = [0.5, 0.2, 0.05]
    cpu = {1: 0.05, 2: 0.055, 3: 0.06, 4: 0.08}  # seconds: v = 1, 1.1, 1.2, 1.6
    ch = choose_shape(reach, cpu, c=0.05)
    got = {p["k"]: p["speedup"] for p in ch["predictions"]}
    assert got == pytest.approx({1: 1.5 / 1.15, 2: 1.7 / 1.3, 3: 1.75 / 1.75})
    assert ch["k"] == 2 and ch["verify_cost_curve"]["4"] == pytest.approx(1.6)
    # A flat (GPU-like) curve and a cheap drafter: the longest chain measured wins.
    flat = choose_shape([0.8, 0.6, 0.45], {n: 0.01 for n in range(1, 5)}, c=0.02)
    assert flat["k"] == 3
    # A steep curve: one draft only.
    assert choose_shape(reach, {1: 1.0, 2: 1.1, 3: 1.8, 4: 2.5}, c=0.05)["k"] == 1
    assert choose_shape([], {1: 1.0}, c=0.05)["k"] is None


def test_choose_shape_weighs_fans_against_chains():
    reach = [0.35, 0.05]
    cpu = {1: 1.0, 2: 1.09, 3: 1.11, 4: 1.46}
    ch = choose_shape(reach, cpu, c=0.08, fans={2: 1.45, 3: 1.53})
    got = {p["label"]: p["speedup"] for p in ch["predictions"]}
    # A fan of w: one draft forward, w + 1 tokens verified, its measured τ.
    assert got == pytest.approx({"chain1": 1.35 / 1.17, "chain2": 1.4 / 1.27, "fan2": 1.45 / 1.19,
                                 "fan3": 1.53 / 1.54})
    assert (ch["label"], ch["kind"], ch["k"]) == ("fan2", "fan", 2) and ch["fans"] == {"2": 1.45, "3": 1.53}
    # A fan no better than the chain's first draft loses to it.
    assert choose_shape(reach, cpu, c=0.08, fans={2: 1.36})["label"] == "chain1"
    # A fan whose verify cost was not measured is not a candidate.
    assert [p["label"] for p in choose_shape(reach, {1: 1.0, 2: 1.1, 3: 1.2}, 0.08, {3: 2.0})["predictions"]] == \
        ["chain1", "chain2"]


def test_a_dipping_cost_curve_is_pooled_before_the_choice(monkeypatch):
    # A forward over more tokens never costs less: a dip is noise (one quickstart evaluation measured
    # v(2) 1.38, v(3) 1.27). Pooled with its neighbours, a blip at v(3) no longer makes the fan of 2
    # (3 tokens verified) look cheaper than the fan of 3 (4 tokens).
    assert monotone_curve({1: 1.0, 2: 1.38, 3: 1.27, 4: 1.45}) == pytest.approx({1: 1.0, 2: 1.325, 3: 1.325, 4: 1.45})
    assert monotone_curve({1: 3.0, 2: 1.0, 3: 2.0}) == pytest.approx({1: 2.0, 2: 2.0, 3: 2.0})
    assert monotone_curve({1: 1.0, 2: 1.1}) == {1: 1.0, 2: 1.1}
    measured = {1: 1.0, 2: 1.30, 3: 1.10, 4: 1.15}
    fans = {2: 1.45, 3: 1.50}
    ch = choose_shape([0.4, 0.05], measured, c=0.07, fans=fans)
    assert ch["label"] == "fan3"
    assert ch["verify_cost_curve"]["3"] == pytest.approx(3.55 / 3) and ch["verify_cost_measured"]["3"] == pytest.approx(1.10)
    # Read as measured, the dip would have picked the fan of 2 (1.45 / 1.17 > 1.50 / 1.22).
    import specheads.evaluation.shape_choice as shape_choice

    monkeypatch.setattr(shape_choice, "monotone_curve", lambda curve: dict(curve))
    assert choose_shape([0.4, 0.05], measured, c=0.07, fans=fans)["label"] == "fan2"


def test_measured_reach_reads_the_training_summary(tmp_path):
    (tmp_path / "head").mkdir()
    (tmp_path / "train_summary.json").write_text(json.dumps({"eval": {
        "measured_reach1": 0.4, "measured_reach2": 0.1, "measured_fan3_tau": 1.5, "measured_fan2_tau": 1.45,
        "measured_tau": 1.4}}))
    assert measured_reach(str(tmp_path / "head")) == [0.4, 0.1]
    assert measured_fans(str(tmp_path / "head")) == {2: 1.45, 3: 1.5}
    assert measured_reach(str(tmp_path / "a" / "nowhere")) == [] and measured_reach(None) == []
    assert measured_fans(None) == {}


def test_costs_are_in_plain_forwards_where_speculative_forwards_are_padded():
    """The main job's float32 target decoded speculatively at a row floor of 16 (a one-token verify forward
    109 ms) against plain one-token forwards of 46 ms: read in its own unit the curve was flat (v(9) 1.05) and
    predicted 1.53x for a fan of 8, where the decode loop measured 0.74x. In units of the plain forward the
    same curve costs v(1) = 2.37, and no shape is predicted faster than plain decoding."""
    curve = {n: 0.1089 * (1 + 0.006 * (n - 1)) for n in range(1, 10)}
    fans = {2: 1.53, 4: 1.60, 8: 1.65}
    alone = choose_shape([0.41, 0.05], curve, c=0.0034 / 0.1089, fans=fans)
    assert alone["predictions"][-1]["speedup"] > 1.5 and alone["plain_unit"] == "verify"
    plain = choose_shape([0.41, 0.05], curve, c=0.0034 / 0.046, fans=fans, plain_s=0.046)
    assert plain["verify_cost_curve"]["1"] == pytest.approx(0.1089 / 0.046) and plain["plain_unit"] == "plain"
    assert plain["plain_forward_s"] == 0.046 and plain["c"] == pytest.approx(0.0034 / 0.046)
    assert max(p["speedup"] for p in plain["predictions"]) < 0.8


def test_verify_costs_time_the_plain_forward_with_the_row_floor_lifted():
    """The curve's forwards run at the row floor, the plain one without it (on a tiny model padded to 32
    rows the floored one-token forward does the work of 32 rows)."""
    from tests.conftest import make_tiny_model
    from specheads.decoding.exact import apply_row_floor
    from specheads.decoding.runner import TargetRunner
    from specheads.evaluation.shape_choice import verify_costs

    model = make_tiny_model("llama", hidden=256, layers=2, vocab=4096)
    apply_row_floor(model, 32)
    seen = []
    inner = model.lm_head._specheads_row_floor["forward"]
    model.lm_head._specheads_row_floor["forward"] = lambda x: seen.append(x.shape[0]) or inner(x)
    curve, plain_s = verify_costs(TargetRunner(model), list(range(3, 40)), [1, 2], reps=2)
    assert set(curve) == {1, 2} and plain_s > 0
    rows = [n for n in seen if n < 30]
    assert rows and set(rows) == {1}  # the plain forwards: one row, unpadded
    assert seen.count(32) >= 2 * 3  # every curve forward (n = 1, 2; 3 rounds with the warm-up) padded to 32
