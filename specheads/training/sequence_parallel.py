"""Sequence parallel training: one long row split across the N processes of a group (``train.sequence_parallel=N``).

Each rank of a group reads the same batch (data is dealt to groups, ``data_share``) and keeps a contiguous slice of
its positions (``SequenceShard.local_batch``): rank ``r`` owns ``[r C, (r + 1) C)`` with ``C = ceil(T / N)``, the
last rank's tail padded. The training-time test at position ``t`` and step ``k`` reads the token ``ids[t+1+k]``, the
masks at ``t+2+k`` and the target's distribution at ``t+1+k``, so each rank also keeps the ``steps + 1`` positions
after its slice (a halo read from the batch every rank holds: nothing is exchanged for it).

Everything the drafter computes per position stays local; only attention mixes positions. In each draft attention
(``ShardedUnrollCache.attend``) an all-to-all turns the step's queries, keys and values from (local positions, all
heads) into (all positions, heads / N) (Ulysses: DeepSpeed's ALST, SpecForge's USP), the step's attention runs there
as in one process (``layers.unrolled_attention``: step 0's keys causally over the whole row, each later step's key
on its own position), and the reverse all-to-all returns (local positions, all heads). A key is exchanged once, at
the step that made it: the cache keeps the gathered keys for the later steps. (SpecForge keeps each later step's
keys on the query's rank and merges them there with the causal part by log-sum-exp; that exchanges fewer bytes per
step but splits the attention's exact backward across ranks. Here the attention and its backward are the
one-process ones, on a head slice.) Each all-to-all's backward is the inverse all-to-all, so gradients are exact.

The loss of each step is the one-process mean: the local sum over the whole group's count (``total``), and the
group's losses are summed with a differentiable all-reduce (``combine``: Σ loss·n / Σ n). Every rank then holds the
group's loss, and its backward hands each rank N times its share of the gradient, so the average over all ranks that
DDP, DeepSpeed ZeRO and FSDP take already is, per data-parallel group, the one-process gradient of that group's
batch: the engine's gradient sync needs no change.

DFlash (``methods.dflash``) splits the same way with its own unit of work: each rank fuses the target's states of
its C positions into context keys and values (nothing after its slice: no halo), and the row's blocks (anchors drawn
from the whole row, the same on every rank of the group: rank 0's draw is broadcast) are dealt in order, ``ceil(n /
N)`` to each rank, padded with empty blocks (``SequenceShard.blocks``), so every rank runs as many block queries. In
each draft layer's attention (``ShardedBlockLayout.run``) the all-to-all turns the context's keys and values and the
blocks' queries, keys and values into (whole row, heads / N) and (every block, heads / N), the one-process block
attention runs there (each block over the context before its anchor and its own slots) and the reverse all-to-all
returns this rank's blocks. Labels and masks are read from the whole batch every rank holds; the loss is this rank's
weighted sum over the group's total weight, summed by the same differentiable all-reduce.

P-EAGLE (``methods.peagle``) packs a row's depth-0 entries and parallel slots into one sequence. The slots are
drawn once for the group (rank 0's draw, ``SequenceShard.share``) and dealt by anchor (``methods.peagle.deal``): each
rank runs its C depth-0 positions and every slot anchored there, each depth padded to the group's largest share, and
keeps the ``num_depths + 1`` positions after its slice for the labels. In each draft layer's attention
(``ShardedParallelLayout``) the all-to-all turns every rank's entries into (all entries, heads / N), a gather puts
them in the one-process packed order, the one-process ``ParallelLayout`` attends, and the inverse gather and
all-to-all hand back this rank's entries. Each depth's summed loss is divided by the group's count of its scored
slots and summed by the same differentiable all-reduce.

Groups are N consecutive ranks (a node's processes are numbered consecutively). Held-out evaluation and the
measured decode read whole rows on each rank, as without sequence parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd import Function

from specheads.errors import ConfigError
from specheads.models.dflash import BlockLayout
from specheads.models.layers import AttentionPattern, UnrollCache, unrolled_attention
from specheads.models.peagle import ParallelLayout, take_entries

METHODS = ("eagle3", "dflash", "peagle")
"""Methods whose loss takes a ``SequenceShard`` (``method.sequence_parallel``)."""


# --------------------------------------------------------------------------- checks before any work


def check_settings(size: int, method: str, world: int | None = None, heads: int | None = None,
                   kv_heads: int | None = None, target_parallel: str = "none") -> None:
    """Refuse, in one line, a sequence-parallel size that this run cannot take: not a whole number >= 1, a method
    whose loss does not split rows, a world size it does not divide, a drafter whose attention heads or key/value
    heads it does not divide (each rank attends over whole heads), or a split (tensor-parallel) target."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"train.sequence_parallel={size!r}: give a whole number of processes per row, >= 1")
    if size == 1:
        return
    if method not in METHODS:
        raise ConfigError(f"train.sequence_parallel={size}: method {method} does not split rows across processes "
                          f"yet (methods that do: {', '.join(METHODS)}); set train.sequence_parallel=1")
    if world is not None and world % size:
        raise ConfigError(f"train.sequence_parallel={size} does not divide the {world} launched processes: launch a "
                          f"multiple of {size} processes (groups of {size} ranks share each row)")
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n is not None and n % size:
            raise ConfigError(f"train.sequence_parallel={size} does not divide the drafter's {n} {what} (each rank "
                              f"attends over whole heads): pick a size that divides {n}")
    if target_parallel != "none":
        raise ConfigError(f"train.sequence_parallel={size} with target.parallel={target_parallel}: a split target's "
                          f"ranks already share each batch; use one of the two")


