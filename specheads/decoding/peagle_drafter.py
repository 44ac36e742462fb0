"""A P-EAGLE head (``specheads.models.peagle``) as a batched drafter: one draft forward per step, a chain of K.

Each step feeds, in one forward, every row's newly verified (fused target state, next token) pairs, as
``EagleDrafter`` does, followed by ``k - 1`` parallel slots (``fuse(mask_hidden)``, ``mask_token_id``) at the next
positions, all causal: the layout vLLM's parallel drafting builds (the pending token at the last verified
position ``t``, then the mask slots at ``t+1 .. t+k-1``). Depth ``d``'s logits (the output at ``t + d``) draft the
``d+1``-th token of the chain. The verified pairs are committed to the drafter's KV cache; the slots are dropped.

With a sliding window (speculators' P-EAGLE mask): a query at position ``t + d`` keeps the verified keys at positions
above ``t + d - W`` and every key of its own block.

At T > 0 each depth's token is drawn from softmax(logits / T), which is also its ``q``: the slots never read the
tokens drawn before them, so each draw's law is exactly its conditional law and the chain p/q test stays exact.
"""

from __future__ import annotations

import torch

from specheads.decoding.cpu_linears import pack_like
from specheads.decoding.drafters import TreeShape
from specheads.decoding.head_drafters import EagleDrafter, _to_target_vocab
from specheads.decoding.tree import DraftTree, probs


class PEagleDrafter(EagleDrafter):
    """Chains only (``shape`` None = the K tokens the head was trained to draft); ``shape.k <= K``."""

    def __init__(self, model, shape: TreeShape | None = None):
        K = int(model.num_depths)
        shape = shape if shape is not None else TreeShape("chain", k=K)
        if shape.kind != "chain":
            raise ValueError(f"P-EAGLE drafts a chain in one forward (as vLLM's parallel drafting), not "
                             f"{shape.label()}")
        if shape.k > K:
            raise ValueError(f"this P-EAGLE head was trained to draft {K} tokens per forward; a chain of {shape.k} "
                             "asks for more")
        super().__init__(model, shape, "eagle3")
        self.name = "peagle"
        self.last_logits: torch.Tensor | None = None  # (B, k, V_draft) of the latest proposal (tests read it)

    @torch.no_grad()
    def block_logits(self, active) -> torch.Tensor:
        """(B, k, V_draft): depth 0..k-1 logits of every row's parallel draft (pending pairs fed and committed)."""
        B, k = len(active), self.shape.k
        lens = torch.tensor([len(self.pending_ids[b]) if active[b] else 0 for b in range(B)])
        q = int(lens.max()) + k - 1
        H = self.pending_h[0].shape[-1]
        mask_state = self.model.mask_state()[0].to(self.dtype)
        mask_id = int(self.model.config.mask_token_id)
        # every row's inputs gathered on the host side and written in one copy each (a copy per row waits for a GPU)
        hid = torch.zeros(B * q, H, dtype=self.dtype, device=self.device)
        ids = [[0] * q for _ in range(B)]
        pieces, where = [], []
        for b in range(B):
            n = int(lens[b])
            if not active[b]:
                continue
            pieces += [self.pending_h[b][-n:].to(self.dtype), mask_state.expand(k - 1, -1)]
            where.extend(range(b * q, b * q + n + k - 1))
            ids[b][:n + k - 1] = self.pending_ids[b][-n:] + [mask_id] * (k - 1)
            self.pending_h[b], self.pending_ids[b] = self.pending_h[b][:0], []
        if pieces:
            hid[torch.tensor(where, dtype=torch.long).to(self.device)] = torch.cat(pieces)
        hid = hid.view(B, q, H)
        ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        live_len = lens + torch.tensor([k - 1 if a else 0 for a in active])
        par, live = self.slots.chain_parents(live_len, q)
        self._anchor_at = self.slots.num_tokens + lens.to(self.device) - 1  # (B,) each row's last verified position
        _, logits = self._step(hid, ids, par, live, verified=True)
        self._commit_chain(lens.tolist())  # the verified pairs stay in the cache, the slots go
        at = (lens - 1).clamp(min=0).to(self.device)[:, None] + torch.arange(k, device=self.device)
        return logits.gather(1, at[:, :, None].expand(-1, -1, logits.shape[-1]))

    def _window(self, pos: torch.Tensor, verified: bool) -> torch.Tensor | None:
        """speculators' P-EAGLE window: counted from each query's own position; a slot keeps its whole block (the
        keys from the anchor on), a verified pair only what its own position allows."""
        if getattr(self.model, "sliding_window", None) is None:
            return None
        keys = self.slots.key_positions()
        root = torch.minimum(pos, self._anchor_at[:, None])
        return self.model.window_mask(pos, keys) | (keys[:, None, :] >= root[:, :, None])

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        logits = self.last_logits = self.block_logits(active).double()
        B, k, Vd = logits.shape
        d2t_full = self.model.to_target_ids(torch.arange(Vd, device=self.device)).cpu()
        if temperature > 0:
            q = probs(logits, temperature).cpu()
            draft = torch.multinomial(q.reshape(-1, Vd), 1, generator=generator).view(B, k)
            q = _to_target_vocab(q.reshape(-1, Vd), d2t_full, self.model.config.vocab_size).view(B, k, -1)
        else:
            draft, q = logits.argmax(-1).cpu(), None
        toks = d2t_full[draft]
        return [DraftTree.chain(toks[b].tolist(), None if q is None else q[b]) if active[b]
                else DraftTree.empty() for b in range(B)]


def peagle_drafter(model, target, spec) -> PEagleDrafter:
    """The evaluator's drafter over a P-EAGLE head (loaded, unattached; ``specheads.heads.load_head``), in the head's
    dtype, attached to ``target``."""
    model = model.to(target.device).eval().attach(target)
    pack_like(model, target.model)
    return PEagleDrafter(model, spec.shape)
