"""Every method under DDP with 2 CPU processes (gloo), through the real entry point:

    accelerate launch --config_file conf/launcher/cpu_ddp.yaml --num_processes 2 recipes/train.py method=<m> ...

Each run trains a few steps with a held-out evaluation (the measured acceptance too) and writes one head;
the world size is asserted from the summary, the per-rank RNG files and each rank's log line.
"""

from __future__ import annotations

import math

import pytest

from dist_launch import assert_rank0_writes_once, assert_world_of_two, launch, train_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module", params=["medusa2", "eagle1", "eagle3", "dflash", "peagle", "dspark"])
def ddp_run(request, assets, tmp_path_factory):
    method = request.param
    out = tmp_path_factory.mktemp(f"ddp_{method}") / "run"
    return method, launch("cpu_ddp.yaml", out, train_args(assets, out, method)).check()


def _check_trained_one_head(run, method: str, steps: int) -> None:
    s = run.summary
    assert s["method"] == method and s["steps"] == steps and s["num_processes"] == 2
    assert s["resumed_from"] is None
    losses = run.losses()
    assert sorted(losses) == list(range(1, steps + 1)) and all(math.isfinite(v) for v in losses.values())
    assert s["final_loss"] == losses[steps]
    head = run.head_state()
    assert head and all(math.isfinite(float(t.float().abs().sum())) for t in head.values())


def test_each_method_trains_under_ddp_on_two_processes(ddp_run):
    method, run = ddp_run
    assert_world_of_two(run)
    _check_trained_one_head(run, method, 3)
    assert_rank0_writes_once(run, 3)
    ev = run.summary["eval"]
    from specheads.acceptance_math import estimate_tau

    # held-out sums over both ranks: the τ written is the one the reduced accuracies imply
    assert ev["tau_estimate"] == pytest.approx(estimate_tau(ev)[0]) and ev["measured_prompts"] == 1.0
    if method == "medusa2":
        assert (run.out / "head" / "target" / "config.json").is_file()  # the adapted target beside the heads
        assert ev["drift_kl"] >= 0.0


def test_medusa1_trains_under_ddp_on_two_processes(ddp_medusa1):
    run = ddp_medusa1.check()
    assert_world_of_two(run)
    _check_trained_one_head(run, "medusa1", 6)
    assert_rank0_writes_once(run, 6)
    # 36 training rows of 24 tokens, one epoch per step: the tokens of both ranks are counted.
    assert run.summary["train_tokens"] == 6 * 36 * 24
