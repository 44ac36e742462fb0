"""Learning-rate schedules: linear warm-up, then cosine decay to a floor.

With a time budget (``train.max_minutes``) the decay follows whichever runs out first, the steps
or the minutes (``TimeBudget``), so a budgeted run ends at the floor however fast the machine is.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


class TimeBudget:
    """The share of a training time budget used so far; ``used()`` reads the training clock (seconds)."""

    def __init__(self, seconds: float, used: Callable[[], float]):
        if seconds <= 0:
            raise ValueError(f"a time budget must be positive, got {seconds} s")
        self.seconds, self.used = float(seconds), used

    @property
    def fraction(self) -> float:
        return min(1.0, self.used() / self.seconds)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1,
                  time_fraction: float = 0.0) -> float:
    """LR multiplier at optimizer step ``step`` (0-based).

    Rises linearly from 1/(warmup+1) to 1 over ``warmup_steps``, then follows a half cosine from 1
    down to ``min_ratio`` at ``total_steps`` (and stays there if training runs longer). The decay's
    progress is the larger of the steps' and ``time_fraction`` (the share of a time budget used).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max((step - warmup_steps) / decay_steps, time_fraction))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                   min_ratio: float = 0.1, kind: str = "cosine",
                   budget: TimeBudget | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepping once per optimizer step; ``kind`` is ``cosine`` or ``constant`` (warm-up
    still applies); ``budget``: decay by the share of this time budget used when it is ahead of the steps."""
    if kind not in ("cosine", "constant"):
        raise ValueError(f"unknown lr schedule '{kind}' (expected 'cosine' or 'constant')")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_ratio}")
    floor = 1.0 if kind == "constant" else min_ratio
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps, floor, budget.fraction if budget else 0.0)
    )
