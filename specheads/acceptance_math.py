"""Acceptance maths of speculative decoding, in one place: training, evaluation and recommendation
all import it (it imports nothing from specheads, so models, methods and training can use it alike).

Notation. A step drafts up to ``k`` tokens; the target verifies them in one forward and emits the
accepted prefix plus one token of its own (the bonus). ``L`` = accepted drafts in a step. Then

    τ = E[L + 1] = 1 + Σ_{j=1..k} P(L ≥ j)                                   (tokens per target forward)

and ``P(L ≥ j)`` can be given in three ways (``basis``):

- ``joint``: ``accs[j-1] = P(drafts 1..j all accepted) = P(L ≥ j)``. Exact. Held-out ``chain{i}_acc``
  (Medusa) / ``joint{i}_acc`` (EAGLE) are this, measured per position; so is
  ``accepted_j / steps`` of a real decoding run (chains and trees alike: a step accepts at most
  one node per depth).
- ``conditional``: ``accs[j-1] = P(draft j accepted | drafts 1..j-1 accepted)``, so
  ``P(L ≥ j) = Π_{i≤j} accs[i-1]``. Exact. A chain's per-position α (accepted ÷ tested at
  depth j) is this.
- ``marginal``: ``accs[j-1] = P(draft j right)`` on its own (teacher-forced, whatever happened
  before). Same product, but it assumes the drafts are right independently: an approximation
  (usually optimistic, since errors cluster).

With one α at every position (Leviathan et al. 2023, eq. 1) τ = (1 - α^(k+1)) / (1 - α), and with
a draft forward costing ``c`` target forwards the speed-up is τ / (1 + c·k) (Theorem 3.8).
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

BASES = ("joint", "conditional", "marginal")


def reach_probabilities(accs: Sequence[float], basis: str) -> list[float]:
    """``[P(L ≥ 1), ..., P(L ≥ k)]`` from per-draft accuracies given on ``basis`` (see the module)."""
    if basis not in BASES:
        raise ValueError(f"basis '{basis}': use one of {', '.join(BASES)}")
    if basis == "joint":
        return [float(a) for a in accs]
    out, run = [], 1.0
    for a in accs:
        run *= float(a)
        out.append(run)
    return out


def chain_tau(accs: Sequence[float], basis: str) -> float:
    """τ of a chain of ``len(accs)`` drafts: ``1 + Σ_j P(L ≥ j)``."""
    return 1.0 + sum(reach_probabilities(accs, basis))


def leviathan_tau(alpha: float, k: int) -> float:
    """τ of a chain of ``k`` with the same α at every position: (1 - α^(k+1)) / (1 - α)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_from_tau(tau: float, draft_cost_per_step: float, verify_cost: float = 1.0) -> float:
    """Speed-up over plain decoding when a step emits ``tau`` tokens and costs ``verify_cost`` plain
    forwards for verification plus ``draft_cost_per_step`` plain forwards of drafting."""
    return tau / (verify_cost + draft_cost_per_step)


def leviathan_speedup(alpha: float, c: float, k: int) -> float:
    """(1 - α^(k+1)) / ((1 - α)(c k + 1)), Leviathan et al. Theorem 3.8."""
    return speedup_from_tau(leviathan_tau(alpha, k), c * k)


# ------------------------------------------------------------------ estimates from held-out metrics

#: The one preference order of ``estimate_tau``: joint accuracies first (exact for a top-1 chain under
#: teacher forcing), then products of marginal top-1 accuracies (assume independent errors).
#: (metric name pattern, basis, label); ``{i}`` is the draft index from 0.
ESTIMATE_ORDER = (
    ("joint", r"joint(\d+)_(?:top1_)?acc", "joint",
     "EAGLE joint{i}: drafts 0..i all right at a position (the conditional acceptances multiplied out; exact)"),
    ("chain", r"chain(\d+)_(?:top1_)?acc", "joint",
     "Medusa chain{i}: drafts 0..i all right at a position (the conditional acceptances multiplied out; exact)"),
    ("step", r"step(\d+)_(?:top1_)?acc", "marginal", "product of marginal EAGLE step{i} top-1 accuracies"),
    ("head", r"head(\d+)_(?:top1_)?acc", "marginal", "product of marginal Medusa head{i} top-1 accuracies"),
)


def indexed(metrics: Mapping[str, float], pattern: str) -> list[float]:
    """Values of the keys matching ``pattern`` (one group: the index), in index order from 0, up to
    the first index that is missing or not a finite number (a draft with nothing measured)."""
    found = {int(m.group(1)): v for k, v in metrics.items() if (m := re.fullmatch(pattern, k))}
    out = []
    while len(out) in found and isinstance(found[len(out)], (int, float)) and math.isfinite(found[len(out)]):
        out.append(float(found[len(out)]))
    return out


