"""DFlash training (model: ``specheads.models.dflash``).

Each step draws ``anchors`` random anchor positions per row among the positions whose next token is an
assistant token (without replacement; fewer when a row has fewer), builds one block per anchor (the anchor's
token, then mask tokens) and runs every block of a row in one forward over the row's context states. Slot
``j >= 1`` of the block anchored at ``a`` predicts the token at ``a+j`` with weight ``exp(-(j-1)/gamma)``
times ``loss_mask[a+j]``; the loss is the weighted mean cross-entropy (SpecForge's and ModelOpt's form).
Labels are the target's greedy tokens (``labels=target``: its argmax at ``a+j-1``, what greedy verification
accepts; speculators' ``ce`` form) or the data's (``labels=data``: ``input_ids[a+j]``). ``lk_weight`` > 0 mixes
in the acceptance objective of the LK losses (arXiv 2602.23881): ``-log sum_x min(p, q)`` against the
target's distribution ``p`` at ``a+j-1`` (``losses.acceptance_nll``), ``(1 - w) * CE + w * that`` per slot.
``loss=dpace`` (D-PACE, arXiv 2605.18810) replaces the fixed decay by weights each block earns from its own
cross-entropies (``losses.dpace_weights``, detached): ``sum_j w_j CE_j`` over the counted slots of every block,
divided by the number of counted slots; ``gamma`` is then unused and ``lk_weight`` must be 0 (D-PACE reads each
slot's acceptance as ``exp(-CE)``, which holds for the plain cross-entropy only).

Held-out metrics, per block slot: ``step{j-1}`` top-1 agreement with the labels and ``joint{j-1}`` (slots
``1..j`` all right), whose sum plus one is the chain acceptance length of one block at T=0 (``tau_joint``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from specheads.decoding.head_drafters import DFlashDrafter
from specheads.methods.base import ARGMAX_KEY, FusedLayers, StepOutput
from specheads.methods.losses import dpace_weights, frozen_linear, hard_cross_entropy, head_cross_entropy
from specheads.methods.ttt import summarize_steps
from specheads.models.dflash import BlockLayout, DFlashConfig, DFlashModel
from specheads.targets import Target, logit_softcap, target_argmax

log = logging.getLogger(__name__)

LOSSES = ("ce", "dpace")
"""``loss=``: ``ce`` weights slot j by exp(-(j-1)/gamma); ``dpace`` by D-PACE's acceptance weights."""


