"""What a progress bar counts and when the work will end: one home for the totals and ETAs of training,
collection, regeneration and evaluation bars (the bars themselves are tqdm's).

Under a time budget, training counts minutes of the budget, not steps: a 100000-step cap with an
8-minute budget must not read 317/100000 with an ETA of 7.5 hours. Its end is whichever comes first,
the budget or the steps at the pace so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """Where a bar stands: ``done`` of ``total`` ``unit``s, and the seconds left (None: not known yet)."""

    done: float
    total: float
    unit: str
    eta_s: float | None


def training_position(step: int, max_steps: int, train_s: float, budget_s: float | None) -> Position:
    """A training bar: steps of ``max_steps`` without a budget; under one, minutes of the budget (the total is
    the budget, or the time the remaining steps take at the pace so far when they end first).

    ``train_s``: training seconds so far, the budget's clock (a resumed run restores it with its step).
    ``done`` never exceeds ``total``: a step that overruns the budget (or a step past the cap) ends the bar at
    100 %, where tqdm would otherwise drop a total it finds below the count and the bar's format fail on it."""
    steps_left = max(max_steps - step, 0)
    per_step = train_s / step if step > 0 and train_s > 0 else None
    by_steps = steps_left * per_step if per_step is not None else None
    if budget_s is None:
        return Position(step, max(max_steps, step), "step", by_steps)
    by_budget = max(budget_s - train_s, 0.0)
    eta = by_budget if by_steps is None else min(by_budget, by_steps)
    total_s = train_s + eta if by_steps is not None and by_steps < by_budget else max(budget_s, train_s)
    return Position(train_s / 60, total_s / 60, "min", eta)


def rate_eta(done: float, total: float, elapsed_s: float) -> float | None:
    """Seconds left at the average pace so far (None before anything is done)."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(total - done, 0) * elapsed_s / done


def evaluation_steps(num_prompts: int, methods: list, temperatures, repeats: int, paired: bool,
                     batch_sizes, batch_prompts: int, exact: bool = False) -> int:
    """How many progress reports ``evaluation.suite.evaluate`` makes: the evaluation bar's total.

    methods: the ``MethodSpec`` list (``auto_shape`` ones measure their shape once per head first); exact: with an
    exact pass (``evaluation.passes``: each prompt's reference decode, and each prompt again per method at T = 0)."""
    wanted = 1 if paired else max(repeats, 1)
    plain = num_prompts + sum(wanted - (1 if T == 0 else 0) for T in set(temperatures) | {0.0})
    per_method = len(tuple(temperatures)) * (num_prompts + max(repeats, 1) - 1)
    batched = min(batch_prompts, num_prompts)
    per_method += sum(math.ceil(batched / bs) for bs in batch_sizes if bs > 1)
    shapes = len({(m.drafter, m.head_dir) for m in methods if m.auto_shape})
    checks = num_prompts * (1 + (len(methods) if 0.0 in set(temperatures) else 0)) if exact else 0
    return plain + len(methods) * per_method + shapes + checks


def minutes(seconds: float | None) -> str:
    """``h:mm:ss`` / ``m:ss`` for a bar's ETA (``?`` when unknown)."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def training_bar_format(budget_s: float | None) -> str:
    """tqdm's ``bar_format`` for ``training_position``: minutes of the budget, or steps; the ETA comes in the
    postfix (``training_postfix``), since tqdm's own would divide the steps left by the step rate."""
    count = "{n:.1f}/{total:.1f} min" if budget_s else "{n:.0f}/{total:.0f} steps"
    return "{desc}: {percentage:3.0f}%|{bar}| " + count + " [{elapsed}{postfix}]"


def training_postfix(pos: Position, step: int, loss: float | None, lr: float | None) -> str:
    """The bar's postfix: ETA, step, loss and learning rate (``?`` for a figure not known)."""
    loss_s, lr_s = ("?" if loss is None else f"{loss:.4f}"), ("?" if lr is None else f"{lr:.2e}")
    return f"ETA {minutes(pos.eta_s)}, step {step}, loss {loss_s}, lr {lr_s}"
