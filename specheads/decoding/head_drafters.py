"""Drafters over trained heads: Medusa (static tree or chain), EAGLE-1/3 (dynamic EAGLE-2
tree or chain) and DFlash (one block forward: a chain, or a tree of per-slot candidates). They read the target's features of committed positions (see ``drafters.py``).

Medusa: at the last committed position t (the pending token is ids[t+1], the target's own
prediction), head k proposes ids[t+k+2]; a static tree picks, per depth d, the ranks listed in
``choices`` from head d's top-k.

EAGLE: every committed position t gives the drafter (feature_t, ids[t+1]); its step predicts
the feature at t+1 and logits for ids[t+2]. Drafted nodes feed their parent's predicted feature
back. The drafter's own KV cache follows the same committed/scratch discipline as the target's
(``TreeSlots``); draft entries are discarded after each proposal, so accepted positions are
re-fed with the target's real features.

DFlash: every committed position's fused aux-layer states go into the drafter's context cache once
(never rolled back: only verified positions enter it). One forward on the block [pending token
(the anchor, at position p), mask x (B-1)] at positions p..p+B-1, whose queries see the context
(positions < p) and the whole block, gives slot j's logits for the token at p+j. The anchor's own
state is not context (the target computes it only when it verifies the block).
"""

from __future__ import annotations

import torch

from specheads.decoding.cpu_linears import pack_like
from specheads.decoding.drafters import Drafter, TreeShape
from specheads.decoding.slots import TreeSlots
from specheads.decoding.tree import DraftTree, dynamic_trees, normalize_choices, probs, static_tree
from specheads.models.mrope import mrope_settings


