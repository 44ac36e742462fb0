"""Choosing a head's chain length from this machine's verify cost curve and held-out acceptance."""

from __future__ import annotations

import json

import pytest

from specheads.evaluation.shape_choice import choose_chain, measured_reach


def test_choose_chain_trades_acceptance_for_verify_cost():
    reach = [0.5, 0.2, 0.05]
    cpu = {1: 0.05, 2: 0.055, 3: 0.06, 4: 0.08}  # seconds: v = 1, 1.1, 1.2, 1.6
    ch = choose_chain(reach, cpu, c=0.05)
    got = {p["k"]: p["speedup"] for p in ch["predictions"]}
    assert got == pytest.approx({1: 1.5 / 1.15, 2: 1.7 / 1.3, 3: 1.75 / 1.75})
    assert ch["k"] == 2 and ch["verify_cost_curve"]["4"] == pytest.approx(1.6)
    # A flat (GPU-like) curve and a cheap drafter: the longest chain measured wins.
    flat = choose_chain([0.8, 0.6, 0.45], {n: 0.01 for n in range(1, 5)}, c=0.02)
    assert flat["k"] == 3
    # A steep curve: one draft only.
    assert choose_chain(reach, {1: 1.0, 2: 1.1, 3: 1.8, 4: 2.5}, c=0.05)["k"] == 1
    assert choose_chain([], {1: 1.0}, c=0.05)["k"] is None


def test_measured_reach_reads_the_training_summary(tmp_path):
    (tmp_path / "head").mkdir()
    (tmp_path / "train_summary.json").write_text(json.dumps({"eval": {"measured_reach1": 0.4,
                                                                        "measured_reach2": 0.1}}))
    assert measured_reach(str(tmp_path / "head")) == [0.4, 0.1]
    assert measured_reach(str(tmp_path / "a" / "nowhere")) == [] and measured_reach(None) == []