def check_launch(size: int, method: str, target_config=None, target_parallel: str = "none") -> None:
    """``check_settings`` for this launch: its world size (``WORLD_SIZE``) and the drafter's heads, which copy the
    target's (``target_config``: its ``transformers`` config, read before it loads; None skips the heads)."""
    import os

    heads = kv_heads = None
    if target_config is not None:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
    check_settings(size, method, int(os.environ.get("WORLD_SIZE", "1")), heads, kv_heads, target_parallel)


def check_row_lengths(size: int, lengths) -> None:
    """Refuse rows shorter than ``size`` tokens (some rank would own no position of them)."""
    if size > 1 and lengths:
        shortest = min(lengths)
        if shortest < size:
            raise ConfigError(f"train.sequence_parallel={size}: the training data holds a row of {shortest} tokens, "
                              f"shorter than the {size} processes it would be split across; drop short rows or "
                              f"lower train.sequence_parallel")


def data_share(world: int, rank: int, size: int) -> tuple[int, int]:
    """(data-parallel world, data-parallel rank) of process ``rank`` of ``world`` when groups of ``size``
    consecutive ranks share each batch."""
    return world // size, rank // size


# --------------------------------------------------------------------------- the group


def make_shard(size: int) -> "SequenceShard | None":
    """This process's ``SequenceShard`` for groups of ``size`` consecutive ranks of the initialized default process
    group (None for size 1). Every rank must call it: it makes one process group per sequence-parallel group."""
    if size == 1:
        return None
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ConfigError(f"train.sequence_parallel={size} does not divide the {world} launched processes")
    mine = None
    for first in range(0, world, size):  # new_group is collective: every rank makes every group
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceShard(size, rank % size, mine)


def enable(method, size: int) -> "SequenceShard | None":
    """Give ``method`` this rank's ``SequenceShard`` (``method.sequence_parallel``) for groups of ``size``; None and
    nothing changed for size 1."""
    check_settings(size, method.name)
    shard = make_shard(size)
    if shard is not None:
        method.sequence_parallel = shard
    return shard


@dataclass
class SequenceShard:
    """This rank's place in its sequence-parallel group: ``size`` ranks, ``rank`` among them, ``group`` their
    process group."""

    size: int
    rank: int
    group: object

    def owned(self, length: int) -> int:
        """Positions each rank owns of a row of ``length``: ``ceil(length / size)``."""
        return math.ceil(length / self.size)

    def local_batch(self, batch: dict, halo: int) -> tuple[dict, int]:
        """(this rank's slice of every (B, T, ...) tensor of ``batch``, the positions it owns ``C``): positions
        ``[rank C, (rank + 1) C + halo)`` of the row, zero past its end (no token, no mask, no feature)."""
        T = batch["input_ids"].shape[1]
        own = self.owned(T)
        start = self.rank * own
        stop = start + own + halo
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == T:
                piece = value[:, min(start, T):min(stop, T)]
                missing = stop - start - piece.shape[1]
                if missing:
                    pad = [0, 0] * (value.dim() - 2) + [0, missing]
                    piece = F.pad(piece, pad)
                value = piece
            out[key] = value
        return out, own

    def positions(self, batch_size: int, own: int, device) -> torch.Tensor:
        """(B, C) the row positions of this rank's owned slice."""
        return (self.rank * own + torch.arange(own, device=device)).expand(batch_size, own)

    def blocks(self, anchors: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DFlash's blocks: (this rank's anchors (B, m), their validity (B, m), the group's anchors (B, size m)) of
        the row's ``anchors``/``valid`` (B, n) as group rank 0 drew them, dealt in order, ``m = ceil(n / size)``
        each, padded with invalid blocks anchored at 0."""
        both = torch.cat([anchors, valid.long()], dim=1).contiguous()
        torch.distributed.broadcast(both, src=torch.distributed.get_rank() - self.rank, group=self.group)
        n = anchors.shape[1]
        return self.deal(both[:, :n], both[:, n:].bool())

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """Group rank 0's ``x`` (a 2-D long tensor, its shape its own) on every rank of the group."""
        src = torch.distributed.get_rank() - self.rank
        shape = torch.tensor(x.shape, dtype=torch.long)
        torch.distributed.broadcast(shape, src=src, group=self.group)
        out = x.contiguous() if self.rank == 0 else x.new_empty(tuple(shape.tolist()))
        torch.distributed.broadcast(out, src=src, group=self.group)
        return out

    def deal(self, anchors: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``blocks`` without the broadcast: the group's blocks dealt in order, this rank's share."""
        n = anchors.shape[1]
        m = math.ceil(n / self.size)
        anchors, valid = F.pad(anchors, (0, self.size * m - n)), F.pad(valid, (0, self.size * m - n))
        mine = slice(self.rank * m, (self.rank + 1) * m)
        return anchors[:, mine], valid[:, mine], anchors

    def cache(self, num_layers: int) -> "ShardedUnrollCache":
        return ShardedUnrollCache(self, num_layers)

    def block_layout(self, anchors: torch.Tensor, block_size: int, context_valid: torch.Tensor,
                     whole: BlockLayout) -> "ShardedBlockLayout":
        """DFlash's ``BlockLayout`` for this rank's blocks over its context slice, attending over the group's
        (``ShardedBlockLayout``): the method asks the shard for it, so ``methods/`` needs no import of training."""
        return ShardedBlockLayout(anchors, block_size, context_valid, shard=self, whole=whole)

    def parallel_layout(self, whole: ParallelLayout, order: torch.Tensor) -> "ShardedParallelLayout":
        """P-EAGLE's layout of this rank's entries, attending over the group's (``whole``, ``order``: the method's
        ``deal``; ``ShardedParallelLayout``)."""
        return ShardedParallelLayout(self, whole, order)

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The group's sum of ``values`` (no gradient): counts and metrics."""
        out = values.detach().clone()
        torch.distributed.all_reduce(out, group=self.group)
        return out

    def combine(self, loss: torch.Tensor) -> torch.Tensor:
        """The group's sum of ``loss``, differentiable (the module docstring says why its backward sums too)."""
        return _GroupSum.apply(loss, self.group)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, C, D) local positions, all heads -> (B, H / size, size C, D) all positions, this rank's heads."""
        return _ToHeads.apply(x, self)

    def to_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_heads``."""
        return _ToPositions.apply(x, self)


class ShardedUnrollCache(UnrollCache):
    """An ``UnrollCache`` whose attention runs on this rank's heads over the whole row (module docstring); it keeps
    each step's keys and values gathered, (B, n_kv / N, N C, D)."""

    def __init__(self, shard: SequenceShard, num_layers: int = 1):
        super().__init__(num_layers)
        self.shard = shard

    def attend(self, layer: int, q, k, v, scale: float, window: int | None):
        shard = self.shard
        self.keys[layer].append(shard.to_heads(k))
        self.values[layer].append(shard.to_heads(v))
        out = unrolled_attention(shard.to_heads(q), self.keys[layer], self.values[layer], scale, window)
        return shard.to_positions(out)


