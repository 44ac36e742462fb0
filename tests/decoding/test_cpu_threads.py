"""Decoding's thread count: measured on the machine at hand, or set."""

from __future__ import annotations

import pytest
import torch

from specheads.decoding.cpu_threads import MARGIN, choose_cpu_threads
from specheads.decoding.runner import TargetRunner
from specheads.errors import ConfigError
from tests.conftest import make_tiny_model


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_auto_times_both_counts_interleaved_and_keeps_all_only_when_clearly_faster(monkeypatch):
    torch.set_num_threads(2)
    model = make_tiny_model(layers=1)
    seen = []
    real = TargetRunner.timed_chain

    def timed(self, tokens):  # the count in force when each forward was timed, and a real timing
        seen.append(torch.get_num_threads())
        return real(self, tokens)

    monkeypatch.setattr(TargetRunner, "timed_chain", timed)
    done = choose_cpu_threads(model, "auto", context=16, rounds=3, reps=2)
    assert seen == ([2] * 3 + [1] * 3) * 3  # interleaved rounds: a warm-up and 2 timed forwards per count
    ms = {int(k): v for k, v in done["one_token_ms"].items()}
    assert done["of"] == 2 and done["threads"] == (2 if ms[2] < MARGIN * ms[1] else 1)
    assert torch.get_num_threads() == done["threads"]


def test_a_set_count_is_applied_and_a_bad_one_is_one_line():
    model = make_tiny_model(layers=1)
    assert choose_cpu_threads(model, 1)["threads"] == 1 and torch.get_num_threads() == 1
    with pytest.raises(ConfigError, match="cpu_threads"):
        choose_cpu_threads(model, 0)


def test_one_thread_available_is_left_alone():
    torch.set_num_threads(1)
    assert choose_cpu_threads(make_tiny_model(layers=1), "auto") == {"threads": 1, "of": 1, "one_token_ms": None}
