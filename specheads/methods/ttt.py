"""Training-time test (EAGLE-3 / HASS): unroll the drafter on its own outputs, as drafting will.

Alignment (docs/architecture.md): step 0 at position ``t`` reads the drafter's input hidden at
``t`` and the token ``ids[t+1]`` and predicts ``ids[t+2]``. Step ``i`` reads the drafter's own
step ``i-1`` output at ``t`` (pre-norm), the teacher-forced token ``ids[t+1+i]`` and position
``t+i``, and predicts ``ids[t+2+i]``, whose target distribution is the target's at ``t+1+i``.

Attention (the pattern a chain draft rooted at ``t`` sees at inference): step ``i`` at ``t``
attends causally to the step-0 keys of positions ``<= t`` and to the keys that steps ``1..i``
produced at ``t`` itself (``specheads.models.layers.UnrollCache``).

A drafter used here provides ``decode(hidden, input_ids, position_ids, attn_mask, cache) -> h_out``,
``logits(h_out) -> draft logits``, ``to_target_ids(draft_ids) -> target ids`` and
``num_draft_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from specheads.acceptance_math import chain_tau
from specheads.models.layers import UnrollCache
from specheads.models.mrope import step_positions
from specheads.methods.base import POSITIONS_KEY as POSITIONS
from specheads.methods.losses import (SOFT_CHUNK_BYTES, feature_loss, linear_soft_cross_entropy, logit_chunk_rows,
                                      soft_cross_entropy)
from specheads.models.eagle3 import Eagle3Model
from specheads.targets import target_argmax


def shift_tokens(input_ids: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """(B, T) -> (B, T) with ``out[:, t] = input_ids[:, t+n]`` and ``fill`` past the end."""
    out = torch.full_like(input_ids, fill)
    if n < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - n] = input_ids[:, n:]
    return out


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions 0..T-1 (sequences are right-padded)."""
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).expand(B, T)


def unroll(model, hidden: torch.Tensor, input_ids: torch.Tensor, steps: int,
           position_ids: torch.Tensor | None = None, cache: UnrollCache | None = None
           ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(i, h_out_i (B, T, H))`` for ``i < steps``; step ``i+1`` reads ``h_out_i``.

    hidden: (B, T, H) the drafter's step-0 input (EAGLE-3: already fused); input_ids: (B, T') with T' >= T (the
    tokens after the first T positions feed their later steps: a sequence-parallel slice and its halo);
    position_ids: (B, T), default 0..T-1, or (B, T, 3) a vision-language target's M-RoPE positions (step ``i > 0``
    at the temporal position + i, ``mrope.step_positions``); cache: a fresh ``UnrollCache`` (default) or a
    sequence-parallel one.
    """
    T = hidden.shape[1]
    if position_ids is None:
        position_ids = default_positions(input_ids[:, :T])
    cache = UnrollCache(model.num_draft_layers) if cache is None else cache
    h = hidden
    for i in range(steps):
        h = model.decode(h, shift_tokens(input_ids, 1 + i)[:, :T], step_positions(position_ids, i), None, cache)
        yield i, h


def step_rows(batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(b, t)`` whose step-``step`` prediction (of ``ids[t+2+step]``) is trained and scored.

    Those where ``ids[t+2+step]`` exists, is a real token and an assistant token.
    """
    ids = batch["input_ids"]
    T, k = ids.shape[1], 2 + step
    ok = torch.zeros_like(ids, dtype=torch.bool)
    if k < T:
        ok[:, : T - k] = (batch["loss_mask"][:, k:] > 0) & (batch["attention_mask"][:, k:] > 0)
    return ok.nonzero(as_tuple=True)


@dataclass
class TargetRows:
    """The target's distribution at the rows a loss needs.

    probs: (N, V') float32 (the draft vocabulary, renormalised); argmax: (B, T) full-vocabulary
    target argmax; row_of: (B, T) long index into ``probs`` (-1 where not computed);
    in_vocab: (B, T) bool, the target argmax lies in the draft vocabulary.
    """

    probs: torch.Tensor
    argmax: torch.Tensor
    row_of: torch.Tensor
    in_vocab: torch.Tensor


