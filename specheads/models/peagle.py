"""P-EAGLE: EAGLE-3 that drafts K tokens in one forward (parallel drafting, arXiv 2602.01469).

The model is EAGLE-3's (``specheads.models.eagle3``: ``fc`` fuses the low/mid/high target states, ``midlayer``
reads ``[input_layernorm(embed(ids)); hidden_norm(hidden)]``, ``norm`` and a reduced-vocabulary ``lm_head`` with
``d2t``/``t2d``), plus:

* ``mask_hidden`` (1, n_aux · H_target): a learnt stand-in for the target states of positions not yet verified.
  It takes the real states' path: ``fuse(mask_hidden)`` (``fc_norm`` if any, then ``fc``), exactly as vLLM
  (``llm_base_proposer``: ``combine_hidden_states(mask_hidden)``) fills its parallel-drafting slots.
* ``mask_token_id`` in the config: the token the parallel slots read (an existing row of the target's embedding).
* optional extra decoder layers ``layers.{i}`` (i >= 1; the paper's drafts have 4 layers), plain Llama layers
  on the residual stream, as vLLM's ``llama_eagle3`` builds its layers after the first.

Drafting (one forward per block; the alignment of ``specheads.models.eagle3``): the drafter's input at the last
verified position ``t`` is (fused state at ``t``, the pending token ``ids[t+1]``) at position ``t`` (depth 0); depth
``d = 1..K-1`` is (``fuse(mask_hidden)``, ``mask_token_id``) at position ``t+d``. Depth ``d``'s output gives the
logits of ``ids[t+2+d]``. Queries attend causally: depth ``d`` sees the verified context up to ``t`` and depths
``0..d`` of its own block, which is the rule ``parallel_attention_mask`` builds for training.

Training passes that rule as a ``ParallelLayout`` (the packed anchors and depths, not the (Q, Q) mask over the Q
packed entries of a row, which is several times T² for T tokens): on a CPU the depth-0 entries attend causally
(``layers.unrolled_attention``: flash attention, windowed in chunks) and the rest through
``ranged_attention`` (the depth-0 keys up to the anchor plus the chain's own slots); elsewhere through the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specheads.models import ranged_attention
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.layers import AttentionPattern, DraftDecoderLayer, KVCache, unrolled_attention
from specheads.targets import Target


class PEagleConfig(Eagle3Config):
    """EAGLE-3's config plus: mask_token_id (the parallel slots' token), num_depths (K: tokens one forward drafts,
    depth 0 included; the depths trained) and num_hidden_layers >= 1 (layer 0 is EAGLE-3's ``midlayer``)."""

    model_type = "specheads_peagle"
    mask_token_id: int | None = None
    num_depths: int = 4

    @classmethod
    def from_target(cls, target: Target, draft_vocab_size: int, aux_layers=None, fc_norm: bool = False,
                    num_layers: int = 1, num_depths: int = 4, mask_token_id: int | None = None,
                    sliding_window: int | None = None, qk_norm: bool = False) -> "PEagleConfig":
        from specheads.models.dflash import default_mask_token

        base = Eagle3Config.from_target(target, draft_vocab_size, aux_layers, fc_norm, sliding_window=sliding_window,
                                        qk_norm=qk_norm, num_layers=num_layers, mrope=False).to_dict()
        for key in ("model_type", "transformers_version", "architectures"):
            base.pop(key, None)
        base.update(num_hidden_layers=int(num_layers), num_depths=int(num_depths),
                    mask_token_id=default_mask_token(target) if mask_token_id is None else int(mask_token_id))
        return cls(**base)


class PEagleModel(Eagle3Model):
    config_class = PEagleConfig
    base_model_prefix = "peagle"

    def __init__(self, config: PEagleConfig):
        super().__init__(config)
        if config.num_hidden_layers < 1 or config.num_depths < 1:
            raise ValueError(f"P-EAGLE needs num_hidden_layers >= 1 and num_depths >= 1, got "
                             f"{config.num_hidden_layers} / {config.num_depths}")
        if config.mask_token_id is None:
            raise ValueError("P-EAGLE needs mask_token_id in its config")
        # keys "1", "2", ...: saved as layers.{i}.*, the names vLLM's eagle3 loader gives the layers after the first
        if config.layer_types is not None and len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types names {len(config.layer_types)} layers; the head has {config.num_hidden_layers}")
        self.layers = nn.ModuleDict({str(i): DraftDecoderLayer(config, layer=i)
                                     for i in range(1, config.num_hidden_layers)})
        width = len(config.aux_layers or (0, 0, 0)) * (config.target_hidden_size or config.hidden_size)
        self.mask_hidden = nn.Parameter(torch.zeros(1, width))

    @property
    def num_draft_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_depths(self) -> int:
        return int(self.config.num_depths)

    def extra_layers(self) -> list:
        return [self.layers[str(i)] for i in range(1, self.config.num_hidden_layers)]

    def attach(self, target: Target) -> "PEagleModel":
        super().attach(target)
        if not 0 <= int(self.config.mask_token_id) < target.vocab_size:
            raise ValueError(f"mask_token_id {self.config.mask_token_id} is not a row of the target's embedding "
                             f"(vocabulary {target.vocab_size})")
        return self

    def mask_state(self) -> torch.Tensor:
        """(1, H) the fused input of every parallel slot: ``fuse(mask_hidden)``."""
        return self.fuse(self.mask_hidden)

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)


