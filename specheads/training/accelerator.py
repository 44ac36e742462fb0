"""The ``Accelerator`` and optimizer for a run (DDP, DeepSpeed or FSDP come from ``accelerate launch``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from specheads.methods.base import Method
from specheads.training.checkpoint import resume_checkpoint
from specheads.training.config import OptimConfig, TrainConfig

log = logging.getLogger(__name__)


QUIET_LIBRARIES = ("accelerate",)
"""Libraries whose INFO lines stay off the console (Accelerate: five lines per checkpoint saved)."""


def quiet_library_logs(names=QUIET_LIBRARIES) -> None:
    """Show only warnings and errors of these libraries' loggers, unless asked for: a logger already given a
    level (``hydra.verbose=accelerate`` sets DEBUG, a ``hydra.job_logging.loggers`` entry any level) is left
    as it is. specheads' own lines (``saved checkpoint ...``) still say what happens."""
    for name in names:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def _forget_earlier_state() -> None:
    """Accelerate keeps one state per process, whose mixed precision cannot change once set: a second training in
    the same single process (a notebook, a test session, a bfloat16 run after a float32 one) starts from a fresh
    state instead of failing with "AcceleratorState has already been initialized"."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(True)


def make_accelerator(cfg: TrainConfig, method: Method | None = None):
    """An ``Accelerator`` for this config (DeepSpeed comes from ``accelerate launch --config_file``).

    A method whose module leaves parameters unused in some steps (Medusa-2's head warm-up) sets
    ``find_unused_parameters = True`` so DDP does not wait for their gradients. Accelerate's INFO lines
    stay off the console (``quiet_library_logs``).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    quiet_library_logs()

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if mp not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be no, bf16, fp16 or auto, got {cfg.mixed_precision!r}")
    ddp = DistributedDataParallelKwargs(find_unused_parameters=bool(getattr(method, "find_unused_parameters", False)))
    handlers: list = [ddp]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = False
    if world > 1 and not torch.cuda.is_available():
        cpu, handlers = _cpu_processes(handlers)
    if world == 1:
        _forget_earlier_state()
    acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mp, kwargs_handlers=handlers,
                      cpu=cpu)
    if acc.num_processes != world:  # every rank training alone on all the data would pass unnoticed otherwise
        raise RuntimeError(f"launched as {world} processes (WORLD_SIZE) but Accelerate set up "
                           f"{acc.num_processes} ({acc.distributed_type}); refusing to train each rank alone")
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None:  # without a prepared dataloader DeepSpeed cannot fill these "auto" values itself
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        if ds.deepspeed_config.get("gradient_clipping") == "auto":
            ds.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm or 0.0
        if ds.zero_stage == 3:
            _whole_targets_under_zero3(ds)
        if acc.device.type == "cpu":
            _cpu_buckets(ds.deepspeed_config)
    return acc


CPU_ZERO_BUCKET = 5_000_000  # elements


def _cpu_buckets(config: dict) -> None:
    """Communication buckets sized for CPU processes, where the config leaves them unset.

    DeepSpeed's defaults (5e8 elements: 2 GB of fp32 per bucket) are sized for GPUs; on CPU they cost
    each process ~2 GB of RAM and, under ZeRO-2, ~20x the step time (measured on a tiny model, 2
    processes: 11.5 s -> 0.57 s for 3 steps, peak RSS 2.66 GB -> 0.77 GB)."""
    zero = config.setdefault("zero_optimization", {})
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        if zero.get(key, "auto") == "auto":
            zero[key] = CPU_ZERO_BUCKET


