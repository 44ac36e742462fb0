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


def _choice(speedups: dict[str, float], v2: float) -> dict:
    preds = [{"label": k, "kind": "fan", "k": 2, "tau": 1.5, "verify_cost": v2, "draft_forwards": 1, "speedup": s}
             for k, s in speedups.items()]
    best = max(preds, key=lambda p: p["speedup"])
    return {"label": best["label"], "kind": "fan", "k": 2, "predictions": preds, "c": 0.06,
            "verify_cost_curve": {"1": 1.9, "2": v2}, "plain_forward_s": 0.063, "plain_unit": "plain",
            "verify_cost_measured": {"1": 1.9, "2": v2}, "reach": [0.5], "fans": {"2": 1.5}}


def test_the_shape_choice_says_plainly_when_no_shape_is_predicted_faster_than_plain_decoding():
    """The AVX2-held run: float32's row floor of 16 made every verify forward cost about two plain ones, and
    the best shape was predicted at 0.76x; the report must say so, not just list the figures."""
    from specheads.evaluation.report import _shape_choice_md

    slow = _shape_choice_md(_choice({"fan2": 0.71, "fan6": 0.76}, 1.95))[0]
    assert "No shape is predicted faster than plain decoding on this machine" in slow
    assert "fan6, at 0.76×" in slow and "a verify forward of 2 tokens costs 1.95 plain forwards" in slow
    fast = _shape_choice_md(_choice({"fan2": 0.97, "fan6": 1.35}, 1.02))[0]
    assert "No shape is predicted faster" not in fast


def test_the_precision_line_names_the_form_a_kind_decodes_in():
    from specheads.evaluation.report import _floor_md

    ex = {"attention": "specheads_exact", "row_floor": 2, "row_chunk": 32,
          "row_form": {"Linear 576x576 float32": "xwt", "Linear 1536x576 float32": "linear"},
          "one_token_ms": {"floored": 60.6, "lifted": 46.9}, "proof": {"nodes": 11, "unequal": 0}, "proven": True}
    line = _floor_md(ex)
    assert "computed as x·Wᵀ against a contiguous copy of Wᵀ: Linear 576x576 float32" in line
    assert "Linear 1536x576" not in line.split("computed as")[1]