def _nparams(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _first_layer(model):
    """The module every pass of a draft network enters once: EAGLE-3's and P-EAGLE's ``midlayer``, else the first
    decoder layer (EAGLE-1, MTP, DFlash, DSpark). Its calls are the draft forwards (a DFlash context feed computes
    keys and values only: no call)."""
    mid = getattr(model, "midlayer", None)
    return mid if mid is not None else model.layers[0]


class MedusaDrafter(Drafter):
    """Medusa heads as a drafter: ``shape.kind`` static (``shape.choices``) or chain (k <= heads)."""

    name = "medusa"
    needs_features = True

    def __init__(self, heads, shape: TreeShape):
        K = heads.config.num_heads
        if shape.kind == "dynamic":
            raise ValueError("Medusa heads draft a static tree or a chain, not a dynamic tree")
        if shape.kind == "chain" and shape.k > K:
            raise ValueError(f"a Medusa chain of {shape.k} needs {shape.k} heads; these have {K}")
        if shape.kind == "static":
            if not shape.choices:
                raise ValueError("a static Medusa tree needs choices")
            depth = max(len(c) for c in shape.choices)
            if depth > K:
                raise ValueError(f"tree choices reach depth {depth}; the heads have only {K}")
        self.heads, self.shape = heads, shape
        self.params_per_forward = _nparams(heads)

    def draft_modules(self):
        return (self.heads,)

    def start(self, prompts, feats):
        self.last = [feats.hidden_last[b, len(p) - 2] for b, p in enumerate(prompts)]

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.last[row] = hidden_last[-1]

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        dtype = next(self.heads.parameters()).dtype
        h = torch.stack(self.last).to(dtype)[:, None]  # (B, 1, H)
        logits = self.heads(h)[:, :, 0].double()  # (K, B, V)
        # what the trees read comes to the host once for the batch (a read per row or node waits for a GPU each)
        if self.shape.kind == "static":
            top = logits.topk(1 + max(c[-1] for c in self.shape.choices), dim=-1).indices.cpu()  # (K, B, ranks)
        elif temperature <= 0:
            greedy = logits[: self.shape.k].argmax(-1).cpu()  # (k, B)
        out = []
        for b in range(len(seqs)):
            if not active[b]:
                out.append(DraftTree.empty())
            elif self.shape.kind == "chain" and temperature <= 0:  # greedy verification reads the tokens only
                out.append(DraftTree.chain(greedy[:, b].tolist()))
            elif self.shape.kind == "chain":
                out.append(self._chain(logits[: self.shape.k, b], temperature, generator))
            else:
                out.append(static_tree(top[:, b], self.shape.choices))
        return out

    @staticmethod
    def _chain(logits, temperature, generator) -> DraftTree:
        q = probs(logits, temperature).cpu()
        toks = torch.multinomial(q, 1, generator=generator)[:, 0] if temperature > 0 else q.argmax(-1)
        return DraftTree.chain(toks.tolist(), q)


class EagleDrafter(Drafter):
    """EAGLE-1 (``model.fuse`` = identity on the last hidden state) or EAGLE-3 (fuses the aux
    layers named in its config) over a ``step``-API model, batched over rows."""

    needs_features = True

    def __init__(self, model, shape: TreeShape, kind: str):
        if kind not in ("eagle1", "eagle3"):
            raise ValueError(f"EAGLE kind '{kind}': use eagle1 or eagle3")
        if shape.kind == "static":
            raise ValueError("EAGLE drafts a dynamic tree or a chain")
        self.model, self.shape, self.kind, self.name = model, shape, kind, kind
        self.aux_layers = tuple(model.config.aux_layers) if kind == "eagle3" else ()
        self.params_per_forward = _nparams(model) + self._lm_head_params()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def draft_modules(self):
        return (_first_layer(self.model),)

    def _lm_head_params(self) -> int:
        # EAGLE-1 uses the target's LM head (read every draft forward, not among its parameters).
        head = getattr(self.model, "_lm_head", None)
        return head.weight.numel() if (self.kind == "eagle1" and head is not None) else 0

    def _feature(self, hidden_last, hidden_aux) -> torch.Tensor:
        x = hidden_aux if self.kind == "eagle3" else hidden_last
        return self.model.fuse(x.to(self.dtype))

    # -- state
    def start(self, prompts, feats):
        B = len(prompts)
        self.cache = self.model.new_cache()
        self.slots = TreeSlots(B, self.device)
        # an M-RoPE draft rotates by the target's 3-D positions of an image prompt, as it was trained and as vLLM's
        # proposer hands them: slot t at the target's position t (``vision_prompts.MropePositions``)
        self.mrope = getattr(feats, "mrope", None) if mrope_settings(self.model.config) else None
        self.pending_h = [self._feature(_row(feats.hidden_last, b), _row(feats.hidden_aux, b))[: len(p) - 1]
                          for b, p in enumerate(prompts)]
        self.pending_ids = [list(p[1:]) for p in prompts]

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.pending_h[row] = torch.cat([self.pending_h[row], self._feature(hidden_last, hidden_aux)])
        self.pending_ids[row] = self.pending_ids[row] + list(tokens)

    def _step(self, hidden, ids, parents, live, verified: bool = False):
        """One draft forward of q entries per row; ``verified``: they are verified pairs (each its own window anchor),
        else tree or chain nodes, whose anchor is the tree's root (the last verified position)."""
        pos, mask = self.slots.extend(parents, live)
        window = self._window(pos, verified)
        mrope = getattr(self, "mrope", None)
        at = pos if mrope is None else mrope.at(pos).permute(1, 2, 0).to(self.device)  # (B, q, 3)
        if window is None:
            return self.model.step(hidden, ids, at, mask, self.cache)
        h_out = self.model.decode(hidden, ids, at, mask, self.cache, window_mask=window)
        return h_out, self.model.logits(h_out)

    def _window(self, pos: torch.Tensor, verified: bool) -> torch.Tensor | None:
        """(B, q, S) the keys within each new entry's sliding window (None: no draft layer slides). A node keeps the
        keys after its root (its ancestors) and those within the window of its anchor, as the training-time test
        computes it (``specheads.models.layers``)."""
        if getattr(self.model, "sliding_window", None) is None:
            return None
        root = pos if verified else (self.slots.num_tokens - 1)[:, None].expand_as(pos)
        return self._window_of(pos, root, self.slots.key_positions())

    def _window_of(self, pos: torch.Tensor, root: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return self.model.window_mask(root, keys) | (keys[:, None, :] >= root[:, :, None])

    def _feed_pending(self, active) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's new (feature, next token) pairs; return root h_out (B, H) and logits (B, V_d)."""
        B = len(active)
        lens = torch.tensor([len(self.pending_ids[b]) if active[b] else 0 for b in range(B)])
        q = int(lens.max())
        H = self.pending_h[0].shape[-1]
        # every row's pending pairs gathered on the host side and written in one copy each (not a copy per row)
        hid = torch.zeros(B * q, H, dtype=self.dtype, device=self.device)
        ids = [[0] * q for _ in range(B)]
        pieces, where = [], []
        for b in range(B):
            n = int(lens[b])
            if n:
                pieces.append(self.pending_h[b][-n:])
                where.extend(range(b * q, b * q + n))
                ids[b][:n] = self.pending_ids[b][-n:]
                self.pending_h[b], self.pending_ids[b] = self.pending_h[b][:0], []
        if pieces:
            hid[torch.tensor(where, dtype=torch.long).to(self.device)] = torch.cat(pieces).to(self.dtype)
        hid = hid.view(B, q, H)
        ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        par, live = self.slots.chain_parents(lens, q)
        h_out, logits = self._step(hid, ids, par, live, verified=True)
        self._commit_chain(lens.tolist())
        last = (lens - 1).clamp(min=0).to(self.device)
        rows = torch.arange(B, device=self.device)
        return h_out[rows, last], logits[rows, last]

    def _commit_chain(self, lens: list[int]) -> None:
        c, idx = self.slots.commit([list(range(n)) for n in lens])
        if idx is None:
            if c:
                self.cache.crop(len(self.cache) - c)
        else:
            self.cache.select(torch.cat([torch.arange(c, device=idx.device).expand(len(lens), -1), idx], 1))

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        root_h, root_logits = self._feed_pending(active)
        self._h = {(b, -1): root_h[b] for b in range(len(seqs))}
        if self.shape.kind == "chain":
            trees = self._chains(root_logits, temperature, generator)
        else:
            self._slot = [dict() for _ in seqs]
            trees = dynamic_trees(torch.log_softmax(root_logits.double(), -1), self._expand,
                                  self.shape.depth, self.shape.topk, self.shape.total_tokens)
            mapped = self.model.to_target_ids(torch.cat([t.tokens for t in trees]).to(self.device)).cpu()
            for t, ids in zip(trees, mapped.split([t.size for t in trees])):  # one copy back for the batch
                t.tokens = ids
        self.cache.crop(len(self.cache) - self.slots.discard())
        return [t if a else DraftTree.empty() for t, a in zip(trees, active)]

    def _expand(self, nodes, tokens, parents) -> torch.Tensor:
        B, m = len(nodes), max(len(n) for n in nodes)
        s = self.slots.scratch
        root = self._h[(0, -1)]
        pad = root.new_zeros(root.shape)
        # the inputs built on the host and sent in one copy each (an element-wise write per node would launch a
        # copy per node on a GPU)
        hs, par, ids = [], [[-1] * m for _ in range(B)], [[0] * m for _ in range(B)]
        for b in range(B):
            for j, (n, t, p) in enumerate(zip(nodes[b], tokens[b], parents[b])):
                hs.append(self._h[(b, p)])
                par[b][j] = self._slot[b][p] if p >= 0 else -1
                ids[b][j] = t
                self._slot[b][n] = s + j
            hs.extend([pad] * (m - len(nodes[b])))
        hid = torch.stack(hs).view(B, m, -1)
        par = torch.tensor(par, dtype=torch.long).to(self.device)
        ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        h_out, logits = self._step(hid, self.model.to_target_ids(ids), par, torch.ones_like(par, dtype=torch.bool))
        for b in range(B):
            for j, n in enumerate(nodes[b]):
                self._h[(b, n)] = h_out[b, j]
        return torch.log_softmax(logits.double(), -1)

    def _chains(self, root_logits, temperature, generator) -> list[DraftTree]:
        B, k = root_logits.shape[0], self.shape.k
        V_t = self.model.config.vocab_size
        d2t_full = self.model.to_target_ids(torch.arange(root_logits.shape[-1], device=self.device)).cpu()
        toks, qs = [], []
        logits, h = root_logits, torch.stack([self._h[(b, -1)] for b in range(B)])
        for i in range(k):
            if temperature > 0:  # sampling: the draft distribution goes with the chain (p/q verification)
                q = probs(logits, temperature).cpu()
                d = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(_to_target_vocab(q, d2t_full, V_t))
            else:  # greedy verification reads the tokens only: no (B, V) distribution per draft
                d = logits.argmax(-1).cpu()
            toks.append(d2t_full[d])
            if i + 1 < k:
                lens = torch.ones(B, dtype=torch.long)
                par, live = self.slots.chain_parents(lens, 1)
                h_out, lg = self._step(h[:, None], toks[-1][:, None].to(self.device), par, live)
                h, logits = h_out[:, 0], lg[:, 0]
        T = torch.stack(toks, 1)
        Q = torch.stack(qs, 1) if qs else None
        return [DraftTree.chain(T[b].tolist(), None if Q is None else Q[b]) for b in range(B)]


class DFlashDrafter(Drafter):
    """A DFlash head (``specheads.models.dflash.DFlashModel``) as a batched drafter: one draft forward per step.

    Shapes (``TreeShape``; None = the whole block as a chain of B-1):
      * ``chain`` of ``k <= B-1``: slot j's top-1 (greedy) or a draw from softmax(slot j / T) with that
        distribution as ``q`` (the slots are drafted in parallel, so each draw is independent of the earlier
        ones and ``q`` is exactly its conditional law: the p/q chain test stays exact).
      * ``dynamic`` (depth <= B-1, topk, total_tokens): an EAGLE-2-style tree whose nodes at depth j take
        slot j's top-k candidates, whatever their parent (the block is drafted in parallel); levels grow from
        the ``topk`` best paths by summed log-probability and the ``total_tokens`` best nodes are kept.
        ``TreeShape.fan(w)`` is slot 1's w best tokens.
      * ``static`` (Medusa-style choices, depth <= B-1): rank ``c[d]`` of slot ``d+1`` along each choice.
    Trees carry no ``q``: at T > 0 they go through the target-only walk (exact for distinct siblings).

    The block always holds all B slots (slot outputs depend on the whole bidirectional block, as in
    training); only the slots the shape reads go through the LM head. Rows commit different numbers of
    positions per step, so the per-row context cache has holes (``ctx_valid`` False, masked out), squeezed
    out when they outnumber the entries.
    """

    name = "dflash"
    needs_features = True
    squeeze_slack = 16  # holes tolerated beyond as many as the entries before the cache is squeezed

    def __init__(self, model, shape: TreeShape | None = None):
        B = int(model.block_size)
        shape = shape if shape is not None else TreeShape("chain", k=B - 1)
        if shape.kind == "chain":
            depth = shape.k
        elif shape.kind == "dynamic":
            depth = shape.depth
        else:
            if not shape.choices:
                raise ValueError("a static DFlash tree needs choices (per-slot ranks, as Medusa's)")
            shape = TreeShape("static", choices=tuple(normalize_choices(shape.choices)))
            depth = max(len(c) for c in shape.choices)
        if depth > B - 1:
            raise ValueError(f"a DFlash block of {B} slots drafts at most {B - 1} tokens (slot 0 is the anchor); "
                             f"the shape {shape.label()} reaches depth {depth}")
        self.model, self.shape, self.depth, self.block = model, shape, depth, B
        self.aux_layers = tuple(model.config.aux_layers)
        # the target's LM head is read on every draft forward (the embedding is a lookup)
        self.params_per_forward = _nparams(model) + model.config.hidden_size * model.config.vocab_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.last_logits: torch.Tensor | None = None  # (B, depth, V) of the latest proposal (tests read it)

    def draft_modules(self):
        return (_first_layer(self.model),)

    # -- state
    def start(self, prompts, feats):
        B = len(prompts)
        self.cache = self.model.new_cache()
        self.ctx_valid = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        self.ctx_pos = torch.zeros(B, 0, dtype=torch.long, device=self.device)
        self.fed = [0] * B  # context positions in the cache per row (0 .. fed-1)
        self.pending = [feats.hidden_aux[b, : len(p) - 1] for b, p in enumerate(prompts)]

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.pending[row] = torch.cat([self.pending[row], hidden_aux.to(self.pending[row].device)])

    def _feed(self, active) -> None:
        """Append every active row's newly committed positions to the context cache, in one forward."""
        B = len(active)
        lens = [len(self.pending[b]) if active[b] else 0 for b in range(B)]
        q = max(lens, default=0)
        if q == 0:
            return
        x = torch.zeros(B, q, self.pending[0].shape[-1], dtype=self.pending[0].dtype, device=self.device)
        valid = torch.zeros(B, q, dtype=torch.bool, device=self.device)
        pos = torch.tensor(self.fed, device=self.device)[:, None] + torch.arange(q, device=self.device)
        for b, n in enumerate(lens):
            if n:
                x[b, :n] = self.pending[b].to(self.device)
                valid[b, :n] = True
                self.pending[b] = self.pending[b][:0]
                self.fed[b] += n
        self.model.extend_context(self.cache, self.model.fuse(x), pos)
        self.ctx_valid = torch.cat([self.ctx_valid, valid], 1)
        self.ctx_pos = torch.cat([self.ctx_pos, pos], 1)
        self._squeeze()

    def _squeeze(self) -> None:
        """Drop the holes once they outnumber the entries: each row's entries first, in order."""
        S, keep = self.ctx_valid.shape[1], int(self.ctx_valid.sum(1).max())
        if S <= 2 * keep + self.squeeze_slack:
            return
        order = torch.sort((~self.ctx_valid).to(torch.uint8), dim=1, stable=True).indices[:, :keep]
        self.cache.select(order)
        self.ctx_valid, self.ctx_pos = self.ctx_valid.gather(1, order), self.ctx_pos.gather(1, order)

    def block_mask(self, anchor_pos: torch.Tensor) -> torch.Tensor:
        """(B, block, S + block) bool: the valid context before each row's anchor, and the whole block."""
        B, bs = len(anchor_pos), self.block
        ctx = self.ctx_valid & (self.ctx_pos < anchor_pos[:, None])
        own = torch.ones(B, bs, bs, dtype=torch.bool, device=self.device)
        return torch.cat([ctx[:, None, :].expand(B, bs, -1), own], 2)

    @torch.no_grad()
    def block_logits(self, seqs, active) -> torch.Tensor:
        """(B, depth, V) logits of slots 1..depth of every row's block (the context fed first)."""
        return self.model.logits(self.block_states(seqs, active)[:, 1: 1 + self.depth]).double()

    @torch.no_grad()
    def block_states(self, seqs, active) -> torch.Tensor:
        """(B, block, H) pre-norm states of every row's block, anchored at its last token (the context fed first)."""
        self._feed(active)
        B = len(seqs)
        anchor_at = [len(s) - 1 for s in seqs]
        for b in range(B):
            if active[b] and self.fed[b] != anchor_at[b]:
                raise RuntimeError(f"DFlash row {b}: the context holds {self.fed[b]} positions but the anchor sits "
                                   f"at {anchor_at[b]} (observe() missed committed positions)")
        p = torch.tensor(anchor_at, device=self.device)
        anchors = torch.tensor([s[-1] for s in seqs], device=self.device)
        block = self.model.block_inputs(anchors)
        pos = p[:, None] + torch.arange(self.block, device=self.device)
        return self.model.decode(block, pos, self.cache if len(self.cache) else None, self.block_mask(p))

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        logits = self.last_logits = self.block_logits(seqs, active)
        if self.shape.kind == "chain":
            trees = self._chains(logits, temperature, generator)
        elif self.shape.kind == "dynamic":
            logp = torch.log_softmax(logits, -1)
            level = iter(range(1, self.depth))
            def expand(nodes, tokens, parents):  # depth j's candidates: slot j's, whatever the parent
                j = next(level)
                return logp[:, j, None].expand(-1, max(len(n) for n in nodes), -1)
            trees = dynamic_trees(logp[:, 0], expand, self.depth, self.shape.topk, self.shape.total_tokens)
        else:
            ranks = 1 + max(max(c) for c in self.shape.choices)
            top = logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices.cpu()
            trees = [static_tree(top[b], self.shape.choices) for b in range(len(seqs))]
        return [t if a else DraftTree.empty() for t, a in zip(trees, active)]

    def draw(self, logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, k, V) logits -> tokens (B, k) and the distribution each was drawn from (None at T = 0)."""
        if temperature <= 0:
            return logits.argmax(-1).cpu(), None
        q = probs(logits, temperature).cpu()
        toks = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:2])
        return toks, q

    def _chains(self, logits, temperature, generator) -> list[DraftTree]:
        toks, q = self.draw(logits[:, : self.shape.k], temperature, generator)
        return [DraftTree.chain(toks[b].tolist(), None if q is None else q[b]) for b in range(len(toks))]


# ------------------------------------------------------------------ the families' builders (specheads/families.py)


def medusa_drafter(heads, target, spec) -> MedusaDrafter:
    """Medusa heads (loaded, unattached) on ``target``'s device, drafting ``spec.shape`` (a static tree's choices
    already chosen: the evaluator's ``build_drafter``)."""
    heads = heads.to(target.device).eval()
    pack_like(heads, target.model)
    return MedusaDrafter(heads, spec.shape)


def eagle_drafter(model, target, spec) -> EagleDrafter:
    """An EAGLE-1 or EAGLE-3 head (``spec.drafter``) attached to ``target``."""
    model = model.to(target.device).eval().attach(target)
    pack_like(model, target.model)
    return EagleDrafter(model, spec.shape, spec.drafter)


def dflash_drafter(model, target, spec) -> DFlashDrafter:
    """A DFlash head attached to ``target``, in the target's dtype (its embedding and LM head are the target's)."""
    model = model.to(target.device, target.dtype).eval().attach(target)
    pack_like(model, target.model)
    return DFlashDrafter(model, spec.shape)


def _to_target_vocab(q: torch.Tensor, d2t_full: torch.Tensor, V_t: int) -> torch.Tensor:
    """(B, V_d) draft-vocabulary probabilities -> (B, V_t)."""
    if q.shape[-1] == V_t and bool((d2t_full == torch.arange(V_t)).all()):
        return q
    out = torch.zeros(q.shape[0], V_t, dtype=q.dtype)
    out[:, d2t_full] = q
    return out


def _row(t: torch.Tensor | None, b: int):
    return None if t is None else t[b]
