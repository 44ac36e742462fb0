"""The DSpark drafter: DFlash's block forward, the Markov bias applied left to right, a confidence schedule.

Each step runs one block forward (``DFlashDrafter.block_states``: the same context cache and masks), then
drafts slot by slot: slot ``j``'s logits are the backbone's plus the Markov bias of the token drafted before it
(the anchor for slot 1), the top-1 at T = 0 or a draw from ``softmax(logits / T)`` at T > 0, whose distribution
is the chain's ``q`` (each draw's exact law given the drafted prefix, so the p/q chain test stays exact).

With ``threshold`` set, the confidence head's ``c_j`` (``models.dspark.DSparkModel.confidence``) schedules the
verification: only the leading drafts whose survival ``prod_{i<=j} c_i`` is at least ``threshold`` are sent to
the target (at least one). Cutting a chain never changes what verification accepts of the part it keeps, so the
schedule trades acceptance length for a shorter verify forward and stays lossless.
"""

from __future__ import annotations

import torch

from specheads.decoding.cpu_linears import pack_like
from specheads.decoding.head_drafters import DFlashDrafter, _nparams
from specheads.decoding.drafters import TreeShape
from specheads.decoding.tree import DraftTree, draw_token


class DSparkDrafter(DFlashDrafter):
    """A DSpark head as a batched chain drafter (``shape``: a chain of ``k <= B-1``; trees are refused: the
    Markov bias makes each slot depend on its parent, which DFlash's per-slot trees ignore)."""

    name = "dspark"

    def __init__(self, model, shape: TreeShape | None = None, threshold: float | None = None):
        if shape is not None and shape.kind != "chain":
            raise ValueError(f"the DSpark drafter drafts chains (the Markov bias follows the drafted prefix); got "
                             f"the shape {shape.label()}")
        super().__init__(model, shape)
        if threshold is not None:
            if model.confidence_head is None:
                raise ValueError("a confidence schedule needs a head with a confidence head "
                                 "(enable_confidence_head=true)")
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"the confidence threshold must lie in [0, 1], got {threshold}")
        self.threshold = threshold
        self.params_per_forward = _nparams(model) + model.config.hidden_size * model.config.vocab_size
        self.last_confidence: torch.Tensor | None = None  # (B, depth) of the latest proposal (tests read it)

    def markov_chain(self, h: torch.Tensor, anchors: torch.Tensor, temperature: float, generator):
        """h: (B, k, H) states of slots 1..k; anchors: (B,) -> (tokens (B, k), prev (B, k), logits (B, k, V),
        q (B, k, V) float64 or None at T = 0), drafting slot by slot."""
        toks, prevs, logits, qs = [], [], [], []
        prev = anchors
        for j in range(h.shape[1]):
            lj = self.model.draft_logits(h[:, j], prev).double()
            tok, q = draw_token(lj, temperature, generator)
            if q is not None:
                qs.append(q)
            toks.append(tok)
            prevs.append(prev)
            logits.append(lj)
            prev = tok
        q = torch.stack(qs, 1) if qs else None
        return torch.stack(toks, 1), torch.stack(prevs, 1), torch.stack(logits, 1), q

    def scheduled_lengths(self, h: torch.Tensor, prev: torch.Tensor) -> list[int]:
        """(B, k, H) slot states and (B, k) previous tokens -> drafts to verify per row: the leading ones whose
        survival (the running product of confidences) is at least ``threshold``, at least one."""
        conf = self.last_confidence = self.model.confidence(h, prev)
        survival = torch.cumprod(conf.double(), dim=1)
        return [max(1, int(n)) for n in (survival >= self.threshold).sum(1).tolist()]

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        h = self.block_states(seqs, active)[:, 1: 1 + self.depth]
        anchors = torch.tensor([s[-1] for s in seqs], device=self.device)
        toks, prev, logits, q = self.markov_chain(h, anchors, temperature, generator)
        self.last_logits = logits
        keep = self.scheduled_lengths(h, prev) if self.threshold is not None else [self.depth] * len(seqs)
        toks = toks.cpu()
        trees = [DraftTree.chain(toks[b, :keep[b]].tolist(), None if q is None else q[b, :keep[b]])
                 if active[b] else DraftTree.empty() for b in range(len(seqs))]
        return trees


def dspark_drafter(model, target, spec) -> DSparkDrafter:
    """The evaluator's drafter over a DSpark head (loaded, unattached; ``specheads.heads.load_head``), attached to
    ``target`` in the target's dtype (its embedding and LM head are the target's own, as DFlash's), scheduled by
    ``spec.confidence_threshold``."""
    model = model.to(target.device, target.dtype).eval().attach(target)
    pack_like(model, target.model)
    return DSparkDrafter(model, spec.shape, spec.confidence_threshold)
