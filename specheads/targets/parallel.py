"""Split targets: how this process's target is split (``ParallelLayout``) and which share of the data it reads,
and the ``from_pretrained`` arguments for a tensor-parallel (``tp``) or ``device_map`` target.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from specheads.errors import ConfigError

log = logging.getLogger(__name__)

PARALLEL_MODES = ("none", "tp", "device_map")


@dataclass(frozen=True)
class ParallelLayout:
    """How this process's target is split, and which share of the data the process reads.

    ``world``/``rank``: all processes of the launch. ``tp_size``: ranks per tensor-parallel group;
    a group is ``tp_size`` consecutive ranks (one node when ``tp_size`` is the processes per node,
    since launchers number a node's processes consecutively) and together holds one copy of the
    target. Every rank of a group runs the same forward passes (they are collectives), so all of them
    must read the SAME batches: data is sharded over the groups, ``dp_rank`` of ``dp_size``, never
    over ranks. Only ``tp_rank == 0`` writes what the group computed (``writes``).
    Unsplit and ``device_map`` targets have ``tp_size == 1``: data-parallel rank = rank.
    """

    mode: str = "none"
    world: int = 1
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if self.tp_size < 1 or self.world % self.tp_size or not 0 <= self.rank < self.world:
            raise ValueError(f"invalid layout: rank {self.rank} of {self.world} processes, tensor-parallel "
                             f"groups of {self.tp_size} (the world size must be a multiple of it)")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def writes(self) -> bool:
        return self.tp_rank == 0

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world}, data-parallel {self.dp_rank}/{self.dp_size}, "
                f"tensor-parallel {self.tp_rank}/{self.tp_size}")


_TP_LAYOUT: ParallelLayout | None = None  # set once a tensor-parallel target is loaded in this process


def launch_rank_world() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's if initialized, else RANK/WORLD_SIZE."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def end_process_group() -> None:
    """Destroy this process's torch.distributed group, if one is initialized, once every rank is done.

    A gloo group left for the interpreter's shutdown to tear down aborted one of two CPU ranks now and then
    with ``terminate called without an active exception`` (SIGABRT, exit -6) after its checkpoint and head
    were written, failing the launch (CI, torchrun, 2 processes). The recipes call this last."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_unless_first_rank() -> None:
    """A launched rank other than 0 ends here, once its outputs are written and ``end_process_group`` has passed
    every rank's barrier: ``os._exit(0)`` after flushing, without the interpreter's teardown. That teardown
    still aborted a CPU rank now and then after the group was destroyed (``terminate called without an active
    exception``, exit -6: a clean-clone CI run lost a two-process launch so, after its head and summary were
    written). Rank 0, which reports, ends normally; a process not launched as a rank is left alone."""
    rank = os.environ.get("RANK")
    if rank is None or rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parallel_layout() -> ParallelLayout:
    """This process's layout: the one its tensor-parallel target was loaded with, else plain data
    parallelism over the launcher's ranks."""
    if _TP_LAYOUT is not None:
        return _TP_LAYOUT
    rank, world = launch_rank_world()
    return ParallelLayout("none", world, rank, 1)


def data_parallel_share(world: int, rank: int) -> tuple[int, int]:
    """(data-parallel world, data-parallel rank) for a process ``rank`` of ``world``: the ranks of a
    tensor-parallel group share one data-parallel rank (see ``ParallelLayout``); otherwise unchanged."""
    layout = _TP_LAYOUT
    if layout is None or layout.tp_size == 1:
        return world, rank
    if (world, rank) != (layout.world, layout.rank):
        raise RuntimeError(f"data sharded as rank {rank} of {world}, but the tensor-parallel target was loaded "
                           f"as {layout.describe()}")
    return layout.dp_size, layout.dp_rank


def device_map_devices(num_devices: int, local_rank: int = 0, local_world: int = 1) -> list[int]:
    """The accelerator indices a ``device_map`` target of local process ``local_rank`` (of ``local_world``
    on this node) spreads over: every ``local_world``-th device from ``local_rank`` on, so each process's
    first device is ``cuda:local_rank`` (the device a launcher gives it) and processes never share one."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} of {local_world}")
    mine = list(range(local_rank, num_devices, local_world))
    if not mine:
        raise ConfigError(f"{local_world} processes on this node but only {num_devices} devices: a device_map "
                         f"target needs at least one device per process")
    return mine


def _device_map_kwargs(max_memory: str | int | None) -> dict:
    """``from_pretrained`` placement for this process: its share of the node's GPUs (balanced by
    ``device_map="auto"``; ``max_memory`` per GPU, default 90% of what is free), or the CPU."""
    if not torch.cuda.is_available():
        return {"device_map": "cpu"}
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mine = device_map_devices(torch.cuda.device_count(), local_rank, local_world)
    if str(max_memory).lower() in ("", "auto", "none", "null"):
        max_memory = None
    budget = {i: max_memory or int(0.9 * torch.cuda.mem_get_info(i)[0]) for i in mine}
    log.info("device_map target over cuda:%s (max memory %s)", mine, budget)
    return {"device_map": "auto", "max_memory": budget}


def _tensor_parallel_kwargs(tp_size: int | None) -> tuple[dict, ParallelLayout]:
    """``from_pretrained`` arguments for tensor-parallel groups of ``tp_size`` ranks (default: the
    processes of one node, LOCAL_WORLD_SIZE), the groups being plain replicas, and the layout."""
    rank, world = launch_rank_world()
    if world < 2:
        raise ConfigError("target.parallel=tp needs several processes (torchrun / accelerate launch, one per device); "
                         "a single process can split a target with target.parallel=device_map")
    tp = int(tp_size or os.environ.get("LOCAL_WORLD_SIZE", world))
    layout = ParallelLayout("tp", world, rank, tp)
    if tp == 1:
        return {}, layout
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # transformers without DistributedConfig: TP over the whole world only
        if tp != world:
            raise RuntimeError(f"tensor parallelism over groups of {tp} of {world} processes needs a transformers "
                               f"with DistributedConfig (dp_replicate_size); set target.tp_size={world} or upgrade")
        return {"tp_plan": "auto"}, layout

    class ReplicatedTensorParallel(DistributedConfig):
        """TP groups replicated ``dp_replicate_size`` times, WITHOUT FSDP. transformers wraps the replicas
        of ``dp_replicate_size > 1`` in FSDP2 (HSDP, for training); a frozen target needs no sharded
        gradients, and an FSDP-wrapped decoder cannot be run alone (measured on transformers 5.24:
        "FSDP requires a single root module"), so the replicas report a data-parallel size of 1 here,
        which is what switches FSDP off (``_check_tensor_parallel`` verifies it)."""

        @property
        def dp_size(self) -> int:
            return 1

    config = ReplicatedTensorParallel(tp_size=tp, tp_plan="auto", dp_replicate_size=world // tp)
    return {"distributed_config": config}, layout


def split_kwargs(mode: str, tp_size: int | None, max_memory: str | int | None) -> tuple[dict, ParallelLayout | None]:
    """``from_pretrained`` arguments for a target split as ``mode`` (none: {}) and, for ``tp``, the layout it
    loads under (else None)."""
    if mode == "tp":
        return _tensor_parallel_kwargs(tp_size)
    if mode == "device_map":
        return _device_map_kwargs(max_memory), None
    return {}, None


def finish_tensor_parallel(model: nn.Module, layout: ParallelLayout, sharded: bool) -> None:
    """After ``from_pretrained`` of a ``tp`` target: when ``sharded`` (groups of more than one), check the
    sharding and keep the input embedding and LM head whole on every rank (drafters borrow them); then make
    ``layout`` this process's (``parallel_layout``, ``data_parallel_share``)."""
    global _TP_LAYOUT
    if sharded:
        _check_tensor_parallel(model, layout)
        _replicate(model.get_input_embeddings())
        _replicate(model.get_output_embeddings())
        if getattr(model.config, "tie_word_embeddings", False):
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    _TP_LAYOUT = layout
    log.info("tensor-parallel target: %s", layout.describe())


def _replicate(module: nn.Module) -> None:
    """Make a tensor-parallel module whole on every rank: full weights (a collective: every rank of the
    group calls it) and the module's own forward (the TP style wraps it per instance)."""
    from torch.distributed.tensor import DTensor

    for name, p in list(module._parameters.items()):
        if isinstance(p, DTensor):
            module._parameters[name] = nn.Parameter(p.full_tensor(), requires_grad=False)
    module.__dict__.pop("forward", None)


def _check_tensor_parallel(model: nn.Module, layout: ParallelLayout) -> None:
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 lives elsewhere, and transformers' FSDP path needs 2.8 anyway
        FSDPModule = ()
    if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError("this transformers version wrapped the tensor-parallel target in FSDP; load it with "
                           "tp_size = the world size, or use target.parallel=device_map")
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not sharded or sharded[0].device_mesh.size() != layout.tp_size:
        raise RuntimeError(f"target.parallel=tp left the target unsharded or sharded over another group than "
                           f"{layout.tp_size} ranks (does this architecture have a tensor-parallel plan?)")
