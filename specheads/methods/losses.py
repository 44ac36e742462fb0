"""Losses for the EAGLE drafters, written so no (B, T, V) float32 tensor is built more than once.

* ``target_probs``: the target's next-token distribution for chosen rows, computed from the
  post-norm hidden state ``chunk`` rows at a time (optionally restricted to some vocabulary
  columns and renormalised there), plus the target's full-vocabulary argmax.
* ``soft_cross_entropy``: -sum p log softmax(head(h)) over rows, chunked; with ``checkpoint`` the
  draft logits of a chunk are recomputed in the backward pass instead of being kept.
* ``linear_cross_entropy``: the summed (or, through a frozen layer, per-row) hard-label cross-entropy of a linear
  output layer, its gradients computed chunk by chunk in the forward pass, so no (N, V) logits (or their
  gradient) ever exist.
* ``linear_soft_cross_entropy``: the same machinery for a soft cross-entropy against rows of a table of
  distributions (the target's), gathered a chunk at a time: backward keeps neither logits nor labels (EAGLE-3's
  training-time test, ``methods.ttt.ttt_loss``).
* ``feature_loss``: EAGLE-1's smooth-L1 regression of the next feature.
* ``dpace_weights``: D-PACE's detached per-slot weights of a drafted block's cross-entropy.

Both call the head (or the target's LM head) on their ``N`` selected rows padded up to a multiple of
``ROW_MULTIPLE`` with zero rows, whose logits are dropped at once (nothing else is padded or copied). ``N`` is
new at nearly every training step, and under bfloat16 autocast on a CPU oneDNN makes (and caches, with
its own packed copy of the weights) one matmul primitive per new shape: a few recurring shapes keep
that cache small and hit.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specheads.targets import TARGET_CHUNK, logit_softcap

ROW_MULTIPLE = 64
"""Selected rows are padded up to a multiple of this (see the module docstring)."""


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """(N, ...) -> (ceil(N / multiple) * multiple, ...), zero rows appended (``x`` itself when none are)."""
    extra = -x.shape[0] % multiple  # F.pad, not torch.cat: CPU autocast's cat refuses float16 tensors
    return x if not extra else F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


@torch.no_grad()
def target_probs(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 columns: torch.Tensor | None = None, chunk: int = TARGET_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Target distribution and argmax for rows of post-norm hidden states.

    logits_fn: (n, H) -> (n, V) target logits (``target.logits``); hidden: (N, H);
    columns: (V',) ids to keep (softmax over those only) or None for the full vocabulary.
    Returns probs (N, V') float32 and argmax (N,) long over the full vocabulary.
    """
    N = hidden.shape[0]
    width = logits_fn(hidden[:0]).shape[-1] if columns is None else columns.numel()
    probs = torch.empty(N, width, dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(N, dtype=torch.long, device=hidden.device)
    for s in range(0, N, chunk):
        rows = hidden[s:s + chunk]
        logits = logits_fn(pad_rows(rows))[: rows.shape[0]].float()
        argmax[s:s + chunk] = logits.argmax(-1)
        if columns is not None:
            logits = logits.index_select(-1, columns)
        probs[s:s + chunk] = torch.softmax(logits, dim=-1)
    return probs, argmax


def column_logits(target, columns: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """(n, H) post-norm hidden -> (n, len(columns)) target logits on those vocabulary columns only: the LM
    head's rows for ``columns`` (a draft vocabulary is ~1/12 of SmolLM2's, so ~1/12 of the work)."""
    head = target.lm_head
    weight = head.weight.index_select(0, columns.to(head.weight.device))
    bias = None if getattr(head, "bias", None) is None else head.bias.index_select(0, columns.to(head.bias.device))

    cap = logit_softcap(target.config)

    def fn(hidden: torch.Tensor) -> torch.Tensor:
        # in the hidden state's dtype: a bfloat16 target's rows against a float32 head's states (training without
        # autocast) or the other way round
        w = weight.to(hidden.device, hidden.dtype)
        b = None if bias is None else bias.to(hidden.device, hidden.dtype)
        logits = F.linear(hidden, w, b)
        return logits if not cap else torch.tanh(logits / cap) * cap  # as ``Target.logits`` (output_logits)

    return fn


def _soft_ce_chunk(head: Callable, h: torch.Tensor, p: torch.Tensor, lk_weight: float = 0.0,
                   index: torch.Tensor | None = None, row_weight: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if index is not None:  # this chunk's rows of the table, gathered here (again when a checkpoint recomputes)
        p = p.index_select(0, index)
    if row_weight is not None:
        p = p * row_weight[:, None]
    logp = torch.log_softmax(head(pad_rows(h))[: h.shape[0]].float(), dim=-1)
    loss = -(p * logp).sum(-1)
    if lk_weight:  # -log sum_x min(p, q): acceptance_nll with q already normalised
        accept = -torch.log(torch.minimum(p, logp.exp()).sum(-1).clamp_min(1e-12))
        loss = (1 - lk_weight) * loss + lk_weight * accept
    return loss.sum(), logp.argmax(-1)


def soft_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, probs: torch.Tensor,
                       chunk: int = 2048, use_checkpoint: bool = True, lk_weight: float = 0.0,
                       index: torch.Tensor | None = None,
                       row_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy of ``head(hidden)`` against ``probs``, and the draft argmax.

    head: (n, H) -> (n, V) draft logits; hidden: (N, H); probs: (N, V) float32, or with ``index`` (N,) long a
    table (M, V) whose row ``index[i]`` is row i's label, gathered a chunk at a time (a checkpointed chunk keeps
    the table and its slice of ``index``, not an (N, V) copy); row_weight (N,): row i's label scaled by it
    (``probs * row_weight[:, None]``, likewise a chunk at a time).
    A linear head has ``linear_soft_cross_entropy``, which keeps no logits either.
    lk_weight > 0: each row's term is ``(1 - w) * soft CE + w * -log sum_x min(p, q)``, the acceptance objective
    of the LK losses (``acceptance_nll``) against ``probs`` (for EAGLE-3: the target's distribution on the draft
    vocabulary, which is what a draft over that vocabulary can match).
    Returns (loss_sum scalar, argmax (N,) long). Chunks of ``chunk`` rows; when there is more
    than one chunk and ``use_checkpoint``, each chunk's logits are recomputed in backward.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.empty(0, dtype=torch.long, device=hidden.device)
    if hidden.shape[0] <= chunk:
        return _soft_ce_chunk(head, hidden, probs, lk_weight, index, row_weight)
    total, preds = hidden.new_zeros((), dtype=torch.float32), []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk]
        p = probs if index is not None else probs[s:s + chunk]
        rows = (None if index is None else index[s:s + chunk], None if row_weight is None else row_weight[s:s + chunk])
        if use_checkpoint and torch.is_grad_enabled():
            loss, pred = checkpoint(_soft_ce_chunk, head, h, p, lk_weight, *rows, use_reentrant=False)
        else:
            loss, pred = _soft_ce_chunk(head, h, p, lk_weight, *rows)
        total = total + loss
        preds.append(pred)
    return total, torch.cat(preds)


def acceptance_nll(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """(N,) -log sum_x min(p(x), q(x)): minus the log of the probability that speculative sampling accepts a
    token drawn from the draft q (Leviathan et al. 2023), p the target's distribution. The objective the LK
    losses (arXiv 2602.23881) optimise directly instead of its proxy, the KL divergence or cross-entropy."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    return -torch.log(torch.minimum(p, q).sum(-1).clamp_min(1e-12))


def _hard_ce_chunk(head: Callable, h: torch.Tensor, labels: torch.Tensor, target_h: torch.Tensor | None,
                   target_head: Callable | None, lk_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(pad_rows(h))[: h.shape[0]].float()
    loss = F.cross_entropy(logits, labels, reduction="none")
    if lk_weight:
        with torch.no_grad():
            target = target_head(pad_rows(target_h))[: h.shape[0]]
        loss = (1 - lk_weight) * loss + lk_weight * acceptance_nll(logits, target)
    return loss, logits.argmax(-1)


def hard_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                       chunk: int = 2048, use_checkpoint: bool = True, target_hidden: torch.Tensor | None = None,
                       target_head: Callable | None = None, lk_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of ``head(hidden)`` against token ``labels``, and the argmax.

    head: (n, H) -> (n, V) logits; hidden: (N, H); labels: (N,) long. Returns (loss (N,), argmax (N,) long),
    ``chunk`` rows at a time; past one chunk, with ``use_checkpoint``, each chunk's logits are recomputed in
    the backward pass instead of being kept. With ``lk_weight`` > 0 each row's loss is
    ``(1 - lk_weight) * CE + lk_weight * acceptance_nll`` against ``target_head(target_hidden)`` (the target's
    logits for the same rows: (N, H) post-norm states).
    """
    if lk_weight and (target_hidden is None or target_head is None):
        raise ValueError("lk_weight needs the target's hidden states and logits function")
    args = (target_head, lk_weight)
    if hidden.shape[0] <= chunk:
        return _hard_ce_chunk(head, hidden, labels, target_hidden, *args)
    losses, preds = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], labels[s:s + chunk]
        t = None if target_hidden is None else target_hidden[s:s + chunk]
        if use_checkpoint and torch.is_grad_enabled():
            loss, pred = checkpoint(_hard_ce_chunk, head, h, y, t, *args, use_reentrant=False)
        else:
            loss, pred = _hard_ce_chunk(head, h, y, t, *args)
        losses.append(loss)
        preds.append(pred)
    return torch.cat(losses), torch.cat(preds)


LOGIT_CHUNK_BYTES = 1 << 28
"""Float32 logits one chunk of ``linear_cross_entropy`` may hold: 256 MiB (512 rows at a 128k vocabulary)."""
SOFT_CHUNK_BYTES = 1 << 26
"""The same for ``linear_soft_cross_entropy``, whose chunk also holds its (rows, V) labels and a temporary: 64 MiB
(512 rows at a 32k draft vocabulary)."""


def logit_chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Rows of (rows, vocab) float32 logits that fit in ``budget`` bytes (``LOGIT_CHUNK_BYTES``), a multiple of
    ``ROW_MULTIPLE``."""
    return max(ROW_MULTIPLE, (budget or LOGIT_CHUNK_BYTES) // (4 * vocab) // ROW_MULTIPLE * ROW_MULTIPLE)


class SoftTargets:
    """Soft labels for ``linear_soft_cross_entropy``, handed out a chunk of rows at a time: row ``i`` is
    ``probs[index[i]] * row_weight[i]`` (``index`` None: ``probs[i]``; ``row_weight`` None: 1), so no (N, V) copy
    of the rows is ever made; lk_weight as ``soft_cross_entropy``'s."""

    def __init__(self, probs: torch.Tensor, index: torch.Tensor | None = None,
                 row_weight: torch.Tensor | None = None, lk_weight: float = 0.0):
        self.probs, self.index, self.row_weight, self.lk_weight = probs, index, row_weight, float(lk_weight)

    def __len__(self) -> int:
        return self.probs.shape[0] if self.index is None else self.index.numel()

    def rows(self, start: int, n: int, padded: int) -> torch.Tensor:
        """(padded, V) the labels of rows ``start .. start + n``, then ``padded - n`` zero rows."""
        p = (self.probs[start:start + n] if self.index is None
             else self.probs.index_select(0, self.index[start:start + n]))
        if self.row_weight is not None:
            p = p * self.row_weight[start:start + n, None]  # as ``probs * weight[:, None]`` on the whole
        return pad_rows(p, padded)


def _soft_ce_grad(logits: torch.Tensor, p: torch.Tensor, lk_weight: float, grad: bool):
    """(soft CE of each row (n,), d CE_i / d logits (n, V) or None) of float logits against soft labels ``p``:
    ``-(p * log_softmax(logits)).sum(-1)``, mixed with ``-log sum min(p, q)`` by ``lk_weight``, exactly as
    ``_soft_ce_chunk`` (autograd's gradients: torch.minimum's ties split half and half, clamp_min passing at
    the floor). ``logits`` is overwritten."""
    p = p.to(logits.dtype)  # as autograd's promotion of ``p * logp`` (its row sums in the logits' precision)
    top = logits.amax(-1, keepdim=True)
    shifted = logits.sub_(top)
    logp = shifted.sub_(shifted.exp().sum(-1, keepdim=True).log_())  # log_softmax's own formula
    loss = -(p * logp).sum(-1)
    q = logp.exp_()  # logp is not needed past here
    if lk_weight:
        mass = torch.minimum(p, q).sum(-1)
        loss = (1 - lk_weight) * loss + lk_weight * -torch.log(mass.clamp_min(1e-12))
    if not grad:
        return loss, None
    if not lk_weight:  # log_softmax's backward of -p, in q's place
        return loss, q.mul_(p.sum(-1, keepdim=True)).sub_(p)
    g_ce = q * p.sum(-1, keepdim=True) - p
    if lk_weight:
        m = (q < p).to(q.dtype) + 0.5 * (q == p).to(q.dtype)  # d min(p, q) / d q
        mq = m * q  # d sum min / d logp
        scale = torch.where(mass >= 1e-12, -1.0 / mass, 0.0)  # d -log clamp_min(mass) / d mass
        accept = (mq - q * mq.sum(-1, keepdim=True)) * scale[:, None]
        return loss, (1 - lk_weight) * g_ce + lk_weight * accept
    return loss, g_ce


def _ce_chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              softcap: float | None, ignore_index: int, grad: bool, soft: tuple | None = None):
    """One chunk's (CE of each row (n,) float32, 0 on ignored rows; argmax (n,); d CE_i / d logits (n, V) in the
    layer's compute dtype, or None).

    The logits are made in the dtype the plain layer would give (autocast's, else the weights'), then taken to
    float32, as ``F.cross_entropy(layer(h).float(), ...)`` takes them; they and their gradient live only here.
    soft: (labels (n, V), lk_weight) for a soft cross-entropy (``_soft_ce_grad``; the logits then float32 at
    least: float64 logits stay float64); ``labels`` then only marks the padded rows (``ignore_index``)."""
    z = F.linear(h, weight, bias)
    compute = z.dtype
    logits = z.float() if soft is None else z.to(torch.promote_types(z.dtype, torch.float32))
    del z
    tanh = None
    if softcap:  # cap * tanh(z / cap), as output_logits
        tanh = logits.div_(softcap).tanh_()
        logits = tanh * softcap
    top, pred = logits.max(-1)  # max's indices are the first maximal index on ties, as argmax's
    valid = labels != ignore_index
    if soft is not None:
        loss, g = _soft_ce_grad(logits, soft[0], soft[1], grad)
        loss = torch.where(valid, loss, 0.0)
        if g is None:
            return loss, pred, None
        g.mul_(valid[:, None])
        if tanh is not None:
            g.mul_(tanh.square_().neg_().add_(1))
        return loss, pred, g.to(compute)
    y = labels.where(valid, 0)[:, None]
    picked = logits.gather(1, y).squeeze(1)
    probs = logits.sub_(top[:, None]).exp_()  # in place: the logits are not needed past here
    total = probs.sum(-1)
    loss = torch.where(valid, top + total.log() - picked, 0.0)
    if not grad:
        return loss, pred, None
    probs.div_(total[:, None]).scatter_add_(1, y, -valid.to(probs.dtype)[:, None])  # softmax - one_hot(y)
    probs.mul_(valid[:, None])
    if tanh is not None:
        probs.mul_(tanh.square_().neg_().add_(1))  # d(cap * tanh(z / cap)) / dz
    return loss, pred, probs.to(compute)


