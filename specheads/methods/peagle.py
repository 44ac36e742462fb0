"""P-EAGLE training (model: ``specheads.models.peagle``): every depth of a K-token parallel draft in one forward.

Per row of ``n`` real tokens (the recipe of the paper and of speculators' ``peagle``):

* **Depth 0** keeps every position ``a``: (fused target state at ``a``, token ``ids[a+1]``) at position ``a``, as
  EAGLE-3's first step.
* **Depth d >= 1** keeps ``floor((n - d) * max(ratio**d, ratio_min))`` anchors (at most ``max_anchors``), drawn
  without replacement from depth ``d-1``'s anchors that still have a position ``a + d < n`` (the shifted pool):
  every kept chain is whole, depths ``0..d`` of the same anchor are all present. Its input is
  (``fuse(mask_hidden)``, ``mask_token_id``) at position ``a + d``.
* All depths are packed into one sequence per row and run in one forward under ``parallel_attention_mask``'s rule
  (a ``models.peagle.ParallelLayout``: no (Q, Q) mask on the CPU): a query sees depth-0 keys at or before its anchor
  and its own anchor's slots of depth ``<=`` its own, the pattern a single parallel draft rooted at ``a`` sees at
  inference.
* Depth ``d`` at anchor ``a`` predicts ``ids[a+2+d]``; its loss is the soft cross-entropy against the target's
  distribution at ``a+1+d`` on the draft vocabulary (EAGLE-3's ``target_rows``: assistant tokens whose target
  argmax lies in the draft vocabulary), one mean per depth, the depths summed with equal weights.

Metrics: ``step{d}_acc`` per depth in the training log; held out (anchors drawn with a fixed seed), ``step{d}``
(depth d right) and ``joint{d}`` (depths 0..d of the same anchor all right) against the target's argmax, whose
chain estimate (``summarize``) is the training-time acceptance length of one K-token draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specheads.decoding.peagle_drafter import PEagleDrafter
from specheads.methods.base import ARGMAX_KEY, StepOutput
from specheads.methods.eagle3 import Eagle3Method
from specheads.methods.ttt import draft_soft_loss, shift_tokens, summarize_steps
from specheads.models.peagle import ParallelLayout, PEagleConfig, PEagleModel
from specheads.targets import Target, target_argmax


def depth_count(n: int, d: int, ratio: float, ratio_min: float) -> int:
    """Anchors kept at depth ``d`` of a row of ``n`` tokens: ``floor((n - d) * max(ratio**d, ratio_min))``
    (depth 0: all ``n``)."""
    if d == 0:
        return n
    return max(0, math.floor((n - d) * max(ratio ** d, ratio_min) + 1e-9))


def depth_anchors(n: int, num_depths: int, ratio: float, ratio_min: float, max_anchors: int | None = None,
                  generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Sorted anchors (long, on the CPU) of depths ``0..num_depths-1`` for a row of ``n`` tokens: depth ``d``
    draws ``depth_count`` of them (capped by ``max_anchors`` and by the pool) from depth ``d-1``'s anchors ``a``
    with ``a + d < n``."""
    out = [torch.arange(n)]
    for d in range(1, num_depths):
        pool = out[-1][out[-1] + d < n]
        k = min(depth_count(n, d, ratio, ratio_min), pool.numel())
        if max_anchors is not None:
            k = min(k, max_anchors)
        pick = torch.randperm(pool.numel(), generator=generator)[:k]
        out.append(pool[pick].sort().values)
    return out


@dataclass
class Packed:
    """One packed sequence per row: ``T`` depth-0 entries (positions 0..T-1) then the parallel slots.

    anchor, depth (B, Q) long; valid (B, Q) bool (padding False)."""

    anchor: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.anchor + self.depth