def parallel_attention_mask(anchor: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, Q, Q) bool (True = may attend) over a packed sequence of depth-0 and parallel-slot queries.

    anchor (B, Q): the position whose verified state a query's chain starts from; depth (B, Q) or (Q,): 0 for
    real tokens, d >= 1 for the slot d positions after its anchor; valid (B, Q): real entries (padding False).
    A query sees the valid depth-0 keys whose anchor is at or before its own, and the valid keys of its own
    anchor with depth 1..its own. Every query sees itself, so a padding row is never fully masked.
    """
    B, Q = anchor.shape
    depth = depth.expand(B, Q) if depth.dim() == 1 else depth
    aq, ak = anchor[:, :, None], anchor[:, None, :]
    dq, dk = depth[:, :, None], depth[:, None, :]
    context = (dk == 0) & (ak <= aq)
    own = (dk >= 1) & (ak == aq) & (dk <= dq)
    allowed = (context | own) & valid[:, None, :].bool()
    return allowed | torch.eye(Q, dtype=torch.bool, device=anchor.device)[None]


def parallel_window_mask(anchor: torch.Tensor, depth: torch.Tensor, window: int) -> torch.Tensor:
    """(B, Q, Q) bool, the sliding-window part of speculators' P-EAGLE mask (what a sliding layer adds to
    ``parallel_attention_mask``): a key of another chain is kept when its anchor lies above ``anchor + depth - window``
    of the query; every key of the query's own chain is kept."""
    B, Q = anchor.shape
    depth = depth.expand(B, Q) if depth.dim() == 1 else depth
    aq, ak, dq = anchor[:, :, None], anchor[:, None, :], depth[:, :, None]
    return (ak > aq + dq - window) | (ak == aq)


