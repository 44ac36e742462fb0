"""The engine's Prometheus counters: parsed, summed over engines, differenced around a request."""

from __future__ import annotations

import pytest

from specheads.errors import UserError
from specheads.serving.counters import EngineCounters, counters_between, parse_prometheus, read_counters


def metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], generated: int, requests: int,
            decode_s: float, engines: int = 1) -> str:
    """Prometheus text as vLLM 0.32's /metrics writes it (HELP/TYPE lines, _created samples, labels)."""
    lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts counter"]
    for e in range(engines):
        lab = f'engine="{e}",model_name="/models/SmolLM2-135M-Instruct"'
        lines += [f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts / engines}",
                  f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.7962934911466045e+09",
                  f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {draft_tokens / engines}",
                  f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted / engines}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{j}"}} {a / engines}'
                  for j, a in enumerate(per_pos)]
        lines += [f"vllm:generation_tokens_total{{{lab}}} {generated / engines}",
                  f'vllm:request_decode_time_seconds_bucket{{{lab},le="+Inf"}} {requests / engines}',
                  f"vllm:request_decode_time_seconds_count{{{lab}}} {requests / engines}",
                  f"vllm:request_decode_time_seconds_sum{{{lab}}} {decode_s / engines}",
                  f"vllm:time_to_first_token_seconds_sum{{{lab}}} 0.5"]
    lines.append('vllm:num_requests_running{engine="0",model_name="m"} 0.0')
    return "\n".join(lines) + "\n"


def test_read_counters_sums_engines_and_keeps_positions():
    c = read_counters(metrics(10, 30, 12, [6, 4, 2], 40, 2, 3.0, engines=2))
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos) == (10, 30, 12, [6, 4, 2])
    assert (c.generation_tokens, c.requests, c.decode_seconds) == (40, 2, pytest.approx(3.0))
    assert c.ttft_seconds == pytest.approx(1.0)


def test_difference_around_a_request():
    before = metrics(10, 30, 12, [6, 4, 2], 40, 2, 3.0)
    after = metrics(18, 54, 20, [11, 6, 3], 60, 3, 4.5)
    d = counters_between(before, after)
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (8, 24, 8, [5, 2, 1])
    assert (d.generation_tokens, d.requests) == (20, 1) and d.decode_seconds == pytest.approx(1.5)
    assert (d + d).accepted_per_pos == [10, 4, 2] and (d + EngineCounters()).drafts == 8


def test_a_server_without_a_drafter_counts_no_drafts():
    plain = "\n".join(line for line in metrics(0, 0, 0, [], 30, 1, 2.0).splitlines() if "spec_decode" not in line)
    c = read_counters(plain)
    assert c.drafts == 0 and c.accepted_per_pos == [] and c.generation_tokens == 30


def test_counters_going_down_is_a_user_error():
    with pytest.raises(UserError, match="restarted"):
        counters_between(metrics(10, 30, 12, [6, 4, 2], 40, 2, 3.0), metrics(0, 0, 0, [0, 0, 0], 0, 0, 0.0))


def test_parse_skips_comments_and_created_and_rejects_garbage():
    samples = parse_prometheus('# TYPE x counter\nx_total{a="1"} 2\nx_created{a="1"} 5\n\ny 3 1700000000\n')
    assert samples == {"x_total": {(("a", "1"),): 2.0}, "y": {(): 3.0}}
    with pytest.raises(ValueError, match="line 1"):
        parse_prometheus("not a sample line at all {")