def _whole_targets_under_zero3(ds) -> None:
    """Let the target load whole under ZeRO-3 (the methods read its LM head and embedding to build their
    heads, and a frozen target runs outside DeepSpeed's engine, which alone gathers shards).

    Accelerate registers its DeepSpeed config with transformers even when ``zero3_init_flag`` is false,
    and transformers then partitions every ``from_pretrained`` model while it loads (measured: the target's
    LM head came out as shape (0,) and Medusa/EAGLE-3 refused to build). ZeRO-3 still partitions the trained
    module (heads; Medusa-2's adapted target too) at ``accelerator.prepare``.
    """
    if getattr(ds, "zero3_init_flag", False):
        log.warning("zero3_init_flag is on (Accelerate's default for ZeRO-3 when the config does not set it); the "
                    "target still loads whole, as the methods need it to build their heads")
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def _cpu_processes(handlers: list) -> tuple[bool, list]:
    """(cpu flag, kwargs handlers) for several processes without CUDA (tests, laptops), all on gloo.

    Plain DDP needs ``cpu=True`` (Accelerate's MULTI_CPU). DeepSpeed needs ``cpu=False`` (Accelerate
    turns DeepSpeed off under ``cpu=True`` and silently trains DDP) plus an explicit gloo backend
    (without one Accelerate finds no backend on a CPU box and gives every rank world size 1).
    FSDP is refused: Accelerate enables it only for GPU-class devices and would silently train DDP.
    """
    from accelerate.utils import InitProcessGroupKwargs

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise RuntimeError("FSDP needs GPUs: without CUDA Accelerate runs an FSDP launch as plain DDP over "
                           "gloo (no parameter sharding). Use a DeepSpeed ZeRO-3 config "
                           "(conf/launcher/cpu_zero3.yaml) to shard parameters over CPU processes.")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        _no_shm_comm_build()
        return False, handlers + [InitProcessGroupKwargs(backend="gloo")]
    return True, handlers


def _no_shm_comm_build() -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce op (``deepspeed_shm_comm``) the first time a
    process group starts: measured ~230 s of C++ compilation on this 2-core machine, before the first step.
    gloo's collectives need nothing compiled, so the op is skipped unless ``SPECHEADS_DS_SHM_COMM=1``."""
    if os.environ.get("SPECHEADS_DS_SHM_COMM", "0") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the method built a module with no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def resume_path(cfg: TrainConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint ``cfg.resume`` names (``checkpoint.resume_checkpoint``: auto takes the newest intact one; a
    folder named is verified as it loads)."""
    return resume_checkpoint(ckpt_root, cfg.resume, verify_named=False)


def peak_rss_mb() -> float:
    """Peak resident set (MB): anonymous memory plus every touched page of a memory-mapped feature store."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def limit_onednn_cache(capacity: int | None) -> None:
    """Cap oneDNN's primitive cache (CPU). Each new matmul shape under bfloat16 autocast caches a primitive
    holding its own packed copy of the weights; training batches of varying shape filled the default
    1024 entries here (EAGLE-3 on SmolLM2, 2 cores: anonymous memory 0.6 -> 3.2 GB in 150 steps, still
    climbing). 64 entries: 1.7 GB, 10 % slower steps; 8: 1.3 GB, 38 % slower. Takes effect only where no
    oneDNN primitive was made yet in this process; None leaves oneDNN's default."""
    if capacity is None:
        return
    if capacity < 0:
        raise ValueError(f"onednn_cache must be >= 0 (or null for oneDNN's default), got {capacity}")
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (looked up once)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``); False where the C library
    has no such call (not glibc). Training on CPU frees and reallocates tensors of many sizes each step;
    glibc keeps the freed pages, so anonymous memory creeps up step after step (EAGLE-3 TTT 3 under bf16
    autocast on 2 cores: 1438 MiB after 1.5 minutes; trimmed after every step 1180 MiB, ~10 % fewer
    tokens/s: the returned pages are faulted in again the next step)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def rss_anon_mb(status: str = "/proc/self/status") -> float | None:
    """Resident anonymous memory now (MB; Linux's ``RssAnon``): what the process allocated, without
    the page cache of mapped files (a feature store read through mmap); None where it is not reported."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


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