@dataclass
class ParallelLayout(AttentionPattern):
    """``parallel_attention_mask`` (and, in a sliding layer, ``parallel_window_mask``) as a rule: anchor, depth,
    valid (B, Q) as those functions take them. ``attend`` runs the rule without a (Q, Q) tensor on the CPU when the
    layout is ``methods.peagle.pack``'s (``plan``), and under the mask otherwise."""

    anchor: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    def dense(self, window: int | None) -> torch.Tensor:
        """(B, Q, Q) bool: the mask a layer with this ``window`` applies."""
        mask = parallel_attention_mask(self.anchor, self.depth, self.valid)
        return mask if window is None else mask & parallel_window_mask(self.anchor, self.depth, window)

    def attend(self, q, k, v, scale, window):
        plan = self.plan()
        if plan is None or not ranged_attention.supported(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense(window)[:, None], scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        T, head = plan["T"], plan["head"]
        parts = [] if not head else [unrolled_attention(q[:, :, :head], [k[:, :, :head]], [v[:, :, :head]], scale,
                                                        window)]
        if head < q.shape[2]:
            # every depth's slots in anchor order: a chunk of queries spans few anchors, so its key range is nearly
            # all a shared core (each depth apart, a chunk of depth d spans 1 / (its share of anchors) times more)
            order, back = plan["order"], plan["back"]
            a, d = self.anchor[:, head:].gather(1, order), plan["depth"][:, head:].gather(1, order)
            hi = a + 1  # the depth-0 keys up to the anchor (the anchor's own always, even past the window)
            lo = torch.zeros_like(a) if window is None else torch.minimum(a, a + d - window + 1).clamp(min=0)
            index, allowed = (x.gather(2, order.expand(x.shape)) for x in (plan["index"], plan["allowed"]))
            out = ranged_attention.ranged_attention(take_entries(q[:, :, head:], order), k[:, :, :T], v[:, :, :T],
                                                    lo, hi, self.valid[:, :T], k, v, index, allowed, scale)
            parts.append(take_entries(out, back))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 2)

    def plan(self) -> dict | None:
        """How ``attend`` splits the packed sequence, or None when the layout is not ``pack``'s: T depth-0 entries at
        positions 0..T-1 (right-padded), then blocks of one depth each, valid anchors first and ascending.

        ``head``: the depth-0 entries valid in every row (plain causal attention); the rest attend through
        ``ranged_attention`` with own keys (index / allowed (J, B, Q - head)): for each depth j >= 1 the valid slot
        of the query's anchor at depth j when j <= the query's depth, and the query itself when it is padding
        (the mask's diagonal); ``order`` (B, Q - head) puts them in anchor order (padding last), ``back`` undoes
        it."""
        if "plan" not in self._cache:
            self._cache["plan"] = self._plan()
        return self._cache["plan"]

    def _plan(self) -> dict | None:
        B, Q = self.anchor.shape
        depth = self.depth.expand(B, Q) if self.depth.dim() == 1 else self.depth
        valid, dev = self.valid.bool(), self.anchor.device
        zero = (depth == 0).all(0)
        T = Q if bool(zero.all()) else int((~zero).nonzero()[0])
        pos = torch.arange(T, device=dev)
        if bool((depth[:, T:] == 0).any()) or not bool((self.anchor[:, :T] == pos).all()) or \
                not bool((depth == depth[:1]).all()):
            return None
        lengths = valid[:, :T].sum(1)
        if not bool((valid[:, :T] == (pos < lengths[:, None])).all()):
            return None
        head = int(lengths.min()) if B else 0
        a, d, rest = self.anchor[:, head:], depth[:, head:], Q - head
        index, allowed = [], []
        for j in range(1, int(depth.max()) + 1 if Q else 1):
            cols = (depth[0] == j).nonzero().flatten()
            if not cols.numel():
                continue
            start, m = int(cols[0]), cols.numel()
            if int(cols[-1]) != start + m - 1:
                return None
            offset = torch.arange(m, device=dev)
            keyed = torch.where(valid[:, start:start + m], self.anchor[:, start:start + m], T + offset)
            if m > 1 and not bool((keyed[:, 1:] > keyed[:, :-1]).all()):
                return None
            at = torch.searchsorted(keyed.contiguous(), a.contiguous()).clamp(max=m - 1)
            index.append(start + at)
            allowed.append((keyed.gather(1, at) == a) & (j <= d))
        index.append((head + torch.arange(rest, device=dev)).expand(B, rest))  # a padding entry sees itself
        allowed.append(~valid[:, head:])
        key = torch.where(valid[:, head:], a, T + torch.arange(rest, device=dev))  # padding last
        order = key.argsort(dim=1, stable=True)
        return {"T": T, "head": head, "depth": depth, "index": torch.stack(index), "allowed": torch.stack(allowed),
                "order": order, "back": order.argsort(1)}


def take_entries(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, heads, n, D) -> the entries of each row in ``order`` (B, n): ``x[b, :, order[b]]``."""
    return x.gather(2, order[:, None, :, None].expand(x.shape))
