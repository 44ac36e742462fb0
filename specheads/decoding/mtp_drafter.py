"""A target's MTP layer (``specheads.models.mtp``) as a batched drafter: EAGLE's drafting loop, recursive.

The MTP layer has EAGLE-1's drafting API (``fuse`` the target's last state, ``step`` feeds its own output back), so
``EagleDrafter`` drafts with it unchanged: every row's newly verified (target state, next token) pairs are fed and
committed to the layer's KV cache, then a chain (or tree) grows one MTP step per token, as vLLM's MTP proposer
drafts ``num_speculative_tokens`` with one layer reused. Verification stays the evaluator's: lossless.
"""

from __future__ import annotations

from specheads.decoding.cpu_linears import pack_like
from specheads.decoding.drafters import TreeShape
from specheads.decoding.head_drafters import EagleDrafter
from specheads.models.mtp import MTPModel


class MTPDrafter(EagleDrafter):
    """``shape``: a chain of K (what vLLM drafts) or a dynamic tree."""

    def __init__(self, model, shape: TreeShape):
        super().__init__(model, shape, "eagle1")  # the LM head read per forward is the target's, as EAGLE-1's
        self.name = "mtp"


def mtp_drafter(model, target, spec) -> MTPDrafter:
    """The evaluator's drafter over an MTP head (loaded, unattached), in the head's dtype, attached to ``target``."""
    model = model.to(target.device).eval().attach(target)
    pack_like(model, target.model)
    return MTPDrafter(model, spec.shape)


def load_mtp_drafter(head_dir, target, shape: TreeShape) -> MTPDrafter:
    """The drafter for a saved MTP head folder (in the head's dtype, attached to ``target``)."""
    model = MTPModel.from_pretrained(head_dir).to(target.device).eval().attach(target)
    pack_like(model, target.model)
    return MTPDrafter(model, shape)
