"""Drafters over trained heads: Medusa (static tree or chain) and EAGLE-1/3 (dynamic EAGLE-2
tree or chain). They read the target's features of committed positions (see ``drafters.py``).

Medusa: at the last committed position t (the pending token is ids[t+1], the target's own
prediction), head k proposes ids[t+k+2]; a static tree picks, per depth d, the ranks listed in
``choices`` from head d's top-k.

EAGLE: every committed position t gives the drafter (feature_t, ids[t+1]); its step predicts
the feature at t+1 and logits for ids[t+2]. Drafted nodes feed their parent's predicted feature
back. The drafter's own KV cache follows the same committed/scratch discipline as the target's
(``TreeSlots``); draft entries are discarded after each proposal, so accepted positions are
re-fed with the target's real features.
"""

from __future__ import annotations

import torch

from specheads.decoding.drafters import Drafter, TreeShape
from specheads.decoding.slots import TreeSlots
from specheads.decoding.tree import DraftTree, dynamic_trees, probs, static_tree


def _nparams(module) -> int:
    return sum(p.numel() for p in module.parameters())


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

    def start(self, prompts, feats):
        self.last = [feats.hidden_last[b, len(p) - 2] for b, p in enumerate(prompts)]

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.last[row] = hidden_last[-1]

    @torch.no_grad()
    def propose(self, seqs, active, temperature, generator):
        dtype = next(self.heads.parameters()).dtype
        h = torch.stack(self.last).to(dtype)[:, None]  # (B, 1, H)
        logits = self.heads(h)[:, :, 0].double()  # (K, B, V)
        out = []
        for b in range(len(seqs)):
            if not active[b]:
                out.append(DraftTree.empty())
            elif self.shape.kind == "chain":
                out.append(self._chain(logits[: self.shape.k, b], temperature, generator))
            else:
                ranks = 1 + max(c[-1] for c in self.shape.choices)
                top = logits[:, b].topk(ranks, dim=-1).indices
                tree = static_tree(top, self.shape.choices)
                tree.draft_forwards = 1
                out.append(tree)
        return out

    @staticmethod
    def _chain(logits, temperature, generator) -> DraftTree:
        q = probs(logits, temperature).cpu()
        toks = torch.multinomial(q, 1, generator=generator)[:, 0] if temperature > 0 else q.argmax(-1)
        return DraftTree.chain(toks.tolist(), q, draft_forwards=1)


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
        self.pending_h = [self._feature(_row(feats.hidden_last, b), _row(feats.hidden_aux, b))[: len(p) - 1]
                          for b, p in enumerate(prompts)]
        self.pending_ids = [list(p[1:]) for p in prompts]

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.pending_h[row] = torch.cat([self.pending_h[row], self._feature(hidden_last, hidden_aux)])
        self.pending_ids[row] = self.pending_ids[row] + list(tokens)

    def _step(self, hidden, ids, parents, live):
        pos, mask = self.slots.extend(parents, live)
        return self.model.step(hidden, ids, pos, mask, self.cache)

    def _feed_pending(self, active) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's new (feature, next token) pairs; return root h_out (B, H) and logits (B, V_d)."""
        B = len(active)
        lens = torch.tensor([len(self.pending_ids[b]) if active[b] else 0 for b in range(B)])
        q = int(lens.max())
        H = self.pending_h[0].shape[-1]
        hid = torch.zeros(B, q, H, dtype=self.dtype, device=self.device)
        ids = torch.zeros(B, q, dtype=torch.long, device=self.device)
        for b in range(B):
            n = int(lens[b])
            if n:
                hid[b, :n] = self.pending_h[b][-n:]
                ids[b, :n] = torch.tensor(self.pending_ids[b][-n:], dtype=torch.long)
                self.pending_h[b], self.pending_ids[b] = self.pending_h[b][:0], []
        par, live = self.slots.chain_parents(lens, q)
        h_out, logits = self._step(hid, ids, par, live)
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
            for t in trees:
                t.tokens = self.model.to_target_ids(t.tokens.to(self.device)).cpu()
        self.cache.crop(len(self.cache) - self.slots.discard())
        return [t if a else DraftTree.empty() for t, a in zip(trees, active)]

    def _expand(self, nodes, tokens, parents) -> torch.Tensor:
        B, m = len(nodes), max(len(n) for n in nodes)
        s = self.slots.scratch
        hid = torch.zeros(B, m, self._h[(0, -1)].shape[-1], dtype=self.dtype, device=self.device)
        par = torch.full((B, m), -1, dtype=torch.long, device=self.device)
        ids = torch.zeros(B, m, dtype=torch.long, device=self.device)
        for b in range(B):
            for j, (n, t, p) in enumerate(zip(nodes[b], tokens[b], parents[b])):
                hid[b, j] = self._h[(b, p)]
                par[b, j] = self._slot[b][p] if p >= 0 else -1
                ids[b, j] = t
                self._slot[b][n] = s + j
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
        return [DraftTree.chain(T[b].tolist(), None if Q is None else Q[b], draft_forwards=k) for b in range(B)]


def _to_target_vocab(q: torch.Tensor, d2t_full: torch.Tensor, V_t: int) -> torch.Tensor:
    """(B, V_d) draft-vocabulary probabilities -> (B, V_t)."""
    if q.shape[-1] == V_t and bool((d2t_full == torch.arange(V_t)).all()):
        return q
    out = torch.zeros(q.shape[0], V_t, dtype=q.dtype)
    out[:, d2t_full] = q
    return out


def _row(t: torch.Tensor | None, b: int):
    return None if t is None else t[b]
