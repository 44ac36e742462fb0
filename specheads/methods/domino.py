"""Domino training (model: ``specheads.models.domino``; anchors and blocks are DFlash's, ``specheads.methods.dflash``).

Anchors are drawn as for DFlash. The slot that predicts ``x[a+m]`` (``m >= 1``; slot ``m-1`` with ``shift_label``,
slot ``m`` without) is labelled as DFlash labels position ``a+m`` (the target's greedy token there with
``labels=target``, the data's with ``labels=data``) and weighted ``w_m = exp(-(m-1)/gamma)`` times ``loss_mask`` and
``attention_mask`` at ``a+m`` (zero past the row). The prefix GRU reads the block's earlier tokens teacher-forced:
the anchor, then the earlier slots' labels (the data tokens with ``labels=data``, what ModelOpt feeds; the target's
greedy tokens with ``labels=target``, what greedy drafting feeds). The loss mixes the corrected and the backbone's
cross-entropies, each the weighted mean ``sum w CE / sum w``:

    L = (1 - lambda) * CE(final) + lambda * CE(base)
    lambda = lambda_base_start * max(0, 1 - progress / lambda_base_decay_ratio)
    progress = max(step / total_steps, minutes trained / budget_minutes)

so training starts on the backbone alone (lambda = 1: the correction gets no gradient, hence
``find_unused_parameters``) and ends on the corrected drafts. Under a time budget (``budget_minutes``, the run's
``train.max_minutes``) the share of it used counts as progress too, as the learning-rate schedule's decay does:
a budget that stops training long before ``total_steps`` still ends on the corrected drafts (the clock is this
process's, from the first step; a resumed run restarts it). Neither set keeps lambda at its start. No
distillation term.

Held-out metrics: DFlash's ``step{m-1}``/``joint{m-1}`` sums of the corrected drafts, teacher-forced.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specheads.decoding.domino_drafter import DominoDrafter
from specheads.methods.base import ARGMAX_KEY, StepOutput
from specheads.methods.dflash import DFlashMethod, block_chain, init_from_target, slot_cross_entropy
from specheads.models.dflash import BlockLayout
from specheads.models.domino import DominoConfig, DominoModel
from specheads.targets import Target, target_argmax


def mix_weight(step: int, start: float, decay_ratio: float, total_steps: int | None,
               time_fraction: float | None = None) -> float:
    """lambda at ``step``: ``start`` falling linearly to 0 over ``decay_ratio`` of the training, whose progress is the
    larger of ``step / total_steps`` and ``time_fraction`` (the share of a time budget used); either may be None."""
    parts = [p for p in (None if total_steps is None else step / total_steps, time_fraction) if p is not None]
    if not parts:
        return float(start)
    if decay_ratio <= 0:
        return 0.0
    return float(start) * max(0.0, 1.0 - max(parts) / decay_ratio)


class DominoMethod(DFlashMethod):
    """DFlash's settings plus gru_hidden_dim (G, null = 1024 capped at the target's hidden size), emb_dim (E, null
    = 256, capped alike), pure_draft_prefix_len, shift_label, lambda_base_start, lambda_base_decay_ratio,
    total_steps and budget_minutes (the training's length in steps and in minutes, either null). ``loss`` and
    ``lk_weight`` are DFlash's plain cross-entropy only."""

    name = "domino"
    find_unused_parameters = True  # the correction gets no gradient while lambda = 1

    def __init__(self, num_layers: int = 1, block_size: int = 16, aux_layers=None, mask_token_id: int | None = None,
                 anchors: int = 64, gamma: float = 7.0, labels: str = "target", eval_anchors: int | None = None,
                 head_chunk: int = 2048, target_chunk: int = 1024, gru_hidden_dim: int | None = None,
                 emb_dim: int | None = None, pure_draft_prefix_len: int = 1, shift_label: bool = True,
                 lambda_base_start: float = 1.0, lambda_base_decay_ratio: float = 1.0, total_steps: int | None = None,
                 budget_minutes: float | None = None, init_layer_from_target: bool = False):
        super().__init__(num_layers=num_layers, block_size=block_size, aux_layers=aux_layers,
                         mask_token_id=mask_token_id, anchors=anchors, gamma=gamma, labels=labels,
                         eval_anchors=eval_anchors, head_chunk=head_chunk, target_chunk=target_chunk,
                         init_layer_from_target=init_layer_from_target)
        if not 0.0 <= lambda_base_start <= 1.0 or lambda_base_decay_ratio < 0:
            raise ValueError(f"domino: lambda_base_start must lie in [0, 1] and lambda_base_decay_ratio be "
                             f"non-negative (got {lambda_base_start}, {lambda_base_decay_ratio})")
        if pure_draft_prefix_len < 0 or (total_steps is not None and total_steps < 1) or (
                budget_minutes is not None and not budget_minutes > 0):
            raise ValueError(f"domino: pure_draft_prefix_len must be >= 0, total_steps >= 1 or null and budget_minutes "
                             f"> 0 or null (got {pure_draft_prefix_len}, {total_steps}, {budget_minutes})")
        if gru_hidden_dim is not None and gru_hidden_dim < 1 or emb_dim is not None and emb_dim < 1:
            raise ValueError(f"domino: gru_hidden_dim and emb_dim must be positive (got {gru_hidden_dim}, {emb_dim})")
        self.gru_hidden_dim, self.emb_dim = gru_hidden_dim, emb_dim
        self.pure_draft_prefix_len, self.shift_label = int(pure_draft_prefix_len), bool(shift_label)
        self.lambda_base_start, self.lambda_base_decay_ratio = float(lambda_base_start), float(lambda_base_decay_ratio)
        self.total_steps, self.budget_minutes, self.step = total_steps, budget_minutes, 0
        self._started: float | None = None  # time.monotonic() at the first step

    def on_step_start(self, step: int) -> None:
        self.step = step
        if self._started is None:
            self._started = time.monotonic()

    @property
    def mix(self) -> float:
        """lambda, the backbone's share of the loss, at the current step (and minute of a time budget)."""
        used = None
        if self.budget_minutes is not None and self._started is not None:
            used = (time.monotonic() - self._started) / (60.0 * self.budget_minutes)
        return mix_weight(self.step, self.lambda_base_start, self.lambda_base_decay_ratio, self.total_steps, used)

    def build(self, target: Target) -> DominoModel:
        self.bind(target)
        config = DominoConfig.from_target(target, self.num_layers, self.block_size, self.feature_spec.aux_layers,
                                          self.mask_token_id, self.gru_hidden_dim, self.emb_dim,
                                          self.pure_draft_prefix_len, self.shift_label)
        model = DominoModel(config).to(target.device).attach(target)
        if self.init_layer_from_target:
            init_from_target(model, target)
        return model

    def _blocks(self, model: DominoModel, batch: dict, target: Target, n: int, generator=None):
        """One block per anchor; returns (h (B, n, bs, H), labels (B, n, bs), weights (B, n, bs), prefix (B, n, bs):
        the tokens the GRU reads, the anchor then the labels of the slots before)."""
        ids, att, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        B, T = ids.shape
        bs, dev = self.block_size, ids.device
        anchors, valid = self.sample_anchors(batch, n, generator)
        n = anchors.shape[1]
        cache = model.new_cache()
        model.extend_context(cache, model.fuse(batch["hidden_aux"]), torch.arange(T, device=dev).expand(B, -1))
        block_ids = model.block_inputs(ids.gather(1, anchors)).reshape(B, n * bs)
        block_pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).reshape(B, n * bs)
        h = model.decode(block_ids, block_pos, cache, BlockLayout(anchors, bs, att)).view(B, n, bs, -1)
        m = torch.arange(bs, device=dev) + (1 - model.first_slot)  # the offset each slot predicts
        where = anchors[:, :, None] + m  # (B, n, bs)
        at = where.clamp(max=T - 1).view(B, -1)
        if self.labels == "data":
            labels = ids.gather(1, at).view(B, n, bs)
        else:
            argmax = batch.get(ARGMAX_KEY)
            if argmax is None:
                argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
            labels = argmax.gather(1, (at - 1).clamp(min=0)).view(B, n, bs)
        counted = (where < T) & valid[:, :, None] & (m >= 1) & lm.gather(1, at).view(B, n, bs) \
            & att.gather(1, at).view(B, n, bs)
        weights = torch.exp(-(m - 1).clamp(min=0).float() / self.gamma) * counted
        prefix = torch.cat([ids.gather(1, anchors)[:, :, None], labels[:, :, model.first_slot:]], dim=2)[:, :, :bs]
        return h, labels, weights, prefix

    def _logits_ce(self, model: DominoModel, h, prefix, labels):
        """Per-slot (B·n, bs) cross-entropies of the corrected logits and their argmax, ``head_chunk`` rows at a
        time (recomputed in backward past one chunk)."""
        bs = h.shape[-2]
        h, prefix, labels = h.reshape(-1, bs, h.shape[-1]), prefix.reshape(-1, bs), labels.reshape(-1, bs)
        rows = max(1, self.head_chunk // bs)

        def part(hh, pp, ll):
            z = model.block_logits(hh, pp)
            return F.cross_entropy(z.flatten(0, 1), ll.flatten(), reduction="none").view(ll.shape), z.argmax(-1)

        parts = [checkpoint(part, h[s:s + rows], prefix[s:s + rows], labels[s:s + rows], use_reentrant=False)
                 if torch.is_grad_enabled() and h.shape[0] > rows else part(h[s:s + rows], prefix[s:s + rows],
                                                                             labels[s:s + rows])
                 for s in range(0, h.shape[0], rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def loss(self, model: DominoModel, batch: dict, target: Target) -> StepOutput:
        h, labels, weights, prefix = self._blocks(model, batch, target, self.anchors)
        sel = weights > 0
        if not bool(sel.any()):
            return StepOutput(loss=sum(p.sum() for p in model.parameters()) * 0.0, metrics={"blocks": 0.0})
        lam, w = self.mix, weights[sel]
        final_ce, pred = self._logits_ce(model, h, prefix, labels)
        final = (final_ce.view(sel.shape)[sel] * w).sum() / w.sum()
        base_ce, _ = slot_cross_entropy(model, target, h[sel], labels[sel], self.head_chunk)
        base = (base_ce * w).sum() / w.sum()
        loss = (1 - lam) * final + lam * base
        right = pred.view(sel.shape)[sel] == labels[sel]
        slot = torch.arange(self.block_size, device=h.device).expand_as(sel)[sel]
        metrics = {"blocks": float(sel.any(-1).sum()), "lambda": lam, "ce_final": float(final.detach()),
                   "ce_base": float(base.detach())}
        for j in range(self.block_size):
            here = slot == j
            if bool(here.any()):
                metrics[f"step{j - model.first_slot}_acc"] = float(right[here].float().mean())
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: DominoModel, batch: dict, target: Target) -> dict[str, float]:
        """Per drafted token m (1..B-1): top-1 agreement of the corrected drafts (``step{m-1}``) and tokens 1..m all
        right (``joint{m-1}``), as sums over a fixed draw of anchors."""
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
        h, labels, weights, prefix = self._blocks(model, batch, target, self.eval_anchors, gen)
        counted = weights > 0
        right = self._logits_ce(model, h, prefix, labels)[1].view(counted.shape).eq(labels) & counted
        out: dict[str, float] = {}
        f = model.first_slot
        chain, first = torch.ones_like(counted[:, :, 0]), counted[:, :, f]
        for k in range(f, f + self.block_size - 1):  # the B-1 tokens a block drafts (DominoDrafter)
            c, r = counted[:, :, k], right[:, :, k]
            out[f"step{k - f}_correct"], out[f"step{k - f}_total"] = float(r.sum()), float(c.sum())
            chain = chain & c & r
            out[f"joint{k - f}_correct"], out[f"joint{k - f}_total"] = float((chain & first).sum()), float(first.sum())
        return out

    @staticmethod
    def drafter(model, shape):
        """The evaluator's drafter (measured acceptance during training): the block as a chain, corrected left to
        right."""
        return DominoDrafter(model, block_chain(shape, model.block_size))

    def save(self, model: DominoModel, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
