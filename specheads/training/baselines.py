"""Count-based baselines that a trained head must beat on the same data.

``BigramBaseline(distance=d)`` predicts token ``j`` from token ``j - d`` by the most frequent
follower seen in training (ties to the smaller id; an unseen context falls back to the most frequent
label token). For Medusa head ``k`` / EAGLE step ``k`` (predicting ``ids[t+k+2]``) the last token
known at serving time is ``ids[t+1]``, so the matching baseline has ``distance = k + 1``; ``d = 1`` is
the ordinary bigram model. Only labels with ``loss_mask == 1`` are counted, as in training.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def _pairs(seqs: Iterable[Sequence[int]], masks: Iterable[Sequence[int]], distance: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(context tokens, label tokens) for every label j >= distance with mask[j] == 1."""
    ctx, lab = [], []
    for ids, mask in zip(seqs, masks):
        ids = torch.as_tensor(ids, dtype=torch.long)
        keep = torch.as_tensor(mask, dtype=torch.bool)[distance:]
        ctx.append(ids[:-distance][keep] if len(ids) > distance else ids[:0])
        lab.append(ids[distance:][keep])
    if not ctx:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(ctx), torch.cat(lab)


class BigramBaseline:
    """Most-frequent-follower table at a fixed distance. ``fit`` then ``predict`` / ``accuracy``."""

    def __init__(self, distance: int = 1):
        if distance < 1:
            raise ValueError(f"distance must be >= 1, got {distance}")
        self.distance = distance
        self.table: dict[int, int] = {}
        self.fallback = 0

    def fit(self, seqs: Iterable[Sequence[int]], masks: Iterable[Sequence[int]]) -> "BigramBaseline":
        ctx, lab = _pairs(seqs, masks, self.distance)
        if not len(lab):
            raise ValueError("no labelled pairs to fit the bigram baseline on")
        self.fallback = int(torch.bincount(lab).argmax())
        V = int(max(ctx.max(), lab.max())) + 1
        pairs, counts = torch.unique(ctx * V + lab, return_counts=True)
        # Sort by (context, -count, label): the first row of each context is its prediction.
        order = sorted(range(len(pairs)), key=lambda i: (int(pairs[i]) // V, -int(counts[i]), int(pairs[i]) % V))
        for i in order:
            c = int(pairs[i]) // V
            if c not in self.table:
                self.table[c] = int(pairs[i]) % V
        return self

    def predict(self, context: torch.Tensor) -> torch.Tensor:
        """(N,) context tokens -> (N,) predicted tokens."""
        return torch.tensor([self.table.get(int(c), self.fallback) for c in context.tolist()], dtype=torch.long)

    def accuracy(self, seqs: Iterable[Sequence[int]], masks: Iterable[Sequence[int]]) -> tuple[int, int]:
        """(correct, total) top-1 on held-out sequences."""
        ctx, lab = _pairs(seqs, masks, self.distance)
        return int((self.predict(ctx) == lab).sum()), int(len(lab))


def bigram_accuracy(train_rows, held_rows, distance: int = 1) -> float:
    """Held-out top-1 accuracy of a bigram baseline fitted on ``train_rows``.

    rows: anything with ``input_ids`` and ``loss_mask`` per row (a prepared ``datasets.Dataset``,
    a list of dicts, or a dict of columns).
    """
    def cols(rows):
        if isinstance(rows, dict):
            return rows["input_ids"], rows["loss_mask"]
        if hasattr(rows, "column_names"):
            return rows["input_ids"], rows["loss_mask"]
        return [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows]

    model = BigramBaseline(distance).fit(*cols(train_rows))
    correct, total = model.accuracy(*cols(held_rows))
    return correct / total if total else float("nan")


def bigram_report(dataset, train_idx, held_idx, distances=(1, 2, 3), max_length: int | None = None) -> dict[str, float]:
    """Held-out top-1 accuracy of bigram baselines fitted on the training rows of ``dataset``.

    dataset: anything with ``token_rows(indices) -> (input_ids lists, loss_mask lists)`` (a
    ``TokenDataset`` or ``FeatureDataset``); rows are cut to ``max_length`` as training cuts them.
    Returns ``{"bigram_d{d}_acc": ...}`` for each distance (d = 1: the last token known when a draft
    of ``ids[t+2]`` is made; Medusa head k / EAGLE step k compare with ``d = k + 1``).
    """
    def cut(rows):
        ids, masks = rows
        if max_length:
            ids, masks = [r[:max_length] for r in ids], [m[:max_length] for m in masks]
        return ids, masks

    train_rows, held_rows = cut(dataset.token_rows(train_idx)), cut(dataset.token_rows(held_idx))
    out = {}
    for d in distances:
        correct, total = BigramBaseline(d).fit(*train_rows).accuracy(*held_rows)
        out[f"bigram_d{d}_acc"] = correct / total if total else float("nan")
    return out