@dataclass
class StepStats:
    loss: torch.Tensor
    correct: int
    total: int


def _linear_head(model) -> torch.nn.Linear | None:
    """``model.lm_head`` when ``model.logits(h)`` is ``model.lm_head(model.normed(h))`` with a linear ``lm_head``
    (EAGLE-3's ``logits``, not overridden), else None. A head whose weight DeepSpeed ZeRO-3 partitions (``ds_id``)
    is None too: the linear path makes the weight's gradient in the forward pass, of the gathered shape, which the
    partitioned parameter refuses in backward; the generic path goes through the module as ZeRO-3 expects."""
    head = getattr(model, "lm_head", None)
    if (isinstance(head, torch.nn.Linear) and getattr(type(model), "logits", None) is Eagle3Model.logits
            and not hasattr(head.weight, "ds_id")):
        return head
    return None


def ttt_loss(model, hidden: torch.Tensor, batch: dict[str, torch.Tensor], rows: TargetRows, steps: int,
             decay: float = 0.8, chunk: int = 2048, feature_weight: float = 0.0,
             offpath_weight: float = 1.0, lk_weight: float = 0.0, shard=None) -> tuple[torch.Tensor, list[StepStats]]:
    """Weighted sum over steps of the mean soft cross-entropy (weights ``decay**i``).

    Step ``i`` is trained on ``step_rows`` whose target argmax lies in the draft vocabulary.
    feature_weight > 0 adds, per step, that weight times EAGLE-1's smooth-L1 regression of the
    drafter's normed output (``model.normed(h_out)``) on the target's post-norm state at the predicted
    position (``batch["hidden_last"]`` at ``t+1+i``): a dense signal that, with the target's LM-head
    rows, makes the draft logits the target's.
    offpath_weight < 1 weighs down the rows whose input token ``ids[t+1+i]`` is an assistant token
    other than the target's argmax at ``t+i`` (a state greedy drafting never reaches: it only feeds
    the target's own choices); the step's loss is then the weighted mean.
    lk_weight > 0 mixes in the LK acceptance objective (``losses.soft_cross_entropy``); not with offpath_weight < 1,
    which scales the target distribution itself.
    ``batch["positions"]`` (B, T, 3), where the store holds them: a vision-language target's M-RoPE positions, which
    the draft rotates by (``unroll``).
    shard: a ``specheads.training.sequence_parallel.SequenceShard``: ``hidden`` holds this rank's C positions of the
    row, ``batch`` and ``rows`` those plus the ``steps + 1`` after them; each step's loss is this rank's sum over
    the group's count, the total the group's sum (differentiable), the stats the group's.
    Returns (loss scalar, per-step stats with accuracy against the target argmax on those rows).
    """
    total, stats, own = None, [], hidden.shape[1]
    position_ids, cache = _unroll_positions(model, hidden, batch, shard)
    for i, h_out in unroll(model, hidden, batch["input_ids"], steps, position_ids, cache):
        b, t, idx, weight = _step_targets(batch, rows, i, own, offpath_weight)
        n, denom = _step_counts(b.numel(), weight, shard, hidden.device)
        # the step's labels are rows.probs[idx] (* weight), gathered a chunk at a time inside the loss, never copied
        # whole (steps x (N, V) float32 kept for backward, 7 GiB at 8k tokens and 7 steps)
        loss_sum, pred = draft_soft_loss(model, h_out[b, t], rows.probs, idx, weight, chunk, lk_weight)
        step_loss = loss_sum / denom
        if feature_weight:
            true = batch["hidden_last"][b, t + 1 + i]
            step_loss = step_loss + feature_weight * feature_loss(model.normed(h_out[b, t]), true) / max(n, 1)
        correct = int((model.to_target_ids(pred) == rows.argmax[b, t + 1 + i]).sum())
        stats.append(StepStats(step_loss.detach(), correct, n))
        # The 0 * sum keeps every parameter in the graph even when a step has no rows.
        term = decay ** i * step_loss + 0.0 * h_out.sum() if total is None else decay ** i * step_loss
        total = term if total is None else total + term
    if shard is not None:
        total, stats = shard.combine(total), _group_stats(stats, shard)
    return total, stats


