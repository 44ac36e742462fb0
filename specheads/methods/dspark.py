"""DSpark training (model: ``specheads.models.dspark``; the blocks are DFlash's, ``specheads.methods.dflash``).

Blocks, anchors and labels are drawn exactly as for DFlash. Slot ``j >= 1`` of the block anchored at ``a``
reads the token before it teacher-forced (the anchor ``x_a`` for slot 1, then slot ``j-1``'s label: the target's
greedy token with ``labels=target``, the data's with ``labels=data``), so its logits are the backbone's plus the
Markov bias of that token, ``q_j = softmax(lm_head(norm(h_j)) + W2 W1[x_{j-1}])``. With ``p_j`` the target's
distribution at ``a+j-1`` (the one that verifies slot ``j``) and ``k = j - 1``:

    L = sum_j w_j (ce_weight * CE(q_j, label_j) + l1_weight * ||p_j - q_j||_1) / sum_j w_j
        + confidence_weight * mean_j BCE(c_j, 1 - TV(p_j, q_j))          w_j = exp(-k / gamma)

over the counted slots (their label an assistant token), ``TV = ||p - q||_1 / 2`` and the BCE target detached: the
confidence head learns each slot's acceptance probability without pulling the draft towards easy targets. The
paper's defaults (DeepSpec's ``loss.py``): ce_weight 0.1, l1_weight 0.9, gamma 4, confidence_weight 1.
``loss=dpace`` replaces the fixed decay by D-PACE's weights (``losses.dpace_weights``, detached), computed per
block from the draft's own cross-entropies (with the Markov bias), and divides by the counted slots as DFlash's
``loss=dpace`` does: ``sum_j w_j (ce_weight * CE_j + l1_weight * L1_j) / (counted slots)``; the confidence term is
unchanged.

``init_from`` warm-starts the backbone from a trained DFlash head folder (same target, sizes and fused layers);
the Markov head's ``markov_w2`` starts at zero, so training begins from that head's own drafts.

Held-out metrics: DFlash's ``step{j-1}``/``joint{j-1}`` sums with the Markov bias applied, the mean total
variation ``tv`` and the confidence head's mean absolute error against ``1 - TV`` (``conf_err``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specheads.errors import UserError
from specheads.methods.base import StepOutput
from specheads.methods.dflash import DFlashMethod, block_chain, init_from_target
from specheads.methods.losses import dpace_weights, logit_chunk_rows, pad_rows
from specheads.models.dspark import DSparkConfig, DSparkModel
from specheads.targets import Target

log = logging.getLogger(__name__)


SLOT_CHUNK_BYTES = 1 << 26
"""Float32 (rows, V) scratch one chunk of ``ce_and_l1`` makes at a time: 64 MiB (320 rows at a 49152 vocabulary)."""


def _pair_chunks(a, b, labels, probs, chunk: int, keep: bool, l1_grad: bool):
    """(CE (n,), L1 (n,), argmax (n,), q (n, V) float32 or None, sign(q - p) (n, V) int8 or None), ``chunk`` rows
    at a time; q and the sign are kept (``keep``; the sign only with ``l1_grad``) for ``_SlotPair.backward``."""
    n, V = labels.shape[0], a.shape[-1]
    ce = torch.empty(n, dtype=torch.float32, device=a.device)
    l1, pred = torch.empty_like(ce), torch.empty(n, dtype=torch.long, device=a.device)
    q_all = torch.empty((n, V), dtype=torch.float32, device=a.device) if keep else None
    sign_all = torch.empty((n, V), dtype=torch.int8, device=a.device) if keep and l1_grad else None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        z = a[s:e].to(torch.float32, copy=True).add_(b[s:e])  # float(a) + float(b), a left as it is
        logq = torch.log_softmax(z, dim=-1)
        del z
        ce[s:e] = -logq.gather(1, labels[s:e, None]).squeeze(1)
        pred[s:e] = logq.argmax(-1)
        q = logq.exp_() if q_all is None else torch.exp(logq, out=q_all[s:e])
        d = probs(s, e).neg_().add_(q)  # q - p, exactly -(p - q)
        del logq, q
        if sign_all is not None:
            sign_all[s:e] = d.sign()
        l1[s:e] = d.abs_().sum(-1)
    return ce, l1, pred, q_all, sign_all


class _SlotPair(torch.autograd.Function):
    """CE and L1 of ``softmax(a + b)``; saves q (float32) and sign(q - p) (int8), not the chain of (n, V)
    intermediates autograd keeps for the plain formula (log q, q, p - q and abs's input)."""

    @staticmethod
    def forward(ctx, a, b, labels, probs, l1_grad, chunk):
        ce, l1, pred, q, sign = _pair_chunks(a, b, labels, probs, chunk, True, l1_grad)
        ctx.save_for_backward(q, sign, labels)
        ctx.rows, ctx.dtypes, ctx.chunk = a.shape[0], (a.dtype, b.dtype), chunk
        ctx.mark_non_differentiable(pred, *(() if l1_grad else (l1,)))
        return ce, l1, pred

    @staticmethod
    def backward(ctx, g_ce, g_l1, g_pred):
        # with q = softmax(z) and s = sign(q - p): dCE/dz = q - onehot(label), dL1/dz_j = q_j (s_j - sum_i q_i s_i)
        q, sign, labels = ctx.saved_tensors
        n, V = q.shape
        out = {dt: q.new_empty((ctx.rows, V), dtype=dt)
               for dt, need in zip(ctx.dtypes, ctx.needs_input_grad[:2]) if need}
        for g in out.values():
            g[n:] = 0  # the padding rows
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            qc, gc = q[s:e], g_ce[s:e, None]
            if sign is not None:
                t = sign[s:e].float()
                t.sub_((qc * t).sum(-1, keepdim=True)).mul_(g_l1[s:e, None]).add_(gc).mul_(qc)
            else:
                t = qc * gc
            t.scatter_add_(1, labels[s:e, None], -gc)
            for g in out.values():
                g[s:e] = t
        grads = [out[dt] if need else None for dt, need in zip(ctx.dtypes, ctx.needs_input_grad[:2])]
        return (*grads, None, None, None, None)


def ce_and_l1(a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor, probs, l1_grad: bool = True,
              chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE and ||p - q||_1 of the draft ``q = softmax(float(a) + float(b))`` for the first n rows.

    a, b: (n', V) with n' >= n rows (the rest padding, their gradient zero), the backbone's logits and the Markov
    bias in their own dtypes; labels: (n,) long; probs(s, e): a new (e - s, V) float32 tensor (overwritten here),
    the target distribution of rows s:e. Returns (CE (n,), L1 (n,), argmax (n,)): as ``log_softmax`` then
    ``nll_loss`` and ``(p - q).abs().sum(-1)``, ``chunk`` rows at a time (default ``SLOT_CHUNK_BYTES`` of float32).
    For the backward pass only q (n, V) float32 and, with ``l1_grad``, sign(q - p) (n, V) int8 are kept; without
    ``l1_grad`` the L1 carries no gradient.
    """
    chunk = chunk or logit_chunk_rows(a.shape[-1], SLOT_CHUNK_BYTES)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _SlotPair.apply(a, b, labels, probs, l1_grad, chunk)
    return _pair_chunks(a, b, labels, probs, chunk, False, False)[:3]


def slot_terms(model: DSparkModel, target_logits, h: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
               target_h: torch.Tensor, l1_grad: bool = True,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-slot pieces of the DSpark loss for N counted slots.

    h: (N, H) pre-norm slot states; prev: (N,) the token before each slot; labels: (N,); target_h: (N, H_t)
    post-norm target states whose logits (``target_logits``) give p. Returns (CE (N,), ||p - q||_1 (N,),
    confidence logits (N,) or None, draft argmax (N,)), float32; the L1 without gradient unless ``l1_grad``.
    The draft logits are ``model.draft_logits``'s, made on rows padded to ``ROW_MULTIPLE`` (recurring matmul
    shapes: ``losses``' module docstring) and scored by ``ce_and_l1``.
    """
    a = model.logits(pad_rows(h))
    b = model.markov_bias(pad_rows(prev))

    def probs(s: int, e: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(target_logits(pad_rows(target_h[s:e]))[: e - s].float(), dim=-1)

    ce, l1, pred = ce_and_l1(a, b, labels, probs, l1_grad)
    conf = model.confidence(h, prev, logit=True) if model.confidence_head is not None else None
    return ce, l1, conf, pred


def chunked_slot_terms(model, target_logits, h, prev, labels, target_h, chunk: int, l1_grad: bool = True):
    """``slot_terms`` ``chunk`` rows at a time; past one chunk the draft logits are recomputed in backward."""
    if h.shape[0] <= chunk:
        return slot_terms(model, target_logits, h, prev, labels, target_h, l1_grad)
    parts = []
    for s in range(0, h.shape[0], chunk):
        args = (model, target_logits, h[s:s + chunk], prev[s:s + chunk], labels[s:s + chunk], target_h[s:s + chunk],
                l1_grad)
        parts.append(checkpoint(slot_terms, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else slot_terms(*args))
    ce, l1, conf, pred = zip(*parts)
    return torch.cat(ce), torch.cat(l1), None if conf[0] is None else torch.cat(conf), torch.cat(pred)


def combine(ce: torch.Tensor, l1: torch.Tensor, conf_logit: torch.Tensor | None, w: torch.Tensor,
            ce_weight: float, l1_weight: float, confidence_weight: float,
            denominator: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict]:
    """The loss from per-slot pieces (N,) and slot weights w (N,): ``sum w * (ce_weight * CE + l1_weight * L1)``
    over ``denominator`` (default ``w.sum()``: the weighted mean) plus ``confidence_weight`` times the mean BCE of
    the confidence against ``1 - L1/2`` (detached). Returns (loss, its parts as floats)."""
    draft = (w * (ce_weight * ce + l1_weight * l1)).sum() / (w.sum() if denominator is None else denominator)
    parts = {"ce": float(ce.detach().mean()), "l1": float(l1.detach().mean())}
    if conf_logit is None or not confidence_weight:
        return draft, parts
    accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(conf_logit.float(), accept)
    parts.update(bce=float(bce.detach()), confidence=float(torch.sigmoid(conf_logit.detach()).mean()))
    return draft + confidence_weight * bce, parts


class DSparkMethod(DFlashMethod):
    """DFlash's settings (block_size 8: the anchor and DeepSpec's 7 drafted tokens; gamma 4: weights exp(-k/4))
    plus markov_rank (null = 256, capped at the target's hidden size), enable_confidence_head, ce_weight,
    l1_weight, confidence_weight, init_from (a trained DFlash head folder whose weights start the backbone) and
    loss (``ce``: the decayed weights; ``dpace``: D-PACE's)."""

    name = "dspark"

    def __init__(self, num_layers: int = 1, block_size: int = 8, aux_layers=None, mask_token_id: int | None = None,
                 anchors: int = 64, gamma: float = 4.0, labels: str = "target", eval_anchors: int | None = None,
                 head_chunk: int = 2048, target_chunk: int = 1024, markov_rank: int | None = None,
                 enable_confidence_head: bool = True, ce_weight: float = 0.1, l1_weight: float = 0.9,
                 confidence_weight: float = 1.0, init_from: str | None = None, init_layer_from_target: bool = False,
                 loss: str = "ce"):
        super().__init__(num_layers=num_layers, block_size=block_size, aux_layers=aux_layers,
                         mask_token_id=mask_token_id, anchors=anchors, gamma=gamma, labels=labels,
                         eval_anchors=eval_anchors, head_chunk=head_chunk, target_chunk=target_chunk,
                         init_layer_from_target=init_layer_from_target, loss=loss)
        if markov_rank is not None and markov_rank < 1:
            raise ValueError(f"dspark: markov_rank must be at least 1, got {markov_rank}")
        if min(ce_weight, l1_weight, confidence_weight) < 0 or not ce_weight + l1_weight > 0:
            raise ValueError(f"dspark: the loss weights must be non-negative and ce_weight + l1_weight positive "
                             f"(got {ce_weight}, {l1_weight}, {confidence_weight})")
        if init_from and init_layer_from_target:
            raise ValueError("dspark: init_from and init_layer_from_target both set the backbone; choose one")
        self.markov_rank, self.enable_confidence_head = markov_rank, bool(enable_confidence_head)
        self.ce_weight, self.l1_weight = float(ce_weight), float(l1_weight)
        self.confidence_weight = float(confidence_weight)
        self.init_from = init_from

    def build(self, target: Target) -> DSparkModel:
        self.bind(target)
        config = DSparkConfig.from_target(target, self.num_layers, self.block_size, self.feature_spec.aux_layers,
                                          self.mask_token_id, self.markov_rank)
        config.enable_confidence_head = self.enable_confidence_head
        model = DSparkModel(config).to(target.device).attach(target)
        if self.init_layer_from_target:
            init_from_target(model, target)
        if self.init_from:
            warm_start(model, self.init_from)
        return model

    def previous_tokens(self, batch: dict, labels: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """(B, n, bs) the token before each slot, teacher-forced: the data's token at ``a+j-1`` (the anchor's at
        slot 1), or with ``labels=target`` slot j-1's label from slot 2 on (what greedy drafting feeds)."""
        ids = batch["input_ids"]
        B, n, bs = source.shape
        prev = ids.gather(1, source.reshape(B, -1)).view(B, n, bs)
        if self.labels == "target":
            prev = torch.cat([prev[:, :, :2], labels[:, :, 1:-1]], dim=2)
        return prev

    def _terms(self, model, batch, target, n, generator=None):
        h, labels, weights, source = self._blocks(model, batch, target, n, generator)
        sel = weights > 0
        prev = self.previous_tokens(batch, labels, source)
        rows = torch.arange(h.shape[0], device=h.device)[:, None, None].expand_as(source)
        target_h = batch["hidden_last"][rows[sel], source[sel]]
        terms = chunked_slot_terms(model, target.logits, h[sel], prev[sel], labels[sel], target_h, self.head_chunk,
                                   l1_grad=self.l1_weight > 0)  # else L1 is only the confidence's detached target
        return terms, labels, weights, sel

    def loss(self, model: DSparkModel, batch: dict, target: Target) -> StepOutput:
        (ce, l1, conf, pred), labels, weights, sel = self._terms(model, batch, target, self.anchors)
        if not bool(sel.any()):
            return StepOutput(loss=sum(p.sum() for p in model.parameters()) * 0.0, metrics={"blocks": 0.0})
        w, denominator = weights[sel], None
        if self.loss_name == "dpace":
            per_slot = ce.new_zeros(sel.shape)
            per_slot[sel] = ce.detach()
            w, denominator = dpace_weights(per_slot, sel)[sel], sel.sum()
        loss, parts = combine(ce, l1, conf, w, self.ce_weight, self.l1_weight, self.confidence_weight, denominator)
        right = pred == labels[sel]
        slot = torch.arange(self.block_size, device=ce.device).expand_as(sel)[sel]
        metrics = {"blocks": float(sel.any(-1).sum()), **parts}
        for j in range(1, self.block_size):
            here = slot == j
            if bool(here.any()):
                metrics[f"step{j - 1}_acc"] = float(right[here].float().mean())
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: DSparkModel, batch: dict, target: Target) -> dict[str, float]:
        """DFlash's ``step``/``joint`` sums with the Markov bias applied (teacher-forced), plus ``tv`` and
        ``conf_err`` (|confidence - (1 - TV)|) sums, over a fixed draw of anchors."""
        gen = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
        (ce, l1, conf, pred), labels, weights, counted = self._terms(model, batch, target, self.eval_anchors, gen)
        right = torch.zeros_like(counted)
        right[counted] = pred == labels[counted]
        out: dict[str, float] = {"tv_sum": float((0.5 * l1).sum()), "tv_count": float(l1.numel())}
        if conf is not None:
            out["conf_err_sum"] = float((torch.sigmoid(conf) - (1 - 0.5 * l1).clamp(0, 1)).abs().sum())
            out["conf_err_count"] = float(conf.numel())
        chain = torch.ones_like(counted[:, :, 0])
        first = counted[:, :, 1]  # the blocks whose first drafted slot is counted
        for j in range(1, self.block_size):
            c, r = counted[:, :, j], right[:, :, j]
            out[f"step{j - 1}_correct"], out[f"step{j - 1}_total"] = float(r.sum()), float(c.sum())
            chain = chain & c & r
            out[f"joint{j - 1}_correct"], out[f"joint{j - 1}_total"] = float((chain & first).sum()), float(first.sum())
        return out

    @staticmethod
    def drafter(model, shape):
        """The evaluator's drafter (measured acceptance during training): the block as a chain, Markov bias
        applied left to right, every drafted token verified (no confidence schedule)."""
        from specheads.decoding.dspark_drafter import DSparkDrafter

        return DSparkDrafter(model, block_chain(shape, model.block_size))


def warm_start(model: DSparkModel, head_dir: str) -> None:
    """Copy a trained DFlash head's weights (``fc``, ``hidden_norm``, ``layers.*``, ``norm``) into ``model``'s
    backbone. The head must have been trained for the same target with the same sizes, block and fused layers;
    anything else is refused (a ``UserError``), as is a tensor the DSpark backbone does not have."""
    from specheads.models.dflash import DFlashModel

    path = Path(head_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"dspark init_from={head_dir}: no config.json there (a trained DFlash head folder)")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") != "specheads_dflash":
        raise UserError(f"dspark init_from={head_dir}: model_type {cfg.get('model_type')!r}, not a DFlash head "
                        f"(specheads_dflash)")
    mine = model.config
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "block_size", "aux_layers", "mask_token_id",
                "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if cfg.get(key) != getattr(mine, key):
            raise UserError(f"dspark init_from={head_dir}: its {key} is {cfg.get(key)!r}, this head's "
                            f"{getattr(mine, key)!r} (the method's settings must match the DFlash head's)")
    state = DFlashModel.from_pretrained(str(path)).state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    extra = [k for k in missing if not k.startswith(("markov_head.", "confidence_head."))]
    if unexpected or extra:
        raise UserError(f"dspark init_from={head_dir}: tensors that do not match the DSpark backbone "
                        f"(unexpected {unexpected}, missing {extra})")
    log.info("dspark: backbone warm-started from the DFlash head at %s", head_dir)