def first_draft_accuracy(metrics: Mapping[str, float]) -> float | None:
    """The held-out top-1 accuracy of the first drafted token, whichever family reported it (EAGLE-style
    ``step0_acc``, Medusa's ``head0_top1_acc``); None when neither was measured."""
    for _, pattern, basis, _ in ESTIMATE_ORDER:
        if basis == "marginal" and (accs := indexed(metrics, pattern)):
            return accs[0]
    return None


def estimate_tau(metrics: Mapping[str, float], k: int | None = None) -> tuple[float | None, str]:
    """(τ, basis) a top-1 chain would reach, from summarized held-out accuracies.

    The first family of ``ESTIMATE_ORDER`` present is used (joint ``joint{i}_acc`` / ``chain{i}_acc``
    before marginal ``step{i}_acc`` / ``head{i}_top1_acc``); ``k`` limits the chain to its first
    ``k`` drafts (never more than were measured). (None, reason) when no family is present.
    """
    for name, pattern, basis, label in ESTIMATE_ORDER:
        accs = indexed(metrics, pattern)
        if accs:
            accs = accs[:k] if k is not None else accs
            return chain_tau(accs, basis), f"{name}: {label} ({basis}, {len(accs)} drafts)"
    return None, "no per-draft accuracies reported"


# ------------------------------------------------------------------ a serving engine's counters

def counter_figures(drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: Sequence[int]) -> dict:
    """Figures of a chain drafter from a serving engine's counters (vLLM's ``spec_decode_num_drafts``,
    ``_num_draft_tokens``, ``_num_accepted_tokens``, ``_num_accepted_tokens_per_pos``) over ``drafts``
    drafting steps, each verified by one target forward:

    - ``tau``: 1 + accepted ÷ drafts, tokens per drafting step (the engine's own figure);
    - ``reach``: accepted_per_pos[j] ÷ drafts = P(L ≥ j+1), the joint basis (a chain accepts position j only
      after 0..j-1), so ``chain_tau(reach, "joint") == tau``;
    - ``alpha``: accepted ÷ tested, where a chain's position j is tested when 0..j-1 were accepted (Leviathan's
      α, the evaluator's); ``alpha_by_position``: the conditional acceptance at each position;
    - ``draft_acceptance_rate``: accepted ÷ drafted (vLLM's "draft acceptance rate", every drafted token
      counted, tested or not).

    None figures when nothing was drafted."""
    pos = [int(x) for x in accepted_per_pos]
    tested = [drafts] + pos[:-1] if pos else []
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "accepted_per_pos": pos,
            "tau": 1.0 + accepted / drafts if drafts else None,
            "reach": [a / drafts for a in pos] if drafts else [None] * len(pos),
            "alpha": sum(pos) / sum(tested) if drafts and sum(tested) else None,
            "alpha_by_position": [a / t if t else None for a, t in zip(pos, tested)],
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None}


def accepted_length_variance(reach: Sequence[float]) -> float:
    """Var(L) of a chain's accepted length from its reach probabilities ``P(L ≥ j)`` (j = 1..k):
    E[L] = Σ_j P(L ≥ j), E[L²] = Σ_j (2j - 1) P(L ≥ j)."""
    mean = sum(reach)
    second = sum((2 * j - 1) * p for j, p in enumerate(reach, 1))
    return max(second - mean * mean, 0.0)


def tau_standard_error(reach: Sequence[float], steps: int) -> float | None:
    """The standard error of τ = 1 + mean accepted length over ``steps`` drafting steps, each step's L drawn
    from the distribution ``reach`` describes (steps treated as independent)."""
    return math.sqrt(accepted_length_variance(reach) / steps) if steps else None


def proportion_standard_error(p: float, n: int) -> float | None:
    """The binomial standard error of a proportion ``p`` measured on ``n`` trials."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n else None


def beyond_noise(a: float, se_a: float | None, b: float, se_b: float | None, z: float = 3.0) -> bool | None:
    """Whether two measurements differ by more than ``z`` standard errors of their difference
    (sqrt(se_a² + se_b²), the two taken as independent samples); None when an error is unknown. A difference
    with both errors 0 (every step alike on both sides) counts when it is not 0."""
    if se_a is None or se_b is None:
        return None
    se = math.hypot(se_a, se_b)
    return abs(a - b) > z * se if se > 0 else abs(a - b) > 1e-12
