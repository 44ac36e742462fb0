"""A serving engine's counters, read from Prometheus text (vLLM's ``/metrics``, or its in-process registry) and
differenced around the requests being measured.

vLLM 0.32 (``vllm/v1/spec_decode/metrics.py``, ``vllm/v1/metrics/loggers.py``) counts, per engine:
``vllm:spec_decode_num_drafts_total`` (drafting steps), ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="j"}``, beside
``vllm:generation_tokens_total`` and the histograms ``vllm:request_decode_time_seconds`` (first to last token
of a request) and ``vllm:time_to_first_token_seconds``. Samples of one name are summed over their labels
(engines, model names), except ``position``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specheads.errors import UserError

PREFIX = "vllm:spec_decode_"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted (label, value) pairs: value}}`` of Prometheus text exposition; comments,
    blank lines and ``*_created`` samples are skipped. Raises ``ValueError`` on a line that is no sample."""
    out: dict[str, dict[tuple, float]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            raise ValueError(f"line {n} is not a Prometheus sample: {line[:120]!r}")
        name, labels, value = m.groups()
        if name.endswith("_created"):
            continue
        key = tuple(sorted(LABEL.findall(labels or "")))
        out.setdefault(name, {})[key] = float(value)
    return out


@dataclass
class EngineCounters:
    """The counters that measure speculative decoding and decode time, summed over engines."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    generation_tokens: int = 0
    requests: int = 0           # requests the decode-time histogram observed
    decode_seconds: float = 0.0  # Σ over requests of first-to-last-token time
    ttft_seconds: float = 0.0    # Σ over requests of the time to the first token

    def __sub__(self, before: "EngineCounters") -> "EngineCounters":
        if self.drafts < before.drafts or self.generation_tokens < before.generation_tokens:
            raise UserError("the engine's counters went down between two reads (was the server restarted?); "
                            "measure again")
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pos = [_at(self.accepted_per_pos, j) - _at(before.accepted_per_pos, j) for j in range(width)]
        return EngineCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                              self.accepted - before.accepted, pos, self.generation_tokens - before.generation_tokens,
                              self.requests - before.requests, self.decode_seconds - before.decode_seconds,
                              self.ttft_seconds - before.ttft_seconds)

    def __add__(self, other: "EngineCounters") -> "EngineCounters":
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pos = [_at(self.accepted_per_pos, j) + _at(other.accepted_per_pos, j) for j in range(width)]
        return EngineCounters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                              self.accepted + other.accepted, pos, self.generation_tokens + other.generation_tokens,
                              self.requests + other.requests, self.decode_seconds + other.decode_seconds,
                              self.ttft_seconds + other.ttft_seconds)

    def to_dict(self) -> dict:
        return dict(vars(self))


def _at(values: list[int], j: int) -> int:
    return values[j] if j < len(values) else 0


def _total(samples: dict[str, dict[tuple, float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


def read_counters(text: str) -> EngineCounters:
    """The ``EngineCounters`` in one read of Prometheus text (a server's ``/metrics``). A server started
    without speculative decoding has no ``vllm:spec_decode_*`` samples: its draft counts are 0."""
    samples = parse_prometheus(text)
    by_pos: dict[int, float] = {}
    for labels, value in samples.get(PREFIX + "num_accepted_tokens_per_pos_total", {}).items():
        position = dict(labels).get("position")
        if position is not None:
            by_pos[int(position)] = by_pos.get(int(position), 0.0) + value
    pos = [int(by_pos.get(j, 0)) for j in range(max(by_pos) + 1)] if by_pos else []
    return EngineCounters(drafts=int(_total(samples, PREFIX + "num_drafts_total")),
                          draft_tokens=int(_total(samples, PREFIX + "num_draft_tokens_total")),
                          accepted=int(_total(samples, PREFIX + "num_accepted_tokens_total")),
                          accepted_per_pos=pos,
                          generation_tokens=int(_total(samples, "vllm:generation_tokens_total")),
                          requests=int(_total(samples, "vllm:request_decode_time_seconds_count")),
                          decode_seconds=_total(samples, "vllm:request_decode_time_seconds_sum"),
                          ttft_seconds=_total(samples, "vllm:time_to_first_token_seconds_sum"))


def counters_between(before: str, after: str) -> EngineCounters:
    """What the engine counted between two reads of its Prometheus text."""
    return read_counters(after) - read_counters(before)
