"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes (DS_ACCELERATOR=cpu, gloo), EAGLE-3 and Medusa-2:

    DS_ACCELERATOR=cpu accelerate launch --config_file conf/launcher/cpu_zero2.yaml --num_processes 2 recipes/train.py method=eagle3 ...
    DS_ACCELERATOR=cpu accelerate launch --config_file conf/launcher/cpu_zero3.yaml --num_processes 2 recipes/train.py method=medusa2 ...

The evidence is what each rank writes itself into the run's final checkpoint (``accelerator.save_state``
calls DeepSpeed's ``save_checkpoint``: one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank), so no
debug hook is needed in the library:

- ZeRO-2 partitions optimizer state: each rank's fp32 master partition and Adam moments cover half of the
  trainable parameters (and the two halves all of them), while the module itself is whole (one
  ``mp_rank_00_model_states.pt`` holding every parameter);
- ZeRO-3 partitions parameters: one model-states file per rank, none holding the trained parameters
  (they exist only as the per-rank fp32 partitions, half each);
- the saved head equals the parameters DeepSpeed's own ``zero_to_fp32`` consolidates from the per-rank
  files (for Medusa-2 also the merged adapted target: base + (alpha/r) B A).

The first DeepSpeed launch on a machine also JIT-builds DeepSpeed's CPU shared-memory comm op (cached in
~/.cache/torch_extensions; minutes once).
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_launch import (assert_rank0_writes_once, assert_world_of_two, final_ckpt_name, gathered_fp32, launch,
                         train_args, trainable_numel, zero_files, zero_partitions)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

CASES = [(2, "eagle3"), (2, "medusa2"), (2, "dflash"), (2, "peagle"), (2, "dspark"), (3, "eagle3"), (3, "medusa2")]


@pytest.mark.parametrize("stage,method", CASES, ids=[f"zero{z}-{m}" for z, m in CASES])
def test_zero_on_two_processes(stage, method, assets, tmp_path):
    """One launch per case, every check on it (one test, so a test scheduler that spreads tests over workers
    cannot launch a case twice, as it did a module-scoped fixture's)."""
    out = tmp_path / "run"
    run = launch(f"cpu_zero{stage}.yaml", out, train_args(assets, out, method, "train.measure_prompts=0")).check()
    for check in (world_of_two_and_one_head, each_rank_holds_half_of_the_optimizer_state,
                  parameters_are_partitioned_only_under_zero3, saved_head_equals_the_gathered_parameters):
        check(stage, method, run)


def world_of_two_and_one_head(stage, method, run) -> None:
    assert_world_of_two(run)
    assert_rank0_writes_once(run, 3)
    losses = run.losses()
    assert all(math.isfinite(v) for v in losses.values()) and run.summary["final_loss"] == losses[3]
    from specheads.acceptance_math import estimate_tau

    ev = run.summary["eval"]  # held-out evaluation ran (in lockstep under ZeRO-3): τ from its reduced accuracies
    assert ev["tau_estimate"] == pytest.approx(estimate_tau(ev)[0])


def each_rank_holds_half_of_the_optimizer_state(stage, method, run) -> None:
    ckpt = run.out / "checkpoints" / final_ckpt_name(run)
    parts = zero_partitions(ckpt)
    assert [p["file"] for p in parts] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert {p["stage"] for p in parts} == {stage}
    total = trainable_numel(run)
    for p in parts:
        assert p["fp32_numel"] <= math.ceil(total / 2) + 64, (p, total)  # half (plus alignment padding)
        # Adam's exp_avg and exp_avg_sq of that half only; the last rank's moments keep the alignment padding that
        # DeepSpeed strips from its fp32 partition (a head with an odd number of elements, e.g. DSpark's 1-wide bias)
        assert 2 * p["fp32_numel"] <= p["moments_numel"] <= 2 * (p["fp32_numel"] + 64), p
    assert total <= sum(p["fp32_numel"] for p in parts) <= total + 128


def parameters_are_partitioned_only_under_zero3(stage, method, run) -> None:
    ckpt = run.out / "checkpoints" / final_ckpt_name(run)
    model_files = zero_files(ckpt)["model"]
    trained = {name for group in torch.load(model_files[0], map_location="cpu", weights_only=False)["param_shapes"]
               for name in group}
    if stage == 2:
        assert [f.name for f in model_files] == ["mp_rank_00_model_states.pt"]
        module = torch.load(model_files[0], map_location="cpu", weights_only=False)["module"]
        assert trained <= set(module) and sum(module[k].numel() for k in trained) == trainable_numel(run)
    else:
        assert [f.name for f in model_files] == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
        for f in model_files:
            module = torch.load(f, map_location="cpu", weights_only=False)["module"]
            assert sum(module[k].numel() for k in trained if k in module) == 0, f.name  # no rank holds them whole


def saved_head_equals_the_gathered_parameters(stage, method, run) -> None:
    gathered = gathered_fp32(run.out / "checkpoints" / final_ckpt_name(run))
    head = run.head_state()
    for name, saved in head.items():
        match = [k for k in gathered if k == name or k.endswith("." + name)]
        assert len(match) == 1, (name, match)
        torch.testing.assert_close(saved.float(), gathered[match[0]].float(), rtol=0, atol=0, msg=name)
    if method == "medusa2":
        _check_merged_target(run, gathered)


def _check_merged_target(run, gathered) -> None:
    """head/target (the merged adapted target) = base weight + (alpha / r) * B @ A, from the gathered shards."""
    from safetensors.torch import load_file

    merged = load_file(str(run.out / "head" / "target" / "model.safetensors"))
    scale = 8 / 4  # method.lora_alpha / method.lora_r (dist_launch.METHOD_ARGS)
    checked = 0
    for key in [k for k in gathered if k.endswith(".base_layer.weight")]:
        stem = key[: -len(".base_layer.weight")]
        name = stem.split("base_model.model.", 1)[1] + ".weight"
        want = gathered[key] + scale * gathered[stem + ".lora_B.default.weight"] @ gathered[stem + ".lora_A.default.weight"]
        torch.testing.assert_close(merged[name].float(), want.float(), rtol=1e-5, atol=1e-6, msg=name)
        checked += 1
    assert checked >= 4 * 7  # every projection of the 4 layers (all-linear LoRA)