@dataclass
class ShardedBlockLayout(BlockLayout):
    """A DFlash ``BlockLayout`` of this rank's blocks (``anchors`` (B, m)) over its context slice (``context_valid``
    (B, C)) whose attention runs on this rank's heads over the group's blocks and the whole row (``whole``: the
    group's anchors (B, size m), the row's validity padded to (B, size C)); module docstring."""

    shard: SequenceShard | None = None
    whole: BlockLayout | None = None

    def run(self, q, ctx_k, ctx_v, k, v, scale: float) -> torch.Tensor:
        s = self.shard
        out = self.whole.run(s.to_heads(q), s.to_heads(ctx_k), s.to_heads(ctx_v), s.to_heads(k), s.to_heads(v), scale)
        return s.to_positions(out)


class ShardedParallelLayout(AttentionPattern):
    """P-EAGLE's attention for this rank's entries of a packed row (its depth-0 positions, the slots anchored there):
    an all-to-all gives it every rank's entries on its heads, laid end to end, ``order`` puts them in ``pack``'s
    order, the one-process ``ParallelLayout`` (``whole``) attends, and the inverse order and all-to-all hand back
    this rank's entries on every head."""

    def __init__(self, shard: SequenceShard, whole: ParallelLayout, order: torch.Tensor):
        self.shard, self.whole = shard, whole
        self.order, self.back = order, order.argsort(1)

    def attend(self, q, k, v, scale, window):
        s = self.shard
        q, k, v = (take_entries(s.to_heads(x), self.order) for x in (q, k, v))
        return s.to_positions(take_entries(self.whole.attend(q, k, v, scale, window), self.back))


# --------------------------------------------------------------------------- collectives with exact backward


def _to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    n = shard.size
    B, H, C, D = x.shape
    send = x.reshape(B, n, H // n, C, D).transpose(0, 1).contiguous()  # chunk j: heads j, to rank j
    recv = torch.empty_like(send)  # chunk s: my heads at rank s's positions
    torch.distributed.all_to_all_single(recv, send, group=shard.group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * C, D)


def _to_positions(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    n = shard.size
    B, h, S, D = x.shape
    send = x.reshape(B, h, n, S // n, D).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's positions
    recv = torch.empty_like(send)  # chunk s: rank s's heads at my positions
    torch.distributed.all_to_all_single(recv, send, group=shard.group)
    return recv.transpose(0, 1).reshape(B, n * h, S // n, D)


class _ToHeads(Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _to_heads(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_positions(grad, ctx.shard), None


class _ToPositions(Function):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _to_positions(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.shard), None


class _GroupSum(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None