class DFlashMethod(FusedLayers):
    """num_layers: draft layers (z-lab's published drafts 5; 1 keeps a CPU run short); block_size: B (16 as
    z-lab and speculators' CLI; 8 in ModelOpt's recipe); aux_layers: fused target layers, null = (2, N//2, N-3),
    EAGLE-3's, so one feature store serves both; mask_token_id: null = ``models.dflash.default_mask_token``;
    anchors: blocks per row per step (512 in the public recipes on a GPU); gamma: the loss decay over slots (7
    for B=16, 4 for B=8 in ModelOpt's recipe); labels: ``target`` or ``data``; loss: ``ce`` (the decayed
    cross-entropy) or ``dpace``; init_layer_from_target: start as EAGLE-3's option does (``init_from_target``)."""

    name = "dflash"

    def __init__(self, num_layers: int = 1, block_size: int = 16, aux_layers=None, mask_token_id: int | None = None,
                 anchors: int = 64, gamma: float = 7.0, labels: str = "target", eval_anchors: int | None = None,
                 head_chunk: int = 2048, target_chunk: int = 1024, lk_weight: float = 0.0, loss: str = "ce",
                 init_layer_from_target: bool = False):
        if num_layers < 1:
            raise ValueError(f"dflash: num_layers must be at least 1, got {num_layers}")
        if block_size < 2:
            raise ValueError(f"dflash: block_size must be at least 2 (the anchor and one drafted token), got {block_size}")
        if anchors < 1 or (eval_anchors is not None and eval_anchors < 1):
            raise ValueError(f"dflash: anchors must be at least 1, got {anchors} / {eval_anchors}")
        if not gamma > 0:
            raise ValueError(f"dflash: gamma must be positive, got {gamma}")
        if not 0.0 <= lk_weight <= 1.0:
            raise ValueError(f"dflash: lk_weight must lie in [0, 1], got {lk_weight}")
        if labels not in ("target", "data"):
            raise ValueError(f"dflash: labels must be 'target' or 'data', got {labels!r}")
        if loss not in LOSSES:
            raise ValueError(f"dflash: loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        if loss == "dpace" and lk_weight:
            raise ValueError(f"dflash: loss=dpace weights the plain cross-entropy; set lk_weight=0 (got {lk_weight})")
        self.num_layers, self.block_size, self.mask_token_id = num_layers, block_size, mask_token_id
        self.aux_layers = tuple(aux_layers) if aux_layers is not None else None
        self.anchors, self.eval_anchors = anchors, eval_anchors or anchors
        self.gamma, self.labels = float(gamma), labels
        self.head_chunk, self.target_chunk, self.lk_weight = head_chunk, target_chunk, float(lk_weight)
        self.init_layer_from_target, self.loss_name = init_layer_from_target, loss

    def build(self, target: Target) -> DFlashModel:
        self.bind(target)
        config = DFlashConfig.from_target(target, self.num_layers, self.block_size, self.feature_spec.aux_layers,
                                          self.mask_token_id)
        model = DFlashModel(config).to(target.device).attach(target)
        if self.init_layer_from_target:
            init_from_target(model, target)
        return model

    def slot_weights(self, device=None) -> torch.Tensor:
        """(B,) loss weight of each block slot: 0 for the anchor, exp(-(j-1)/gamma) for slot j >= 1 (1 under
        ``loss=dpace``, whose weights each block computes from its cross-entropies)."""
        j = torch.arange(self.block_size, device=device, dtype=torch.float32)
        later = torch.ones_like(j) if self.loss_name == "dpace" else torch.exp(-(j - 1) / self.gamma)
        return torch.where(j > 0, later, torch.zeros_like(j))

    def sample_anchors(self, batch: dict, n: int, generator: torch.Generator | None = None):
        """(anchors (B, n) long, valid (B, n) bool): positions ``a >= 1`` whose next token is an assistant
        token, ``n`` per row drawn without replacement (rows with fewer get invalid extras, masked out)."""
        mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        B, T = mask.shape
        cand = torch.zeros_like(mask)
        cand[:, 1:T - 1] = mask[:, 2:]
        n = max(1, min(n, T))
        score = torch.rand(B, T, generator=generator, device=mask.device if generator is None else generator.device)
        score = score.to(mask.device).masked_fill(~cand, -1.0)
        top = score.topk(n, dim=1)
        anchors, valid = top.indices, top.values >= 0
        order = anchors.masked_fill(~valid, T).argsort(dim=1)  # valid anchors first, by position
        return anchors.gather(1, order), valid.gather(1, order)

    sequence_parallel = None  # a training.sequence_parallel.SequenceShard: this rank trains a slice of each row

    def _blocks(self, model: DFlashModel, batch: dict, target: Target, n: int, generator=None, shard=None):
        """Run one block per anchor; returns (h (B, n, bs, H), labels (B, n, bs), weights (B, n, bs), source
        (B, n, bs): the position whose target state predicts each slot's token, a + j - 1). With a
        sequence-parallel ``shard`` the context is this rank's slice of the row and the blocks its share of the
        row's (``SequenceShard.blocks``: n is then that share, padded blocks invalid)."""
        ids, att, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        B, T = ids.shape
        bs = self.block_size
        anchors, valid = self.sample_anchors(batch, n, generator)
        cache = model.new_cache()
        if shard is None:
            positions = torch.arange(T, device=ids.device).expand(B, -1)
            model.extend_context(cache, model.fuse(batch["hidden_aux"]), positions)
            mask = BlockLayout(anchors, bs, att)  # the dense mask off the CPU only (models.dflash)
        else:  # this rank's C context positions, its share of the blocks; attention over the group's (all-to-all)
            anchors, valid, group_anchors = shard.blocks(anchors, valid)
            local, own = shard.local_batch({"input_ids": ids, "hidden_aux": batch["hidden_aux"],
                                            "attention_mask": att}, 0)
            model.extend_context(cache, model.fuse(local["hidden_aux"]), shard.positions(B, own, ids.device))
            whole = BlockLayout(group_anchors, bs, F.pad(att, (0, shard.size * own - T)))
            mask = shard.block_layout(anchors, bs, local["attention_mask"], whole)
        n = anchors.shape[1]
        block_ids = model.block_inputs(ids.gather(1, anchors)).reshape(B, n * bs)
        block_pos = (anchors[:, :, None] + torch.arange(bs, device=ids.device)).reshape(B, n * bs)
        h = model.decode(block_ids, block_pos, cache, mask).view(B, n, bs, -1)
        where = block_pos.view(B, n, bs)  # the position slot j predicts: a + j
        inside = (where < T) & valid[:, :, None]
        at = where.clamp(max=T - 1)
        if self.labels == "data":
            labels = ids.gather(1, at.view(B, -1)).view(B, n, bs)
        else:
            argmax = batch.get(ARGMAX_KEY)
            if argmax is None:
                argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
            labels = argmax.gather(1, (at - 1).clamp(min=0).view(B, -1)).view(B, n, bs)
        counted = inside & lm.gather(1, at.view(B, -1)).view(B, n, bs) & att.gather(1, at.view(B, -1)).view(B, n, bs)
        weights = self.slot_weights(ids.device)[None, None, :] * counted
        return h, labels, weights, (at - 1).clamp(min=0)

    def loss(self, model: DFlashModel, batch: dict, target: Target) -> StepOutput:
        shard = self.sequence_parallel
        h, labels, weights, source = self._blocks(model, batch, target, self.anchors, shard=shard)
        sel = weights > 0
        # The loss's denominator (the weights' sum, or the counted slots' under dpace), over the group's blocks with
        # sequence parallel: each rank's share of the one-process mean, summed by shard.combine.
        counts = torch.stack([sel.sum(dtype=torch.float64), weights.sum(dtype=torch.float64)])
        if shard is not None:
            counts = shard.total(counts)
        if not bool(counts[0] > 0):
            return StepOutput(loss=h.sum() * 0.0, metrics={"blocks": 0.0})
        if not bool(sel.any()):  # this rank's blocks count nothing, the group's do
            # every parameter in the graph (DDP's reduction), every rank's share in float32 (one all-reduce)
            loss = shard.combine((model.norm(h).sum() * 0.0).float())
            nothing = sel.new_zeros(0)
            return StepOutput(loss=loss, metrics=self._group_metrics(shard, sel, nothing, nothing.long()))
        if self.lk_weight:
            B = h.shape[0]
            rows = torch.arange(B, device=h.device)[:, None, None].expand_as(source)
            target_h = batch["hidden_last"][rows[sel], source[sel]]
            ce, pred = hard_cross_entropy(model.logits, h[sel], labels[sel], self.head_chunk, target_hidden=target_h,
                                          target_head=target.logits, lk_weight=self.lk_weight)
        else:
            ce, pred = slot_cross_entropy(model, target, h[sel], labels[sel], self.head_chunk)
        if self.loss_name == "dpace":
            per_slot = ce.new_zeros(sel.shape)
            per_slot[sel] = ce.detach()
            loss = (dpace_weights(per_slot, sel)[sel] * ce).sum() / counts[0].to(ce.dtype)
        else:
            w = weights[sel]
            loss = (ce * w).sum() / counts[1].to(ce.dtype)
        right = pred == labels[sel]
        slot = torch.arange(self.block_size, device=h.device).expand_as(sel)[sel]
        if shard is not None:
            return StepOutput(loss=shard.combine(loss.float()), metrics=self._group_metrics(shard, sel, right, slot))
        metrics = {"blocks": float(sel.any(-1).sum())}
        for j in range(1, self.block_size):
            here = slot == j
            if bool(here.any()):
                metrics[f"step{j - 1}_acc"] = float(right[here].float().mean())
        return StepOutput(loss=loss, metrics=metrics)

    def _group_metrics(self, shard, sel: torch.Tensor, right: torch.Tensor, slot: torch.Tensor) -> dict[str, float]:
        """``loss``'s metrics over a sequence-parallel group's blocks: counted blocks, and per slot the right
        labels over the counted ones, each summed over the group."""
        here = slot[None, :] == torch.arange(1, self.block_size, device=slot.device)[:, None]  # (bs - 1, N)
        sums = torch.cat([sel.any(-1).sum(dtype=torch.float64)[None], here.sum(1, dtype=torch.float64),
                          (here & right[None, :]).sum(1, dtype=torch.float64)])
        sums = shard.total(sums).tolist()
        k = self.block_size - 1
        metrics = {"blocks": sums[0]}
        for j in range(1, self.block_size):
            if sums[j] > 0:
                metrics[f"step{j - 1}_acc"] = sums[k + j] / sums[j]
        return metrics

    @torch.no_grad()
    def evaluate(self, model: DFlashModel, batch: dict, target: Target) -> dict[str, float]:
        """Per-slot top-1 agreement with the labels (``step{j-1}``) and slots 1..j all right (``joint{j-1}``),
        as sums over a fixed draw of anchors."""
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
        h, labels, weights, _ = self._blocks(model, batch, target, self.eval_anchors, gen)
        counted = weights > 0
        right = torch.zeros_like(counted)
        if bool(counted.any()):
            _, pred = slot_cross_entropy(model, target, h[counted], labels[counted], self.head_chunk)  # as training's
            right[counted] = pred == labels[counted]
        out: dict[str, float] = {}
        chain = torch.ones_like(counted[:, :, 0])  # slots 1..j-1 counted and right
        for j in range(1, self.block_size):
            c, r = counted[:, :, j], right[:, :, j]
            out[f"step{j - 1}_correct"], out[f"step{j - 1}_total"] = float(r.sum()), float(c.sum())
            first = counted[:, :, 1]  # the blocks whose first drafted slot is counted
            chain = chain & c & r
            out[f"joint{j - 1}_correct"], out[f"joint{j - 1}_total"] = float((chain & first).sum()), float(first.sum())
        return out

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_joint`` (one block's chain acceptance length at T=0) and ``tau_estimate``."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training): a chain is cut to the B-1
        tokens one block drafts."""
        return DFlashDrafter(model, block_chain(shape, model.block_size))

    def save(self, model: DFlashModel, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)


def slot_cross_entropy(model: DFlashModel, target: Target, h: torch.Tensor, labels: torch.Tensor, chunk: int):
    """Each row's cross-entropy (N,) of ``model.logits(h)`` against ``labels``, and the argmax (N,).

    Through the target's frozen LM head, ``losses.head_cross_entropy`` makes each chunk's logits and their
    gradient in the forward pass and keeps only the (N, H) gradient of the normed states, where autograd would keep
    several (N, V) tensors. A head that is not a frozen linear layer goes through ``hard_cross_entropy``."""
    head = frozen_linear(target.lm_head)
    if head is None:
        return hard_cross_entropy(model.logits, h, labels, chunk)
    return head_cross_entropy(head, model.norm(h), labels, chunk, logit_softcap(target.config))


def block_chain(shape, block_size: int):
    """``shape`` with a chain cut to the ``block_size - 1`` tokens one block drafts (DFlash, DSpark)."""
    from dataclasses import replace

    if shape.kind == "chain" and shape.k > block_size - 1:
        return replace(shape, k=block_size - 1)
    return shape


def init_from_target(model: DFlashModel, target: Target) -> None:
    """Start each draft layer as the target's decoder layer whose input is the highest fused layer (then the
    ones after it): its projections, MLP and norms; ``hidden_norm`` as that layer's input norm and ``fc`` passing
    the highest fused state through, so the context's keys and values start as that layer's own; ``norm`` as
    the target's final norm. ``q_norm``/``k_norm`` are copied where the target has them."""
    aux = list(model.config.aux_layers)
    H = target.hidden_size
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            src = target.layers[min(aux[-1] + i, target.num_layers - 1)]
            pairs = [(layer.input_layernorm, src.input_layernorm), (layer.post_attention_layernorm,
                                                                    src.post_attention_layernorm), (layer.mlp, src.mlp)]
            pairs += [(getattr(layer.self_attn, n), getattr(src.self_attn, n)) for n in
                      ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") if hasattr(src.self_attn, n)]
            for dst, w in pairs:
                for name, param in dst.named_parameters():
                    value = w.get_parameter(name)
                    if param.shape != value.shape:
                        raise ValueError(f"init_layer_from_target: {name} of the target's layer is "
                                         f"{tuple(value.shape)}, the drafter's {tuple(param.shape)}")
                    param.copy_(value)
        model.hidden_norm.weight.copy_(target.layers[aux[-1]].input_layernorm.weight)
        model.norm.weight.copy_(target.decoder.norm.weight)
        width = model.fc.weight.shape[1] // len(aux)
        model.fc.weight.zero_()
        model.fc.weight[:, (len(aux) - 1) * width:].copy_(torch.eye(H, width))