def _chunked_linear_ce(hidden, weight, bias, labels, softcap, chunk, ignore_index, needs, per_row=False, soft=None):
    """(summed CE, or each row's (N,) with ``per_row``; argmax (N,); [d sum / d hidden, weight, bias] with None
    where not needed: row i of the first is d CE_i / d hidden_i). soft: ``SoftTargets`` (``labels`` then only
    counts the rows), the soft cross-entropy instead, float64 when the layer is."""
    N, grad = hidden.shape[0], any(needs)
    wide = soft is not None and torch.float64 in (hidden.dtype, weight.dtype)
    loss = hidden.new_zeros((N,) if per_row else (), dtype=torch.float64 if wide else torch.float32)
    pred = torch.empty(N, dtype=torch.long, device=hidden.device)
    grad_h = torch.empty_like(hidden) if needs[0] else None
    # float32 sums across chunks, whatever the weights' dtype (as one matmul over all rows would accumulate)
    acc = torch.float64 if wide else torch.float32
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs[2] else None
    for s in range(0, N, chunk):
        h, y = hidden[s:s + chunk], labels[s:s + chunk]
        n = h.shape[0]
        rows = min(chunk, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)  # recurring shapes (module docstring)
        if rows > n:
            h, y = pad_rows(h, rows), torch.cat([y, y.new_full((rows - n,), ignore_index)])
        part, top, g = _ce_chunk(h, weight, bias, y, softcap, ignore_index, grad,
                                 None if soft is None else (soft.rows(s, n, h.shape[0]), soft.lk_weight))
        if per_row:
            loss[s:s + n] = part[:n]
        else:
            loss += part.sum()
        pred[s:s + n] = top[:n]
        if g is None:
            continue
        if grad_h is not None:
            grad_h[s:s + n] = (g @ weight)[:n]
        if grad_w is not None:
            if g.dtype == grad_w.dtype:
                grad_w.addmm_(g.T, h)
            else:  # a bfloat16 product (autocast or bfloat16 weights), summed in float32
                grad_w += g.T @ h
        if grad_b is not None:
            grad_b += g.sum(0, dtype=acc)
        del g  # not alive through the next chunk's
    grads = [grad_h, None if grad_w is None else grad_w.to(weight.dtype),
             None if grad_b is None else grad_b.to(bias.dtype)]
    return loss, pred, grads


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients of the sum are made in the forward pass (no logits kept); backward scales them (row by row,
    for per-row losses: only the hidden states' gradient then exists)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, chunk, ignore_index, needs, per_row, soft=None):
        loss, pred, grads = _chunked_linear_ce(hidden, weight, bias, labels, softcap, chunk, ignore_index, needs,
                                               per_row, soft)
        ctx.mark_non_differentiable(pred)
        ctx.save_for_backward(*grads)
        ctx.per_row = per_row
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, grad_pred):
        # scaled in place: each is used once (a second backward through the graph fails on its version counter)
        if ctx.per_row:
            grad_loss = grad_loss[:, None]
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype) if ctx.per_row else grad_loss)
                 for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, softcap: float | None = None, chunk: int | None = None,
                         ignore_index: int = -100, reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of the logits ``hidden @ weight.T + bias`` (soft-capped to ``softcap * tanh(z /
    softcap)`` when set) against ``labels``, and their argmax, without ever holding all the logits.

    hidden: (N, H); weight: (V, H); bias: (V,) or None; labels: (N,) long, ``ignore_index`` rows count for nothing.
    Returns (loss scalar float32, argmax (N,) long): ``F.cross_entropy(F.linear(hidden, weight, bias).float(),
    labels, reduction="sum")`` and that tensor's ``argmax(-1)``. Rows go ``chunk`` at a time (default: 256 MiB of
    float32 logits, ``logit_chunk_rows``), and each chunk's gradients with respect to hidden, weight and bias are
    made at once, so the extra memory is a few (chunk, V) tensors plus the gradients themselves, instead of
    several (N, V) float32 tensors kept for the backward pass (gigabytes per head at a 128k vocabulary). The
    weight's gradient is summed over chunks in float32.
    The weight is read in the forward pass only, where DeepSpeed ZeRO-3 gathers a parameter that is used outside
    its own module's ``forward``.
    ``reduction="none"`` returns each row's cross-entropy (N,) float32 instead of the sum (0 on ignored rows), for a
    frozen output layer only (a weight or bias that needs a gradient is refused: its gradient sums over rows with
    weights the forward pass cannot know); any later weighting of the rows scales their gradients in backward.
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'sum' or 'none', got {reduction!r}")
    chunk = chunk or logit_chunk_rows(weight.shape[0])
    on = torch.is_grad_enabled()
    needs = tuple(bool(on and t is not None and t.requires_grad) for t in (hidden, weight, bias))
    per_row = reduction == "none"
    if per_row and (needs[1] or needs[2]):
        raise ValueError("linear_cross_entropy: reduction='none' needs a frozen output layer (its weight and bias "
                         "must not require gradients)")
    if not any(needs):
        with torch.no_grad():
            loss, pred, _ = _chunked_linear_ce(hidden, weight, bias, labels, softcap, chunk, ignore_index, needs,
                                               per_row)
        return loss, pred
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, softcap, chunk, ignore_index, needs, per_row)


