"""FSDP for Medusa-2 (the method whose target is trained): a GPU test, and the CPU refusal.

Measured on CPU (2 processes, accelerate 1.15, torch 2.13): an FSDP config launch
(``distributed_type: FSDP``) of Medusa-2 ran to the end but as plain DDP: its checkpoint held
``model.safetensors`` + ``optimizer.bin``, Accelerate's DDP layout, and no sharded FSDP state.
Accelerate turns FSDP on only for GPU-class distributed types (``AcceleratorState``: MULTI_GPU / NPU / XPU
/ ...); with ``cpu=True`` the run is MULTI_CPU, and with ``cpu=False`` on a CPU box no backend is found
and every rank gets world size 1. The engine therefore refuses FSDP without CUDA
(``specheads.training.accelerator``), and the launch test below needs 2 GPUs:

    accelerate launch --config_file <fsdp.yaml written by the test> --num_processes 2 recipes/train.py method=medusa2 ...
"""

from __future__ import annotations

import pytest
import torch

from dist_launch import assert_rank0_writes_once, launch, train_args

CPU_REASON = ("FSDP cannot run on CPU through Accelerate 1.15: it enables FSDP only for GPU-class devices, and a "
              "CPU launch of an FSDP config measured as plain DDP (checkpoint: model.safetensors + optimizer.bin, "
              "no FSDP shards); the engine now refuses it. Needs 2 CUDA devices.")

FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:  # FSDP1: the engine gathers shards with FSDP.summon_full_params (training/accelerator.py)
  fsdp_version: 1
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_use_orig_params: true  # LoRA: frozen and trained parameters in one flat parameter
  fsdp_sync_module_states: true
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: 0
mixed_precision: 'no'
rdzv_backend: static
same_network: true
main_training_function: main
downcast_bf16: 'no'
use_cpu: false
"""


@pytest.mark.distributed
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=CPU_REASON)
def test_medusa2_under_fsdp_on_two_gpus(assets, tmp_path):
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text(FSDP_CONFIG)
    out = tmp_path / "run"
    run = launch(str(cfg), out, train_args(assets, out, "medusa2", "train.measure_prompts=0")).check()
    assert run.summary["num_processes"] == 2 and run.summary["steps"] == 3
    assert_rank0_writes_once(run, 3)
    ckpt = out / "checkpoints" / "step_0000003"
    assert list(ckpt.glob("pytorch_model_fsdp_0*")), sorted(p.name for p in ckpt.iterdir())  # sharded FSDP state
    assert (out / "head" / "target" / "config.json").is_file()


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_engine_refuses_fsdp_without_cuda(monkeypatch, tmp_path):
    """What an FSDP launch on CPU now meets first (without it the run silently trains DDP)."""
    from specheads.training.accelerator import make_accelerator
    from specheads.training.config import TrainConfig

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="FSDP needs GPUs"):
        make_accelerator(TrainConfig(output_dir=str(tmp_path)))
