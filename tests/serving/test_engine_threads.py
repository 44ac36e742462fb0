"""Where an engine that does a process's whole work computes: every core the process may use, shared out between
a launch's local ranks (vLLM's CPU build otherwise keeps one core for its idle front end)."""

from __future__ import annotations

import os

import pytest
import torch

from specheads.serving.engine import worker_cores


def test_the_engine_takes_every_core_and_ranks_share_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert worker_cores() == "0,1,2,3,5"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker_cores() == "1,3"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert worker_cores() == "0,2,5"
    assert worker_cores(tensor_parallel_size=2) is None  # vLLM binds each of its ranks itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_cores() is None  # on a GPU: vLLM's own choice


def test_each_ranks_engine_gets_its_own_gpus(monkeypatch):
    from specheads.errors import ConfigError
    from specheads.serving.engine import rank_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert rank_gpus(2) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4")  # the node's own listing is kept
    assert rank_gpus(1) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ConfigError, match="need 8 GPUs; the node has 4"):
        rank_gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rank_gpus(4) == {}  # one engine: vLLM takes the GPUs it is given