def linear_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor,
                              index: torch.Tensor | None = None, row_weight: torch.Tensor | None = None,
                              bias: torch.Tensor | None = None, softcap: float | None = None, chunk: int | None = None,
                              lk_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``soft_cross_entropy`` through a linear output layer (``F.linear(hidden, weight, bias)``, soft-capped when
    ``softcap`` is set), on ``linear_cross_entropy``'s machinery: each chunk's gradients with respect to hidden,
    weight and bias are made in the forward pass, so backward keeps no logits and no labels, only those
    gradients ((N, H), (V, H) and (V,), summed over chunks).

    hidden: (N, H); weight: (V, H); probs: (M, V) a table of distributions, row ``i``'s label being
    ``probs[index[i]]`` (``index`` (N,) long; None: ``probs`` itself, M = N), times ``row_weight[i]`` when given
    (N,): rows are gathered a chunk at a time, never as an (N, V) copy. lk_weight: as ``soft_cross_entropy``'s.
    Returns (loss sum, float32, float64 for a float64 layer; argmax (N,) long), equal to ``soft_cross_entropy(
    lambda h: F.linear(h, weight, bias), hidden, probs[index] * row_weight[:, None], lk_weight=lk_weight)`` and
    its gradients to rounding. Chunks of ``chunk`` rows (default: 64 MiB of float32 logits, ``SOFT_CHUNK_BYTES``).
    """
    soft = SoftTargets(probs, index, row_weight, lk_weight)
    if len(soft) != hidden.shape[0]:
        raise ValueError(f"linear_soft_cross_entropy: {hidden.shape[0]} rows of hidden states, {len(soft)} labels")
    chunk = chunk or logit_chunk_rows(weight.shape[0], SOFT_CHUNK_BYTES)
    labels = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)  # marks the rows, not padding
    on = torch.is_grad_enabled()
    needs = tuple(bool(on and t is not None and t.requires_grad) for t in (hidden, weight, bias))
    if not any(needs):
        with torch.no_grad():
            loss, pred, _ = _chunked_linear_ce(hidden, weight, bias, labels, softcap, chunk, -100, needs, False, soft)
        return loss, pred
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, softcap, chunk, -100, needs, False, soft)


def frozen_linear(module) -> torch.nn.Linear | None:
    """``module`` when it is a linear layer whose weight and bias take no gradient (a target's LM head, which
    ``linear_cross_entropy(..., reduction="none")`` can score row by row), else None."""
    if not isinstance(module, torch.nn.Linear) or module.weight.requires_grad:
        return None
    return None if module.bias is not None and module.bias.requires_grad else module


def head_cross_entropy(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy (N,) through the frozen linear ``head`` (``frozen_linear``) and the argmax:
    ``linear_cross_entropy`` at most ``chunk`` rows (and 256 MiB of logits) at a time, ``hidden`` taken to the
    head's dtype as the head's own call would take it."""
    rows = min(chunk, logit_chunk_rows(head.weight.shape[0]))
    return linear_cross_entropy(hidden.to(head.weight.dtype), head.weight, labels, head.bias, softcap, chunk=rows,
                                reduction="none")


