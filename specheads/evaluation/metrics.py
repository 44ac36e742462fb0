"""Acceptance metrics (Leviathan et al.) and speed figures, per domain and overall.

α: accepted ÷ (accepted + rejected) among draft tokens actually tested, overall and per draft
position (depth). τ: tokens emitted per target forward, bonus included. Both count only tokens that
reach the output (``RowStats``: a draft beyond ``max_new_tokens`` or EOS is neither accepted nor
rejected). c: draft cost per target forward (measured time on this machine; predicted from
parameters read for a GPU). The formulas live in ``specheads.acceptance_math``.

GPU model (stated in the report): batch-1 decoding is memory-bound, so a forward costs time in
proportion to the weights it reads, and verifying a tree of up to ~64 tokens costs about one
plain forward. Then speed-up_GPU = τ / (1 + c_GPU · F), with F the draft forwards per step and
c_GPU = draft parameters read per draft forward ÷ target parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.acceptance_math import speedup_from_tau
from specheads.decoding.generate import RowStats


@dataclass
class Run:
    """One request decoded by one method at one temperature."""

    prompt_id: str
    domain: str
    stats: RowStats
    new_tokens: int
    decode_time: float
    target_time: float
    draft_time: float
    verify_time: float = 0.0  # the accept/reject decisions (``GenerationResult.verify_time``)


@dataclass
class Summary:
    """Aggregated figures for a set of runs (a domain, or all)."""

    prompts: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    emitted: int = 0
    tested: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    decode_time: float = 0.0
    target_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    draft_forwards: int = 0
    nodes_by_depth: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float | None:
        t = sum(self.tested)
        return sum(self.accepted) / t if t else None

    @property
    def alpha_by_position(self) -> list[float | None]:
        return [a / t if t else None for a, t in zip(self.accepted, self.tested)]

    @property
    def tau(self) -> float | None:
        return self.emitted / self.target_forwards if self.target_forwards else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.decode_time if self.decode_time > 0 else None

    @property
    def cost_ratio_step(self) -> float | None:
        """Draft time per step ÷ target time per step (measured)."""
        return self.draft_time / self.target_time if self.target_time > 0 else None

    @property
    def cost_ratio(self) -> float | None:
        """Leviathan's c: time of one draft forward ÷ time of one target forward (measured)."""
        if not self.draft_forwards or self.target_time <= 0:
            return None
        return (self.draft_time / self.draft_forwards) / (self.target_time / self.target_forwards)

    @property
    def draft_forwards_per_step(self) -> float:
        return self.draft_forwards / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        return {"prompts": self.prompts, "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
                "alpha": self.alpha, "alpha_by_position": self.alpha_by_position, "tau": self.tau,
                "tested": self.tested, "accepted": self.accepted, "tokens_per_s": self.tokens_per_s,
                "decode_time_s": self.decode_time, "target_time_s": self.target_time,
                "draft_time_s": self.draft_time, "verify_time_s": self.verify_time, "cost_ratio_c": self.cost_ratio,
                "cost_ratio_step": self.cost_ratio_step, "draft_forwards_per_step": self.draft_forwards_per_step,
                "nodes_by_depth": self.nodes_by_depth}


def summarize(runs: list[Run]) -> Summary:
    s = Summary()
    for r in runs:
        s.prompts += 1
        s.new_tokens += r.new_tokens
        s.target_forwards += r.stats.steps
        s.emitted += r.stats.emitted
        s.decode_time += r.decode_time
        s.target_time += r.target_time
        s.draft_time += r.draft_time
        s.verify_time += r.verify_time
        s.draft_forwards += r.stats.draft_forwards
        _add_lists(s.nodes_by_depth, r.stats.nodes_by_depth)
        for d, (t, a) in enumerate(zip(r.stats.tested, r.stats.accepted)):
            while len(s.tested) <= d:
                s.tested.append(0); s.accepted.append(0)
            s.tested[d] += t
            s.accepted[d] += a
    return s


def _add_lists(into: list[int], more: list[int]) -> None:
    into.extend([0] * (len(more) - len(into)))
    for i, x in enumerate(more):
        into[i] += x


def by_domain(runs: list[Run]) -> dict[str, Summary]:
    """{domain: Summary} plus "all"."""
    domains = sorted({r.domain for r in runs})
    out = {d: summarize([r for r in runs if r.domain == d]) for d in domains}
    out["all"] = summarize(runs)
    return out


def speedup(plain: Summary, spec: Summary) -> float | None:
    """Wall-clock speed-up of decoding (prefill excluded) over plain decoding of the same prompts."""
    if not spec.decode_time or not plain.decode_time:
        return None
    return (plain.decode_time / max(plain.new_tokens, 1)) / (spec.decode_time / max(spec.new_tokens, 1))


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _time_per_token(s: Summary) -> float | None:
    return s.decode_time / max(s.new_tokens, 1) if s.decode_time > 0 else None


def timed(passes: list[Summary]) -> dict:
    """Decode speed over repeated timed passes of the same prompts: median tokens/s, its range."""
    tps = [s.tokens_per_s for s in passes if s.tokens_per_s is not None]
    if not tps:
        return {"tokens_per_s": None, "tokens_per_s_range": None, "timed_passes": 0}
    return {"tokens_per_s": _median(tps), "tokens_per_s_range": [min(tps), max(tps)], "timed_passes": len(tps)}


def speedup_spread(plain: list[Summary], spec: list[Summary]) -> dict:
    """Speed-up from repeated timed passes: median plain time per token ÷ median speculative time per
    token, with its range over every (plain pass, speculative pass) pair: [slowest speculative vs
    fastest plain, fastest speculative vs slowest plain]."""
    p = [t for t in map(_time_per_token, plain) if t is not None]
    s = [t for t in map(_time_per_token, spec) if t is not None]
    if not p or not s:
        return {"speedup": None, "speedup_range": None}
    return {"speedup": _median(p) / _median(s), "speedup_range": [min(p) / max(s), max(p) / min(s)]}


def speedup_paired(plain: list[Summary], spec: list[Summary]) -> dict:
    """Speed-up from paired passes: pass k decoded each prompt plainly right before decoding it
    speculatively, so both halves of a pair saw the same moment of a noisy machine. The speed-up is
    the median over passes of plain time per token ÷ speculative time per token, its range the
    smallest and largest of those per-pass ratios."""
    if len(plain) != len(spec):
        raise ValueError(f"paired passes: {len(plain)} plain vs {len(spec)} speculative")
    ratios = [p / s for p, s in zip(map(_time_per_token, plain), map(_time_per_token, spec))
              if p is not None and s is not None]
    if not ratios:
        return {"speedup": None, "speedup_range": None}
    return {"speedup": _median(ratios), "speedup_range": [min(ratios), max(ratios)]}


def gpu_speedup(tau: float | None, c_gpu: float, forwards_per_step: float) -> float | None:
    """Predicted memory-bound speed-up τ / (1 + c_GPU · F) (see the module docstring)."""
    if tau is None:
        return None
    return speedup_from_tau(tau, c_gpu * forwards_per_step)
