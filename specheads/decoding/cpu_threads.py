"""The measured choice of how many threads CPU decoding runs on.

A decode forward is hundreds of small operations, each an OpenMP parallel region that waits for its slowest
thread. On a small machine where another process holds a core (a test run, a second job), the thread that
shares it is descheduled for a time slice and every region waits for it: on 2 AMD EPYC cores with one busy,
an SDPA call over one query took 8 ms with 2 threads against 0.04 ms with 1, and a 32-token plain decode of
SmolLM2 9.3-12.5 s against 2.6-2.8 s. On a quiet machine more threads may win. So ``choose_cpu_threads``
times one-token forwards on one thread and on all, interleaved, and keeps all only where they are clearly faster; plain and speculative
decoding then run on the same count, so speed-ups compare like with like.
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

from specheads.decoding.runner import TargetRunner

log = logging.getLogger(__name__)

MARGIN = 0.9  # all threads are kept only where their forward is at least 10 % faster than one thread's


def choose_cpu_threads(model: nn.Module, mode: str | int = "auto", context: int = 256, rounds: int = 5,
                       reps: int = 3) -> dict:
    """Set torch's intra-op thread count for decoding ``model`` on the CPU: ``auto`` measures 1 thread against
    the current count (``rounds`` interleaved rounds of ``reps`` one-token forwards after ``context`` tokens,
    mean time) and keeps all threads only where they are ``MARGIN`` faster; an integer sets it. A GPU model, or a machine with one thread, is left as it is.
    Returns what was done, for the report: {"threads": n, "of": available, "one_token_ms": {n: ms} | None}."""
    available = torch.get_num_threads()
    p = next(model.parameters())
    if mode != "auto":
        n = int(mode)
        if n < 1:
            from specheads.errors import ConfigError

            raise ConfigError(f"cpu_threads={mode!r}: use auto or a positive thread count")
        if p.device.type == "cpu":
            torch.set_num_threads(n)
        return {"threads": n, "of": available, "one_token_ms": None}
    if p.device.type != "cpu" or available <= 1:
        return {"threads": available, "of": available, "one_token_ms": None}
    vocab = model.config.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(context)]
    runner = TargetRunner(model)
    runner.prefill([prompt])
    candidates = (available, 1)
    times: dict[int, list[float]] = {n: [] for n in candidates}
    for _ in range(rounds):
        for n in candidates:
            torch.set_num_threads(n)
            runner.timed_chain([prompt[-1]])  # warm-up at this count
            times[n] += [runner.timed_chain([prompt[-1]]) for _ in range(reps)]
    # the mean, not the median: the stalls of a busy core are what a decode pays, and they come in bursts
    ms = {n: 1000 * statistics.fmean(v) for n, v in times.items()}
    keep = available if ms[available] < MARGIN * ms[1] else 1
    torch.set_num_threads(keep)
    log.info("CPU threads for decoding: one-token forward %s -> %d", ", ".join(
        f"{ms[n]:.1f} ms on {n}" for n in candidates), keep)
    return {"threads": keep, "of": available, "one_token_ms": {str(n): round(v, 2) for n, v in ms.items()}}