def _unroll_positions(model, hidden: torch.Tensor, batch: dict[str, torch.Tensor], shard):
    """The positions the draft unrolls at (a shard's, or a vision-language target's M-RoPE positions, as the engine
    hands them to the draft; None: the default) and a shard's cache (None without one)."""
    position_ids = cache = None
    if shard is not None:
        position_ids = shard.positions(hidden.shape[0], hidden.shape[1], hidden.device)
        cache = shard.cache(model.num_draft_layers)
    if POSITIONS in batch:
        position_ids = batch[POSITIONS][:, :hidden.shape[1]]
    return position_ids, cache


def _step_targets(batch: dict[str, torch.Tensor], rows: TargetRows, i: int, own: int, offpath_weight: float):
    """Step ``i``'s rows (b, t) whose target argmax lies in the draft vocabulary, their label rows in
    ``rows.probs``, and their weights (None unless ``offpath_weight`` != 1: the off-path rows weighed down)."""
    b, t = step_rows(batch, i)
    keep = rows.in_vocab[b, t + 1 + i] & (t < own)  # a shard's halo positions are another rank's
    b, t = b[keep], t[keep]
    idx = rows.row_of[b, t + 1 + i]
    weight = None
    if offpath_weight != 1.0:
        offpath = (rows.row_of[b, t + i] >= 0) & (batch["input_ids"][b, t + 1 + i] != rows.argmax[b, t + i])
        weight = torch.where(offpath, offpath_weight, 1.0).to(rows.probs.dtype)
    return b, t, idx, weight


def _step_counts(n: int, weight: torch.Tensor | None, shard, device: torch.device) -> tuple[int, float]:
    """The step's row count and its loss's denominator (the rows, or their total weight); a shard's are the
    group's."""
    weighed = float(n) if weight is None else float(weight.sum())
    if shard is not None:  # the group's counts: the step's loss is the one-process mean
        counts = shard.total(torch.tensor([n, weighed], dtype=torch.float64, device=device))
        n, weighed = int(counts[0]), float(counts[1])
    denom = float(max(n, 1)) if weight is None else max(weighed, 1e-6)
    return n, denom


def draft_soft_loss(model, hidden: torch.Tensor, probs: torch.Tensor, index: torch.Tensor,
                    weight: torch.Tensor | None = None, chunk: int = 2048, lk_weight: float = 0.0):
    """(summed soft cross-entropy of ``model.logits(hidden)`` against ``probs[index]`` (* ``weight``), the draft's
    argmax) with the labels gathered from the table a chunk at a time: through the linear head's fused loss where
    the model has one (``_linear_head``: gradients made in the forward pass, no logits or labels kept for backward),
    else ``soft_cross_entropy``'s checkpointed chunks."""
    head = _linear_head(model)
    if head is not None:
        return linear_soft_cross_entropy(
            model.normed(hidden), head.weight, probs, index, weight, head.bias,
            chunk=min(chunk, logit_chunk_rows(head.weight.shape[0], SOFT_CHUNK_BYTES)), lk_weight=lk_weight)
    return soft_cross_entropy(model.logits, hidden, probs, chunk=chunk, lk_weight=lk_weight, index=index,
                              row_weight=weight)


def _group_stats(stats: list[StepStats], shard) -> list[StepStats]:
    """Per-step stats of a sequence-parallel group: losses and correct counts summed (counts are already the
    group's)."""
    local = torch.tensor([[float(s.loss), s.correct] for s in stats], dtype=torch.float64,
                         device=stats[0].loss.device)
    summed = shard.total(local)
    return [StepStats(loss.to(s.loss), int(c), s.total) for s, (loss, c) in zip(stats, summed)]


