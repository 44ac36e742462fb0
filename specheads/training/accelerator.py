"""The ``Accelerator`` and optimizer for a run (DDP, DeepSpeed or FSDP come from ``accelerate launch``)."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from specheads.methods.base import Method
from specheads.training.checkpoint import latest_checkpoint
from specheads.training.config import OptimConfig, TrainConfig


def make_accelerator(cfg: TrainConfig, method: Method | None = None):
    """An ``Accelerator`` for this config (DeepSpeed comes from ``accelerate launch --config_file``).

    A method whose module leaves parameters unused in some steps (Medusa-2's head warm-up) sets
    ``find_unused_parameters = True`` so DDP does not wait for their gradients.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if mp not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be no, bf16, fp16 or auto, got {cfg.mixed_precision!r}")
    ddp = DistributedDataParallelKwargs(find_unused_parameters=bool(getattr(method, "find_unused_parameters", False)))
    # Several CPU processes (torchrun / accelerate launch --cpu) need cpu=True for Accelerate to use gloo.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mp, kwargs_handlers=[ddp],
                      cpu=cpu)
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None:  # without a prepared dataloader DeepSpeed cannot fill these "auto" values itself
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        if ds.deepspeed_config.get("gradient_clipping") == "auto":
            ds.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm or 0.0
    return acc


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the method built a module with no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def resume_path(cfg: TrainConfig, ckpt_root: Path) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(ckpt_root)
    path = Path(cfg.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no such checkpoint folder (use auto, never or a folder)")
    return path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sharding(acc) -> str | None:
    """``"zero3"`` or ``"fsdp"`` when parameters are sharded over processes (a rank alone cannot run the
    model outside the wrapper's forward), else None (one process, DDP, ZeRO-1/2)."""
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None and ds.zero_stage == 3:
        return "zero3"
    if getattr(acc.state, "fsdp_plugin", None) is not None:
        return "fsdp"
    return None


@contextlib.contextmanager
def gathered(model: nn.Module, acc) -> Iterator[nn.Module]:
    """The method's trained module (inside the engine's ``TrainingModule``) with full parameters on every
    rank for the duration (ZeRO-3 / FSDP shards are gathered, read-only); every rank must enter."""
    unwrapped = acc.unwrap_model(model)
    inner = getattr(unwrapped, "model", unwrapped)
    kind = sharding(acc)
    if kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
            yield inner
    elif kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False, rank0_only=False):
            yield inner
    else:
        yield inner
