"""The Domino drafter: DFlash's block forward, then the GRU-corrected logits drafted left to right.

Each step runs one block forward (``DFlashDrafter.block_states``: the same context cache and masks). The slot that
predicts the ``m``-th drafted token (slot ``m-1`` with ``shift_label``, slot ``m`` without) gives its logits; from
``suffix_start`` on they carry the correction of the prefix GRU over the target's embeddings of the anchor and
the tokens drafted so far (``models.domino``), as SGLang's Domino rollout feeds each proposal back. A token is the
top-1 at T = 0 or a draw from ``softmax(logits / T)`` at T > 0, whose distribution is the chain's ``q`` (each
draw's exact law given the drafted prefix, so the p/q chain test stays exact).
"""

from __future__ import annotations

import torch

from specheads.decoding.cpu_linears import pack_like
from specheads.decoding.drafters import TreeShape
from specheads.decoding.head_drafters import DFlashDrafter, _nparams
from specheads.decoding.tree import DraftTree, draw_token


class DominoDrafter(DFlashDrafter):
    """A Domino head as a batched chain drafter (``shape``: a chain of ``k <= B-1``; trees are refused: each
    corrected slot depends on the tokens drafted before it)."""

    name = "domino"

    def __init__(self, model, shape: TreeShape | None = None):
        if shape is not None and shape.kind != "chain":
            raise ValueError(f"the Domino drafter drafts chains (its GRU follows the drafted prefix); got the shape "
                             f"{shape.label()}")
        super().__init__(model, shape)
        # the backbone, the target's LM head and the correction's output layer on every drafted token
        self.params_per_forward = _nparams(model) + model.config.hidden_size * model.config.vocab_size

    def chain(self, h: torch.Tensor, anchors: torch.Tensor, temperature: float, generator):
        """h: (B, k, H) states of the slots that predict drafted tokens 1..k; anchors: (B,) -> (tokens (B, k),
        logits (B, k, V) float64, q (B, k, V) float64 or None at T = 0), drafted one by one."""
        model, first = self.model, self.model.first_slot
        toks, logits, qs = [], [], []
        state, prev = None, anchors
        for j in range(h.shape[1]):
            out, state = model.gru_states(prev[:, None], state)  # the anchor and the tokens drafted so far
            lj = model.draft_logits(h[:, j], out[:, 0] if j + first >= model.suffix_start else None).double()
            tok, q = draw_token(lj, temperature, generator)
            if q is not None:
                qs.append(q)
            toks.append(tok)
            logits.append(lj)
            prev = tok
        return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(qs, 1) if qs else None

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        first = self.model.first_slot
        h = self.block_states(seqs, active)[:, first: first + self.depth]
        anchors = torch.tensor([s[-1] for s in seqs], device=self.device)
        toks, logits, q = self.chain(h, anchors, temperature, generator)
        self.last_logits = logits
        toks = toks.cpu()
        return [DraftTree.chain(toks[b].tolist(), None if q is None else q[b]) if active[b] else DraftTree.empty()
                for b in range(len(seqs))]


def domino_drafter(model, target, spec) -> DominoDrafter:
    """The evaluator's drafter over a Domino head (loaded, unattached; ``specheads.heads.load_head``), attached to
    ``target`` in the target's dtype (its embedding and LM head are the target's own, as DFlash's)."""
    model = model.to(target.device, target.dtype).eval().attach(target)
    pack_like(model, target.model)
    return DominoDrafter(model, spec.shape)