def pack(attention_mask: torch.Tensor, num_depths: int, ratio: float, ratio_min: float,
         max_anchors: int | None = None, generator: torch.Generator | None = None) -> Packed:
    """The packed layout of a right-padded batch (``attention_mask`` (B, T)): depth 0 at every position, each
    deeper depth as a block of ``max over rows`` slots (rows with fewer padded)."""
    B, T = attention_mask.shape
    dev = attention_mask.device
    lengths = attention_mask.bool().sum(1).tolist()
    rows = [depth_anchors(int(n), num_depths, ratio, ratio_min, max_anchors, generator) for n in lengths]
    anchors = [torch.arange(T, device=dev).expand(B, T)]
    depths = [torch.zeros(B, T, dtype=torch.long, device=dev)]
    valid = [attention_mask.bool()]
    for d in range(1, num_depths):
        m = max(r[d].numel() for r in rows)
        a = torch.zeros(B, m, dtype=torch.long)
        v = torch.zeros(B, m, dtype=torch.bool)
        for b, r in enumerate(rows):
            a[b, : r[d].numel()], v[b, : r[d].numel()] = r[d], True
        anchors.append(a.to(dev))
        depths.append(torch.full((B, m), d, dtype=torch.long, device=dev))
        valid.append(v.to(dev))
    return Packed(torch.cat(anchors, 1), torch.cat(depths, 1), torch.cat(valid, 1))


@dataclass
class Dealt:
    """A packed row split across the ``size`` ranks of a sequence-parallel group (``deal``).

    local: per rank, the entries it runs, (B, L) each: its ``own = ceil(T / size)`` depth-0 positions, then for each
    depth its slots whose anchor lies among those positions, padded to the group's largest share (padding invalid,
    anchored at 0). whole: the group's entries, (B, size L), in ``pack``'s order (what ``ParallelLayout`` plans);
    order (B, size L): ``whole[:, j]`` is entry ``order[:, j]`` of the ranks' local entries laid end to end."""

    local: list[Packed]
    whole: Packed
    order: torch.Tensor
    own: int


