"""Report figures derived from a method's timed rows."""

from __future__ import annotations

from specheads.evaluation.report import _step_cost_md


def test_step_cost_splits_a_step_into_verify_draft_decisions_and_the_rest_in_plain_steps():
    # 10 steps; plain decoding at 20 tokens/s = 50 ms a token; a step: 60 ms verify forward, 5 ms draft, 1.5 ms
    # accept/reject decisions, 1 ms rest.
    row = {"target_forwards": 10, "paired_plain_tokens_per_s": 20.0, "decode_time_s": 0.675,
           "target_time_s": 0.6, "draft_time_s": 0.05, "verify_time_s": 0.015, "tau": 1.62}
    choice = {"label": "fan3", "c": 0.05, "predictions": [
        {"label": "fan2", "verify_cost": 1.1, "draft_forwards": 1, "speedup": 1.2},
        {"label": "fan3", "verify_cost": 1.15, "draft_forwards": 1, "speedup": 1.35}]}
    line = _step_cost_md(row, "0.0", choice)[0]
    assert "plain decoding steps of 50.0 ms" in line
    assert ("verify forward 1.20, drafting 0.10, accept/reject decisions 0.03, the rest of the loop (cache pruning, "
            "feeding the drafter) 0.02") in line
    assert "τ 1.62 ÷ 1.35 = 1.20" in line
    assert "predicted verify 1.15 and drafting 0.05 from its cost curve: 1.35" in line
    assert "predicted for fan3 alone (no lookup branch) verify" in _step_cost_md(row, "0.0", choice, branch=True)[0]
    assert _step_cost_md({**row, "paired_plain_tokens_per_s": None}, "0.0", None) == []  # unpaired: no unit
