"""2 processes with per-rank batch b reproduce 1 process with batch 2b (Medusa-1, grad_accum 2, 6 steps):

    accelerate launch --config_file conf/launcher/cpu_ddp.yaml --num_processes 2 recipes/train.py method=medusa1 data.batch_size=9 train.grad_accum=2 ...
    python recipes/train.py method=medusa1 data.batch_size=18 train.grad_accum=2 ...

Same rows per optimizer step. ``DatasetBatches`` cuts the length-sorted rows into batches of
``data.batch_size`` and shuffles the batch order with a permutation whose length is the number of batches;
with W processes each group of W consecutive batches gives rank r its r-th. So 1 x 2b and W x b see the
same rows per step only when a step consumes whole epochs: here 36 training rows = 2 x 9 x 2 (one
optimizer step = one epoch on either side). With several steps per epoch the two sides train on the
same rows in a different order (the batch permutations differ), so they are not comparable step by step.

Same loss. Every method's loss is a per-token mean within a micro-batch (Medusa: per head, over that
head's labels). DDP averages the ranks' gradients, i.e. a mean of per-rank means, which equals the
mean over all tokens only when every rank's micro-batch counts as many labels. All rows here have the
same length and mask (20 labels each), so the two agree up to float rounding (measured: losses to
~1e-7 relative, weights to ~1e-6 absolute). With rows of unequal length the 2-process run weights a
label by 1/(its rank's label count) instead of 1/(all labels): not the same optimisation, by design of
per-micro-batch means.

Negative control: the same 2-process launch with DDP's gradient all-reduce switched off
(``tests/distributed/train_entry.py``, ``SPECHEADS_TEST_NO_GRAD_SYNC=1``: a DDP comm hook that keeps the
local gradient) must fail the same comparison by far.
"""

from __future__ import annotations

import pytest

from dist_launch import (ENTRY, EQUIV_ARGS, EQUIV_STEPS, PER_RANK_BATCH, launch, launch_env, single_process,
                         train_args)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

LOSS_RTOL = 1e-5  # relative, per step
WEIGHT_ATOL = 1e-4  # absolute, every head tensor (weights are O(0.1); lr 1e-2 moves them ~1e-2 per step)


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_process") / "run"
    args = train_args(assets, out, "medusa1", *EQUIV_ARGS, f"data.batch_size={2 * PER_RANK_BATCH}")
    return single_process(out, args).check()


@pytest.fixture(scope="module")
def no_sync(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("no_sync") / "run"
    return launch("cpu_ddp.yaml", out, train_args(assets, out, "medusa1", *EQUIV_ARGS), script=ENTRY,
                  env=launch_env(SPECHEADS_TEST_NO_GRAD_SYNC="1")).check()


def _gaps(a, b) -> tuple[float, float]:
    """(largest relative loss gap over the steps, largest absolute weight gap over the head's tensors)."""
    la, lb = a.losses(), b.losses()
    assert sorted(la) == sorted(lb) == list(range(1, EQUIV_STEPS + 1))
    loss_gap = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in la)
    ha, hb = a.head_state(), b.head_state()
    assert ha.keys() == hb.keys()
    weight_gap = max(float((ha[k].float() - hb[k].float()).abs().max()) for k in ha)
    return loss_gap, weight_gap


def test_two_processes_of_b_match_one_process_of_2b(ddp_medusa1, one_process):
    two = ddp_medusa1.check()
    assert two.summary["num_processes"] == 2 and one_process.summary["num_processes"] == 1
    assert two.summary["train_tokens"] == one_process.summary["train_tokens"]  # the same rows, counted once
    loss_gap, weight_gap = _gaps(two, one_process)
    print(f"2 x b vs 1 x 2b: loss gap {loss_gap:.2e} (rel), weight gap {weight_gap:.2e} (abs)")
    assert loss_gap <= LOSS_RTOL and weight_gap <= WEIGHT_ATOL
    # The weights did move (the comparison is not between two untrained heads).
    from safetensors.torch import load_file

    first = load_file(str(two.out / "checkpoints" / "step_0000002" / "model.safetensors"))
    moved = max(float((v.float() - first["model." + k].float()).abs().max()) for k, v in two.head_state().items()
                if "model." + k in first)
    assert moved > 100 * WEIGHT_ATOL


def test_without_gradient_sync_the_comparison_fails(no_sync, one_process):
    assert "DDP gradient all-reduce switched off" in no_sync.log
    assert no_sync.summary["num_processes"] == 2
    loss_gap, weight_gap = _gaps(no_sync, one_process)
    print(f"no sync vs 1 x 2b: loss gap {loss_gap:.2e} (rel), weight gap {weight_gap:.2e} (abs)")
    assert loss_gap > 10 * LOSS_RTOL and weight_gap > 10 * WEIGHT_ATOL