@torch.no_grad()
def unrolled_accuracy(model, hidden: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor,
                      steps: int, chunk: int = 1024) -> dict[str, float]:
    """Top-1 agreement with the target's argmax at each unrolled step, over all ``step_rows``.

    reference: (B, T) the target's full-vocabulary argmax (its prediction of ids[t+1]);
    draft logits are computed ``chunk`` rows at a time.
    A target token outside the draft vocabulary counts as a miss. Returns sums
    ``step{i}_correct / step{i}_total`` (step i alone, earlier inputs teacher-forced) and
    ``joint{i}_correct / joint{i}_total`` (steps 0..i all right at the same position) and
    ``data{i}_correct / data{i}_total`` (step i's prediction equals the data token ``ids[t+2+i]``) and
    ``onpath{i}_correct / onpath{i}_total`` (step i on the rows whose input token ``ids[t+1+i]`` is the
    target's argmax at ``t+i``: the states greedy drafting reaches, so the closest to its acceptance).
    """
    out: dict[str, float] = {}
    all_right = torch.ones_like(reference, dtype=torch.bool)
    for i, h_out in unroll(model, hidden, batch["input_ids"], steps, batch.get(POSITIONS)):
        T = reference.shape[1]
        pred = model.to_target_ids(target_argmax(model.logits, h_out[:, : T - 1 - i], chunk))  # (B, T-1-i)
        right = torch.zeros_like(all_right)
        right[:, : T - 1 - i] = pred == reference[:, 1 + i:]
        all_right &= right
        b, t = step_rows(batch, i)
        out[f"step{i}_correct"] = float(right[b, t].sum())
        # Against the data token itself (what a count baseline such as a bigram is scored on).
        ids = batch["input_ids"]
        data = torch.zeros_like(all_right)
        if T - 2 - i > 0:
            data[:, : T - 2 - i] = pred[:, : T - 2 - i] == ids[:, 2 + i:]
        out[f"data{i}_correct"] = float(data[b, t].sum())
        out[f"data{i}_total"] = float(b.numel())
        out[f"step{i}_total"] = float(b.numel())
        out[f"joint{i}_correct"] = float(all_right[b, t].sum())
        out[f"joint{i}_total"] = float(b.numel())
        onpath = ids[b, t + 1 + i] == reference[b, t + i]
        out[f"onpath{i}_correct"] = float(right[b, t][onpath].sum())
        out[f"onpath{i}_total"] = float(onpath.sum())
    return out


def _per_step(metrics: dict[str, float], name: str) -> list[float]:
    accs, i = [], 0
    while True:
        if f"{name}{i}_acc" in metrics:
            accs.append(metrics[f"{name}{i}_acc"])
        elif f"{name}{i}_total" in metrics:
            total = metrics[f"{name}{i}_total"]
            accs.append(metrics.get(f"{name}{i}_correct", 0.0) / total if total else 0.0)
        else:
            return accs
        i += 1


def summarize_steps(metrics: dict[str, float]) -> dict[str, float]:
    """Derived metrics from per-step accuracies (``step{i}_acc`` or ``step{i}_correct/_total`` sums).

    tau_estimate = 1 + sum_i prod_{j<=i} step_j accuracy (marginal basis); tau_joint = 1 + sum_i
    joint_i accuracy (joint basis: the fraction of positions where steps 0..i are all right); both
    ``acceptance_math.chain_tau``.
    """
    out = {}
    steps = _per_step(metrics, "step")
    if steps:
        out.update({f"step{i}_acc": a for i, a in enumerate(steps)})
        out["tau_estimate"] = chain_tau(steps, "marginal")
    joint = _per_step(metrics, "joint")
    if joint:
        out["tau_joint"] = chain_tau(joint, "joint")
    return out
