"""Where training batches come from and how they are split between processes.

A ``BatchSource`` yields one epoch's micro-batches from index ``start`` on, in an order fixed by the
epoch number, so the data position (epoch, index) is enough to resume. With ``W`` processes each
group of ``W`` consecutive batches gives rank ``r`` its ``r``-th (a ragged tail is dropped); with a
tensor-parallel target the split is over its data-parallel groups. One process with batch ``2b`` and
two with ``b`` see the same rows per optimizer step only when a step covers whole epochs (each epoch
shuffles its list of batches, and batches of ``2b`` and of ``b`` make different lists), and their
losses agree exactly only when micro-batches count equal labels (losses are per-token means per
micro-batch, averaged over ranks): ``tests/distributed/test_equivalence.py``. Features a batch lacks are computed online from the frozen target
(``prepare_batch``), so offline (feature store) and online batches go through the same loop.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import torch

from specheads.data.features import LengthGroupedBatchSampler, add_features, collate_features
from specheads.data.store import FeatureSpec
from specheads.targets import Target, data_parallel_share


class BatchSource(Protocol):
    """Micro-batches (dicts of tensors, see ``Method``) of one epoch, from index ``start`` on."""

    def batches(self, epoch: int, start: int = 0) -> Iterable[dict[str, torch.Tensor]]: ...


class IterableSource:
    """Wrap ``fn(epoch) -> iterable of batches`` (deterministic per epoch) as a ``BatchSource``."""

    def __init__(self, fn: Callable[[int], Iterable[dict[str, torch.Tensor]]]):
        self.fn = fn

    def batches(self, epoch: int, start: int = 0) -> Iterable[dict[str, torch.Tensor]]:
        return itertools.islice(self.fn(epoch), start, None)


class DatasetBatches:
    """A ``BatchSource`` over a map-style dataset with ``lengths`` (``specheads.data.features``'
    ``FeatureDataset`` for a store, ``TokenDataset`` for prepared tokens): length-grouped batches
    under a token budget, shuffled per epoch by ``(seed, epoch)``. ``indices`` selects a subset;
    ``max_length`` cuts every sample to its first ``max_length`` tokens; ``pad_to_multiple_of`` pads each
    batch's length up to a multiple (a few recurring shapes let the allocator reuse its blocks).
    Batches are yielded as loaders (zero-argument callables) so each process reads only its share.
    """

    def __init__(self, dataset, max_tokens: int | None = 4096, batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, indices: Sequence[int] | None = None,
                 max_length: int | None = None, pad_to_multiple_of: int = 1):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
        self.dataset, self.max_tokens, self.batch_size = dataset, max_tokens, batch_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.shuffle, self.seed, self.max_length = shuffle, seed, max_length
        self.indices = list(range(len(dataset))) if indices is None else list(indices)
        self.lengths = [min(dataset.lengths[i], max_length or dataset.lengths[i]) for i in self.indices]
        if not self.indices:
            raise ValueError("DatasetBatches over an empty selection: nothing to train or evaluate on")

    def _plan(self, epoch: int) -> list[list[int]]:
        sampler = LengthGroupedBatchSampler(self.lengths, self.max_tokens, self.batch_size, self.shuffle, self.seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    def __len__(self) -> int:
        return len(self._plan(0))

    def batches(self, epoch: int, start: int = 0) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
        for idx in self._plan(epoch)[start:]:
            yield functools.partial(self._load, [self.indices[i] for i in idx])

    def _load(self, rows: list[int]) -> dict[str, torch.Tensor]:
        ds = self.dataset
        samples = ds.rows(rows) if hasattr(ds, "rows") else [ds[i] for i in rows]
        if self.max_length:
            samples = [{k: (v[: self.max_length] if torch.is_tensor(v) else v) for k, v in x.items()} for x in samples]
        return collate_features(samples, self.pad_to_multiple_of)


def split_rows(n: int, eval_rows: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic (train indices, held-out indices) of ``n`` rows, ``eval_rows`` held out."""
    if not 0 <= eval_rows < n:
        raise ValueError(f"cannot hold out {eval_rows} of {n} rows")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[eval_rows:]), sorted(perm[:eval_rows])


def _shard(source: BatchSource, epoch: int, start: int, world: int, rank: int) -> Iterator[tuple[int, dict]]:
    """Yield (next position, this rank's batch) per group of ``world`` batches; a ragged tail is dropped.

    A source may yield loaders (zero-argument callables) instead of batches; only this rank's is called.
    """
    group: list = []
    pos = start
    for batch in source.batches(epoch, start):
        group.append(batch)
        if len(group) == world:
            pos += world
            mine = group[rank]
            yield pos, (mine() if callable(mine) else mine)
            group = []


def micro_batches(source: BatchSource, epoch: int, pos: int, world: int = 1, rank: int = 0):
    """Endless stream of (epoch, next position, batch) from the data position (epoch, pos) on.

    With a tensor-parallel target the ranks of a group read the same batches: data is split over
    data-parallel ranks (``specheads.targets.data_parallel_share``), not over processes."""
    world, rank = data_parallel_share(world, rank)
    while True:
        got = False
        for nxt, batch in _shard(source, epoch, pos, world, rank):
            got = True
            yield epoch, nxt, batch
        if not got and pos == 0:
            raise ValueError(f"epoch {epoch} of the training data holds fewer than {world} batches")
        epoch, pos = epoch + 1, 0


def prepare_batch(batch: dict[str, torch.Tensor], target: Target, spec: FeatureSpec, device) -> dict[str, torch.Tensor]:
    """Move a batch to ``device``, cast stored features to float32 (what online features are),
    compute missing features with ``specheads.data.features.add_features`` (the function collection uses)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if k.startswith("hidden_") and v.is_floating_point() and v.dtype != torch.float32:
                v = v.float()
        out[k] = v
    return add_features(out, target, spec)
