"""Sequence parallel (``train.sequence_parallel``): rows split across 2 CPU processes (gloo) give the loss, the
step metrics and every gradient of one process, for EAGLE-3, DFlash and P-EAGLE (specheads/training/sequence_parallel.py).

One torchrun launch of ``sp_worker.py`` runs every case; each rank wraps the engine's ``TrainingModule`` in DDP, as
``accelerate launch`` does, so the gradients compared are the ones the optimizer would step with.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from dist_launch import REPO, launch_env

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("sp_worker.py")
# name:T:B:steps:dtype:heads:kv_heads:window:offpath:feature (sp_worker.parse)
CASES = {
    # one 16k-token row, 2 unrolled steps, float32 (2 heads of 16: the attention's cost sets the test's time)
    "long": "long:16384:1:2:float32:2:2:0:1:0",
    # float64, to rounding: grouped-query heads, two rows (one padded), a length the 2 ranks do not divide,
    # a sliding window, the off-path weights
    "grouped": "grouped:203:2:4:float64:4:2:0:1:0",
    "window": "window:203:2:3:float64:4:2:16:0.5:0",
    # the feature regression sums in float32 (losses.feature_loss), whatever the head's dtype
    "feature": "feature:150:1:3:float64:4:2:0:1:0.1",
    # a vision-language target's head: M-RoPE at the batch's 3-D positions, each rank's slice of them
    "mrope": "mrope:203:2:3:float64:4:2:0:1:0:1",
    # DFlash (dflash:name:T:B:block_size:anchors:dtype:heads:kv_heads:loss:labels:lk_weight): one 16k-token row of
    # 64 blocks of 8 in float32; in float64, two rows (one padded) with an odd count of blocks (the second rank's
    # share padded) and grouped-query heads, with the LK term and with D-PACE on the data's labels, and one block
    # (the second rank trains none of it: its share is padding); the grouped case again through the dense mask (the
    # blocks' attention off the CPU)
    "dflash_long": "dflash:dflash_long:16384:1:8:64:float32:2:2:ce:target:0",
    "dflash_grouped": "dflash:dflash_grouped:203:2:4:25:float64:4:2:ce:target:0.3",
    "dflash_dpace": "dflash:dflash_dpace:150:2:5:7:float64:4:2:dpace:data:0",
    "dflash_one": "dflash:dflash_one:40:1:4:1:float64:4:2:ce:target:0",
    "dflash_dense": "dflash:dflash_dense:203:2:4:25:float64:4:2:ce:target:0.3:1",
    # P-EAGLE (peagle:name:T:B:depths:dtype:heads:kv_heads:layers): one 16k-token row of 4 depths in float32; in
    # float64, two rows (one padded, a length the 2 ranks do not divide) with grouped-query heads and 2 layers (the
    # second's keys come through the first), and a row so short that a rank holds no slot of some depth
    "peagle_long": "peagle:peagle_long:16384:1:4:float32:2:2:1",
    "peagle_grouped": "peagle:peagle_grouped:203:2:4:float64:4:2:2",
    "peagle_short": "peagle:peagle_short:9:2:5:float64:4:2:1",
}


FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-6}  # torch's float32 default rtol
FLOAT64 = {"rtol": 1e-12, "atol": 1e-15}
# (loss and step losses, accuracies, gradients): the feature regression's float32 sums round at ~1e-7 of the loss
TOLERANCE = {"long": (FLOAT32, {"rtol": 0, "atol": 1e-4}, FLOAT32),
             "grouped": (FLOAT64, {"rtol": 0, "atol": 0}, FLOAT64),
             "window": (FLOAT64, {"rtol": 0, "atol": 0}, FLOAT64),
             "feature": ({"rtol": 1e-7, "atol": 0}, {"rtol": 0, "atol": 0}, FLOAT64),
             "mrope": (FLOAT64, {"rtol": 0, "atol": 0}, FLOAT64),
             # DFlash's loss is float32 whatever the head's dtype (the head's cross-entropy), its accuracies a float32
             # mean in one process and a ratio of the group's counts split
             "dflash_long": (FLOAT32, {"rtol": 0, "atol": 1e-6}, FLOAT32),
             **{name: (FLOAT32, {"rtol": 0, "atol": 1e-6}, FLOAT64)
                for name in ("dflash_grouped", "dflash_dpace", "dflash_one", "dflash_dense")},
             "peagle_long": (FLOAT32, {"rtol": 0, "atol": 1e-6}, FLOAT32),
             **{name: (FLOAT64, {"rtol": 0, "atol": 1e-15}, FLOAT64) for name in ("peagle_grouped", "peagle_short")}}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("sequence_parallel")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(out), *CASES.values()]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_give_the_loss_and_metrics_of_one(results, name):
    (split_loss, _, split_metrics, _), (whole_loss, _, whole_metrics, _) = (results[name]["split"],
                                                                            results[name]["whole"])
    losses, accuracies, _ = TOLERANCE[name]
    assert results[name]["world"] == 2
    assert_close(split_loss, whole_loss, **losses)
    assert split_metrics.keys() == whole_metrics.keys() and whole_metrics
    for key, value in whole_metrics.items():
        assert_close(split_metrics[key], value, **(losses if "loss" in key else accuracies), msg=key)


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_give_every_gradient_of_one(results, name):
    split, whole = results[name]["split"][1], results[name]["whole"][1]
    assert split.keys() == whole.keys() and len(whole) >= 10
    for key, grad in whole.items():
        assert grad.abs().max() > 0, key  # every compared gradient is there to compare
        assert_close(split[key], grad, **TOLERANCE[name][2], msg=key)


# --------------------------------------------------------------------------- through the recipe


@pytest.fixture(scope="module", params=["eagle3", "dflash", "peagle"])
def recipe_runs(assets, tmp_path_factory, request):
    """EAGLE-3, DFlash or P-EAGLE through recipes/train.py, 6 optimizer steps of 2 micro-batches of 9 rows: 2
    processes under cpu_ddp.yaml with ``train.sequence_parallel=2`` (one group: both ranks read every batch, each
    trains half of every row, DFlash half of its blocks, P-EAGLE the slots anchored in its half) and one process."""
    from dist_launch import EQUIV_ARGS, PER_RANK_BATCH, launch, single_process, train_args

    method = request.param
    root = tmp_path_factory.mktemp(f"sequence_parallel_recipe_{method}")
    args = [*EQUIV_ARGS, f"data.batch_size={PER_RANK_BATCH}"]
    split = launch("cpu_ddp.yaml", root / "split", train_args(assets, root / "split", method, *args,
                                                              "train.sequence_parallel=2")).check()
    whole = single_process(root / "whole", train_args(assets, root / "whole", method, *args)).check()
    return split, whole


@pytest.mark.slow
def test_the_switch_trains_through_the_recipe_as_one_process_does(recipe_runs):
    split, whole = recipe_runs
    losses, reference = split.losses(), whole.losses()
    heads, reference_heads = split.head_state(), whole.head_state()
    loss_gap = max(abs(losses.get(s, 0.0) / loss - 1) for s, loss in reference.items())
    head_gap = max(float((heads[k].double() - v.double()).abs().max()) for k, v in reference_heads.items())
    print(f"sequence parallel 2 vs 1 process: loss gap {loss_gap:.1e} (relative), head gap {head_gap:.1e} (absolute)")
    assert split.summary["num_processes"] == 2 and whole.summary["num_processes"] == 1
    assert split.summary["train_tokens"] == whole.summary["train_tokens"]  # one batch per group, counted once
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    assert heads.keys() == reference_heads.keys()
    for step, loss in reference.items():
        assert_close(losses[step], loss, rtol=1e-5, atol=0, msg=f"step {step}")
    for key, value in reference_heads.items():
        assert_close(heads[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert abs(reference[6] - reference[1]) > 1e-3  # training moved the head: the runs are not two untrained heads