DPACE_ALPHA = 0.5
"""D-PACE's floor on each slot's acceptance term: q~ = (1 - alpha) exp(-CE) + alpha (the paper's alpha)."""


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE's per-slot weights (arXiv 2605.18810), computed without gradient.

    ce: (..., S) cross-entropy of each slot of a block against its hard label; mask: (..., S) bool, the slots
    that count. With q~_i = (1 - alpha) exp(-CE_i) + alpha, slot j's weight is sum_{m >= j} prod_{i <= m} q~_i:
    the draft's chance, softened by alpha, of accepting every slot up to m, summed over the slots m that slot j's
    acceptance lets the chain reach (a surrogate for the gradient of the expected accepted length).
    A slot outside ``mask`` is left out of the block: its factor is 1 and its term is not summed, so the
    weights of the counted slots are those of the block with it removed. Padding after a block's end (or a
    label that is not an assistant token) therefore changes neither the other slots' products nor their sums,
    whatever its cross-entropy holds. Returns (..., S) float32, 0 outside ``mask``.
    """
    mask = mask.bool()
    q = torch.where(mask, (1 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(ce, dtype=torch.float32))
    reach = torch.cumprod(q, dim=-1) * mask  # prod_{i <= m} q~_i, summed only at counted m
    return reach.flip(-1).cumsum(-1).flip(-1) * mask


def feature_loss(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Summed (over rows) smooth-L1 between predicted and true features, averaged over H. (N, H) -> scalar."""
    return F.smooth_l1_loss(pred.float(), true.float(), reduction="none").mean(-1).sum()


def uniform_noise(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """x + U(low, high) elementwise (EAGLE's feature noise); identity when low == high == 0."""
    if low == 0 and high == 0:
        return x
    return x + torch.empty_like(x).uniform_(low, high)