def deal(packed: Packed, T: int, size: int) -> Dealt:
    """Split ``pack``'s layout of rows of ``T`` positions across ``size`` ranks: rank ``r`` runs the depth-0 entries of
    positions ``[r C, (r + 1) C)`` and every slot anchored there (its chain's labels and keys stay with it)."""
    B, dev = packed.anchor.shape[0], packed.anchor.device
    own = math.ceil(T / size)
    pos = torch.arange(size * own, device=dev)
    valid0 = torch.nn.functional.pad(packed.valid[:, :T], (0, size * own - T))
    local = [[(pos[r * own:(r + 1) * own].expand(B, own), torch.zeros(B, own, dtype=torch.long, device=dev),
               valid0[:, r * own:(r + 1) * own])] for r in range(size)]
    whole = [(pos.expand(B, -1), torch.zeros(B, size * own, dtype=torch.long, device=dev), valid0)]
    r_idx = torch.arange(size, device=dev)
    blocks = []
    for d in range(1, int(packed.depth.max()) + 1 if packed.depth.numel() else 1):
        cols = (packed.depth[0] == d).nonzero().flatten()
        if not cols.numel():
            continue
        a, v = packed.anchor[:, cols], packed.valid[:, cols]
        rank = torch.where(v, a // own, size)  # valid slots first, ascending: each rank's a contiguous run
        counts = (rank[:, :, None] == r_idx).sum(1)  # (B, size)
        blocks.append((d, a, counts, max(int(counts.max()), 1)))
    L = own + sum(m for *_, m in blocks)
    orders = [(pos // own) * L + pos % own]  # depth 0 of whole, position p: rank p // own's entry p % own
    offset = own
    for d, a, counts, m in blocks:
        starts = torch.cumsum(counts, 1) - counts  # (B, size): where rank r's run starts in the block
        i = torch.arange(m, device=dev)
        take = starts[:, :, None] + i  # (B, size, m): the block column of rank r's i-th slot
        real = i < counts[:, :, None]
        la = torch.where(real, a.gather(1, take.clamp(max=a.shape[1] - 1).flatten(1)).view(B, size, m), 0)
        for r in range(size):
            local[r].append((la[:, r], torch.full((B, m), d, dtype=torch.long, device=dev), real[:, r]))
        # whole: the block's valid slots in anchor order (rank by rank), then every rank's padding
        sort = ((~real).long() * (size * m) + r_idx[:, None] * m + i).flatten(1).argsort(1)
        orders.append((r_idx[:, None] * L + offset + i).expand(B, size, m).flatten(1).gather(1, sort))
        whole.append((la.flatten(1).gather(1, sort), torch.full((B, size * m), d, dtype=torch.long, device=dev),
                      real.flatten(1).gather(1, sort)))
        offset += m
    order = torch.cat([o.expand(B, -1) for o in orders], 1)
    mine = [Packed(*(torch.cat([part[k] for part in parts], 1) for k in range(3))) for parts in local]
    return Dealt(mine, Packed(*(torch.cat([part[k] for part in whole], 1) for k in range(3))), order, own)


class PEagleMethod(Eagle3Method):
    """P-EAGLE: EAGLE-3's head, draft vocabulary and target distribution, trained to draft ``num_depths`` tokens
    in one forward.

    num_depths: K, the tokens one forward drafts (depth 0 included; the paper's drafts: 8-10 trained, served at
    K=5-7); num_layers: decoder layers (the paper's: 4; 1 keeps a CPU run short); ratio / ratio_min: depth ``d``
    keeps ``(n - d) * max(ratio**d, ratio_min)`` anchors (0.7 / 0.2, the paper's and speculators' defaults);
    max_anchors: cap per depth (None = no cap); mask_token_id: null = ``models.dflash.default_mask_token``;
    the other settings are EAGLE-3's (``Eagle3Method``).
    """

    name = "peagle"
    trains_image_rows = False  # its parallel depths have no M-RoPE positions yet: image rows are refused

    def __init__(self, num_depths: int = 4, num_layers: int = 1, ratio: float = 0.7, ratio_min: float = 0.2,
                 max_anchors: int | None = None, mask_token_id: int | None = None, draft_vocab_size: int = 32000,
                 vocab_data: str | None = None, vocab_max_samples: int | None = None, aux_layers=None,
                 target_chunk: int = 1024, head_chunk: int = 2048, init_lm_head_from_target: bool = False,
                 vocab_rows=None, freeze_lm_head: bool = False, init_layer_from_target: bool = False,
                 loss_rows: str = "assistant", fc_norm: bool = False, lk_weight: float = 0.0):
        if num_depths < 1 or num_layers < 1:
            raise ValueError(f"peagle: num_depths and num_layers must be at least 1, got {num_depths} / {num_layers}")
        if not (0 < ratio <= 1 and 0 <= ratio_min <= 1):
            raise ValueError(f"peagle: ratio must lie in (0, 1] and ratio_min in [0, 1], got {ratio} / {ratio_min}")
        if max_anchors is not None and max_anchors < 1:
            raise ValueError(f"peagle: max_anchors must be at least 1 or null, got {max_anchors}")
        super().__init__(draft_vocab_size=draft_vocab_size, vocab_data=vocab_data, vocab_max_samples=vocab_max_samples,
                         aux_layers=aux_layers, ttt_steps=1, target_chunk=target_chunk, head_chunk=head_chunk,
                         init_lm_head_from_target=init_lm_head_from_target, vocab_rows=vocab_rows,
                         freeze_lm_head=freeze_lm_head, init_layer_from_target=init_layer_from_target,
                         loss_rows=loss_rows, fc_norm=fc_norm, lk_weight=lk_weight)
        self.num_depths, self.num_layers = int(num_depths), int(num_layers)
        self.ratio, self.ratio_min, self.max_anchors = float(ratio), float(ratio_min), max_anchors
        self.mask_token_id = mask_token_id

    def make_model(self, target: Target) -> PEagleModel:
        config = PEagleConfig.from_target(target, self.draft_vocab_size, self.feature_spec.aux_layers, self.fc_norm,
                                          self.num_layers, self.num_depths, self.mask_token_id)
        model = PEagleModel(config)
        with torch.no_grad():
            model.mask_hidden.normal_(0.0, config.initializer_range)
        return model

    def build(self, target: Target) -> PEagleModel:
        model = super().build(target)
        if self.init_layer_from_target:
            _init_extra_layers(model, target)
        return model

    # -- the forward over every depth
    def forward_depths(self, model: PEagleModel, batch: dict, generator=None) -> tuple[torch.Tensor, Packed]:
        """(h (B, Q, H) pre-norm outputs of the packed sequence, its ``Packed`` layout)."""
        ids, att = batch["input_ids"], batch["attention_mask"]
        B, T = ids.shape
        packed = pack(att, self.num_depths, self.ratio, self.ratio_min, self.max_anchors, generator)
        slots = packed.anchor.shape[1] - T
        h0 = model.fuse(batch["hidden_aux"])
        mask_state = model.mask_state()  # (1, H)
        hidden = torch.cat([h0, mask_state[None].expand(B, slots, -1)], 1)
        tokens = torch.cat([shift_tokens(ids, 1), ids.new_full((B, slots), int(model.config.mask_token_id))], 1)
        layout = ParallelLayout(packed.anchor, packed.depth, packed.valid)  # each layer applies its own window
        h = model.decode(hidden, tokens, packed.positions, layout, None)
        return h, packed

    @staticmethod
    def depth_rows(packed: Packed, batch: dict, d: int, start: int = 0,
                   length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, q, a) of depth ``d``'s entries whose prediction of ``ids[a+2+d]`` is scored: that token exists and
        is an assistant token. ``q`` indexes the packed sequence, ``a`` is the anchor. ``batch`` holds positions
        ``start..`` of rows of ``length`` tokens (default: the whole rows)."""
        T = batch["input_ids"].shape[1] if length is None else length
        b, q = ((packed.depth == d) & packed.valid).nonzero(as_tuple=True)
        a = packed.anchor[b, q]
        at = a + 2 + d
        ok = at < T
        b, q, a, at = b[ok], q[ok], a[ok], at[ok] - start
        ok = (batch["loss_mask"][b, at] > 0) & (batch["attention_mask"][b, at] > 0)
        return b[ok], q[ok], a[ok]

    sequence_parallel = None  # a training.sequence_parallel.SequenceShard: this rank trains a slice of each row

    def forward_shard(self, model: PEagleModel, batch: dict, shard) -> tuple[torch.Tensor, Packed, dict, int]:
        """``forward_depths`` for this rank of a sequence-parallel group: the group's layout (its rank 0's draw),
        dealt (``deal``): this rank runs its depth-0 positions and the slots anchored there, attending over the
        group's entries (``shard.parallel_layout``). Returns (h (B, L, H), this rank's ``Packed`` entries, its
        slice of the batch with the ``num_depths + 1`` positions after it, its first position)."""
        ids, att = batch["input_ids"], batch["attention_mask"]
        B, T = ids.shape
        packed = pack(att, self.num_depths, self.ratio, self.ratio_min, self.max_anchors)
        anchor, depth, valid = (shard.share(x) for x in (packed.anchor, packed.depth, packed.valid.long()))
        dealt = deal(Packed(anchor, depth, valid.bool()), T, shard.size)
        mine = dealt.local[shard.rank]
        local, own = shard.local_batch({**batch, "next_ids": shift_tokens(ids, 1)}, self.num_depths + 1)
        slots = mine.anchor.shape[1] - own
        hidden = torch.cat([model.fuse(local["hidden_aux"][:, :own]), model.mask_state()[None].expand(B, slots, -1)], 1)
        tokens = torch.cat([local["next_ids"][:, :own], ids.new_full((B, slots), int(model.config.mask_token_id))], 1)
        whole = ParallelLayout(dealt.whole.anchor, dealt.whole.depth, dealt.whole.valid)
        h = model.decode(hidden, tokens, mine.positions, shard.parallel_layout(whole, dealt.order), None)
        return h, mine, local, shard.rank * own

    def loss(self, model: PEagleModel, batch: dict, target: Target) -> StepOutput:
        if self.loss_rows == "all":
            batch = {**batch, "loss_mask": batch["attention_mask"]}
        shard, T = self.sequence_parallel, batch["input_ids"].shape[1]
        if shard is None:
            h, packed = self.forward_depths(model, batch)
            start = 0
        else:  # this rank's positions and slots; each depth's mean over the group's rows, summed by shard.combine
            h, packed, batch, start = self.forward_shard(model, batch, shard)
        rows = self.target_rows(model, batch, target)
        sums, counts, right = [], [], []
        for d in range(self.num_depths):
            b, q, a = self.depth_rows(packed, batch, d, start, T)
            s = a + 1 + d - start  # the position whose target distribution is depth d's label
            keep = rows.in_vocab[b, s]
            b, q, s = b[keep], q[keep], s[keep]
            # the labels stay in the target's table, gathered a chunk at a time (no (n, V) copy per depth)
            loss_sum, pred = draft_soft_loss(model, h[b, q], rows.probs, rows.row_of[b, s], None, self.head_chunk,
                                             self.lk_weight)
            sums.append(loss_sum)
            counts.append(b.numel())
            right.append(int((model.to_target_ids(pred) == rows.argmax[b, s]).sum()))
        stats = torch.tensor([counts, right, [float(x.detach()) for x in sums]], dtype=torch.float64)
        if shard is not None:
            stats = shard.total(stats)
        total = 0.0 * h.sum()  # every parameter in the graph (mask_hidden too) even when a depth has no rows
        for d, loss_sum in enumerate(sums):
            total = total + loss_sum / max(float(stats[0, d]), 1.0)
        metrics = {}
        for d in range(self.num_depths):
            n = float(stats[0, d])
            metrics[f"step{d}_loss"] = float(stats[2, d]) / max(n, 1.0)
            metrics[f"step{d}_acc"] = float(stats[1, d]) / n if n else 0.0
        return StepOutput(loss=total if shard is None else shard.combine(total), metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: PEagleModel, batch: dict, target: Target) -> dict[str, float]:
        """Per depth: ``step{d}`` top-1 agreement with the target's argmax and ``joint{d}`` (depths 0..d of the
        anchor all right), as sums over anchors drawn with a fixed seed."""
        reference = batch.get(ARGMAX_KEY)
        if reference is None:
            reference = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
        gen = torch.Generator().manual_seed(0)
        h, packed = self.forward_depths(model, batch, gen)
        B, T = reference.shape
        right = torch.zeros(B, T, self.num_depths, dtype=torch.bool, device=h.device)
        for d in range(self.num_depths):  # every kept entry, scored or not: a chain needs all its depths right
            b, q = ((packed.depth == d) & packed.valid).nonzero(as_tuple=True)
            s = packed.anchor[b, q] + 1 + d
            ok = s < T
            b, q, s = b[ok], q[ok], s[ok]
            pred = model.to_target_ids(target_argmax(model.logits, h[b, q], self.head_chunk))
            right[b, packed.anchor[b, q], d] = pred == reference[b, s]
        out: dict[str, float] = {}
        for d in range(self.num_depths):
            b, _, a = self.depth_rows(packed, batch, d)
            out[f"step{d}_correct"], out[f"step{d}_total"] = float(right[b, a, d].sum()), float(b.numel())
            out[f"joint{d}_correct"] = float(right[b, a, : d + 1].all(-1).sum())
            out[f"joint{d}_total"] = float(b.numel())
        return out

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_estimate`` / ``tau_joint`` of one K-token draft from the per-depth accuracies."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training): a chain cut to K tokens."""
        from dataclasses import replace

        if shape.kind == "chain" and shape.k > model.num_depths:
            shape = replace(shape, k=model.num_depths)
        return PEagleDrafter(model, shape)


def _init_extra_layers(model: PEagleModel, target: Target) -> None:
    """``init_layer_from_target`` for the layers after ``midlayer`` (which ``Eagle3Method`` starts as the target's
    layer ``aux_layers[-1]``): layer ``i`` starts as the target's layer ``aux_layers[-1] + i`` (the last one past
    the end)."""
    top = list(model.config.aux_layers)[-1]
    with torch.no_grad():
        for i, layer in enumerate(model.extra_layers(), start=1):
            src = target.layers[min(top + i, target.num_layers - 1)]
            for name, param in layer.named_parameters():
                value = src.get_parameter(name)
                if param.shape != value.shape:
                    raise ValueError(f"init_layer_from_target: {name} of the target's layer is {tuple(value.shape)}, "
                                     f"the drafter's {tuple(param.shape)}")
                param.copy_(value)
