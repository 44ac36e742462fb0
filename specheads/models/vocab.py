"""The EAGLE-3 draft vocabulary: the most frequent target tokens among those the loss trains on.

Layout (the one vLLM, SGLang and vLLM-speculators load):
``d2t`` long ``(V_draft,)`` with ``target_id = draft_id + d2t[draft_id]`` (draft ids sorted by
target id, so ``d2t`` is non-decreasing and ``>= 0``), and ``t2d`` bool ``(V_target,)`` marking the
target ids that are in the draft vocabulary. Hence ``arange(V_draft) + d2t == t2d.nonzero()``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Collection, Iterable

import numpy as np
import torch

from specheads.prepared import load_prepared

log = logging.getLogger(__name__)


def count_loss_tokens(dataset, vocab_size: int, max_samples: int | None = None,
                      rows: Collection[str] | None = None) -> torch.Tensor:
    """Count target ids at loss-masked positions of a prepared dataset (or a path to one).

    dataset: a ``datasets.Dataset`` with ``input_ids`` and ``loss_mask`` columns, an iterable of
    such rows, or the folder of a prepared dataset. rows: count only the rows whose ``id`` (or, for
    rows without one, position as a string) is in it, e.g. the training rows, so held-out and
    evaluation rows never shape the vocabulary; None counts every row. max_samples: at most this
    many counted rows. Returns counts (vocab_size,) int64.
    """
    if isinstance(dataset, (str, Path)):
        dataset, _ = load_prepared(str(dataset))
    keep = None if rows is None else {str(r) for r in rows}
    counts = np.zeros(vocab_size, dtype=np.int64)
    n = 0
    for i, row in enumerate(_rows(dataset)):
        if keep is not None and str(row.get("id", i)) not in keep:
            continue
        if max_samples is not None and n >= max_samples:
            break
        n += 1
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=bool)
        if ids.shape != mask.shape:
            raise ValueError(f"row {i}: input_ids {ids.shape} and loss_mask {mask.shape} differ in length")
        sel = ids[mask]
        if sel.size and (sel.min() < 0 or sel.max() >= vocab_size):
            raise ValueError(f"row {i}: token id {int(sel.max())} outside the target vocabulary of {vocab_size}")
        counts += np.bincount(sel, minlength=vocab_size)
    return torch.from_numpy(counts)


def _rows(dataset) -> Iterable[dict]:
    if hasattr(dataset, "select_columns"):
        # Arrow batches are far faster than row dicts on large datasets.
        cols = ["input_ids", "loss_mask"] + (["id"] if "id" in dataset.column_names else [])
        for batch in dataset.select_columns(cols).iter(batch_size=256):
            ids = batch.get("id") or [None] * len(batch["input_ids"])
            for i, m, r in zip(batch["input_ids"], batch["loss_mask"], ids):
                yield {"input_ids": i, "loss_mask": m} if r is None else {"input_ids": i, "loss_mask": m, "id": r}
    else:
        yield from dataset


def build_draft_vocab(counts_or_dataset, draft_vocab_size: int,
                      target_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``draft_vocab_size`` most frequent ids; return ``(d2t (V_draft,) long, t2d (V_target,) bool)``.

    counts_or_dataset: token counts (V_target,) or anything ``count_loss_tokens`` reads (then
    ``target_vocab_size`` is required). Ties are broken by the lower id. When fewer distinct ids
    occur than requested, the rest is filled with the lowest unseen ids so the size is exact.
    A size above the target vocabulary is capped at it.
    """
    if isinstance(counts_or_dataset, torch.Tensor):
        counts = counts_or_dataset.to(torch.int64).flatten()
        if target_vocab_size is not None and counts.numel() != target_vocab_size:
            raise ValueError(f"counts cover {counts.numel()} ids but the target vocabulary has {target_vocab_size}")
    else:
        if target_vocab_size is None:
            raise ValueError("build_draft_vocab from a dataset needs target_vocab_size")
        counts = count_loss_tokens(counts_or_dataset, target_vocab_size)
    V = counts.numel()
    if draft_vocab_size <= 0:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size > V:
        log.info("draft vocabulary of %d capped at the target vocabulary size %d", draft_vocab_size, V)
        draft_vocab_size = V
    seen = int((counts > 0).sum())
    if seen < draft_vocab_size:
        log.info("only %d distinct tokens seen; filling the draft vocabulary of %d with unseen ids", seen, draft_vocab_size)
    # Stable descending sort: equal counts keep ascending id order.
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft ids (any shape) to target ids."""
    return draft_ids + d2t[draft_ids]


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted (loss-masked) tokens that the draft vocabulary contains."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
