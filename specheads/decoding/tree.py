"""Draft trees: the data structure, static (Medusa) trees, and dynamic EAGLE-2 trees.

A ``DraftTree`` holds n draft nodes in topological order. Node ``i`` has token ``tokens[i]`` and
parent ``parents[i]`` (an earlier node, or ``-1`` for the *root*: the pending last token of the
sequence, which the verifier feeds first). Siblings carry distinct tokens. For sampled chains,
``q[i]`` (V,) is the draft distribution ``tokens[i]`` was drawn from (needed by the p/q test).

A drafter may also ask for ``m`` *extra* nodes (``extra_tokens``, ``extra_parents``) in the same
target forward: fed after the n draft nodes, never verified, never committed; their parents index
the combined list (draft nodes 0..n-1, then extras n..n+m-1; -1 = the root). Lookahead decoding's
Jacobi window rides along this way (``lookahead.py``); the drafter reads their logits back through
``Drafter.observe_forward``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class DraftTree:
    """tokens (n,) long; parents (n,) long; q (n, V) float or None (chains sampled from q)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    extra_tokens: torch.Tensor | None = None
    extra_parents: torch.Tensor | None = None

    def __post_init__(self):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError(f"DraftTree: tokens {tuple(self.tokens.shape)} and parents "
                             f"{tuple(self.parents.shape)} must be equal 1-D shapes")
        n = len(self.tokens)
        if n and (self.parents >= torch.arange(n)).any():
            raise ValueError("DraftTree: every parent must come before its child (topological order)")
        if (self.extra_tokens is None) != (self.extra_parents is None):
            raise ValueError("DraftTree: extra_tokens and extra_parents go together")
        if self.extra_tokens is not None:
            m = len(self.extra_tokens)
            if self.extra_tokens.shape != self.extra_parents.shape or self.extra_tokens.dim() != 1:
                raise ValueError("DraftTree: extra_tokens and extra_parents must be equal 1-D shapes")
            if m and ((self.extra_parents >= n + torch.arange(m)) | (self.extra_parents < -1)).any():
                raise ValueError("DraftTree: every extra node's parent must come before it")

    @property
    def fed(self) -> int:
        """Nodes fed to the target after the root: the n draft nodes plus the extra ones."""
        return self.size + (0 if self.extra_tokens is None else len(self.extra_tokens))

    def fed_tokens_parents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fed,) tokens and parents of draft nodes then extra nodes (parents index this list, -1 = root)."""
        if self.extra_tokens is None:
            return self.tokens, self.parents
        return torch.cat([self.tokens, self.extra_tokens]), torch.cat([self.parents, self.extra_parents])

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None) -> "DraftTree":
        n = len(tokens)
        return cls(torch.tensor(list(tokens), dtype=torch.long), torch.arange(n) - 1, q)

    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(self.size) - 1).all())

    def depths(self) -> torch.Tensor:
        """(n,) depth of each node; children of the root have depth 1."""
        d = torch.zeros(self.size, dtype=torch.long)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is ``node`` (``-1`` = the root)."""
        return torch.nonzero(self.parents == node).flatten().tolist()

    def graft_chain(self, chain: Sequence[int]) -> "DraftTree":
        """This tree with ``chain`` added as a path from the root, sharing the nodes it already has
        (the longest prefix of ``chain`` that is a path of the tree), so siblings stay distinct.

        Node order and indices of the existing nodes are kept; new nodes come after them. A tree
        that grows drops ``q`` (it is no longer a chain drafted from q: verify it with the
        target-only tree walk, which needs no draft probabilities); one that does not grow is
        returned as it is. Trees with extra (unverified) nodes cannot take a graft.
        """
        if self.extra_tokens is not None:
            raise ValueError("graft_chain: the tree carries extra nodes (lookahead); graft before adding them")
        toks, pars = self.tokens.tolist(), self.parents.tolist()
        kids: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(toks, pars))}
        node, grew = -1, False
        for t in map(int, chain):
            nxt = kids.get((node, t))
            if nxt is None:
                toks.append(t); pars.append(node)
                nxt = kids[(node, t)] = len(toks) - 1
                grew = True
            node = nxt
        if not grew:
            return self
        return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long))

    def check_distinct_siblings(self) -> None:
        seen: dict[tuple[int, int], int] = {}
        for i, (t, p) in enumerate(zip(self.tokens.tolist(), self.parents.tolist())):
            if (p, t) in seen:
                raise ValueError(f"DraftTree: nodes {seen[(p, t)]} and {i} are siblings with the same token {t}")
            seen[(p, t)] = i


# ------------------------------------------------------------------ static trees (Medusa)

def normalize_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Sort choices so parents come first; check every prefix of a choice is also a choice."""
    out = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    have = set(out)
    for c in out:
        if len(c) == 0 or any(i < 0 for i in c):
            raise ValueError(f"tree choice {c}: must be a non-empty tuple of top-k ranks >= 0")
        if len(c) > 1 and c[:-1] not in have:
            raise ValueError(f"tree choice {c} lacks its parent {c[:-1]} in the choices")
    return out


def chain_choices(k: int) -> list[tuple[int, ...]]:
    """The top-1 chain of k tokens as static choices."""
    return [(0,) * d for d in range(1, k + 1)]


def choices_from_accuracies(acc: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The ``num_nodes`` choices with the highest expected acceptance, as Medusa builds its trees.

    acc[d][r]: probability that the rank-r candidate of head d is the right token (measured).
    A choice's value is the product of its ranks' accuracies (the chance its whole path is
    accepted); the expected accepted length of a tree is the sum of its nodes' values, and the
    greedy pick keeps prefixes closed because a child is never worth more than its parent.
    """
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < num_nodes:
        neg, c = heapq.heappop(heap)
        out.append(c)
        d = len(c)
        if d < len(acc):
            for r in range(len(acc[d])):
                heapq.heappush(heap, (neg * acc[d][r], c + (r,)))
    return normalize_choices(out)


def static_tree(topk_tokens: torch.Tensor, choices: Sequence[tuple[int, ...]]) -> DraftTree:
    """Tree from per-depth ranked candidates. topk_tokens: (D, R) long, row d = head d's top-R ids."""
    index: dict[tuple[int, ...], int] = {}
    toks, pars = [], []
    for c in choices:
        d, r = len(c) - 1, c[-1]
        if d >= topk_tokens.shape[0] or r >= topk_tokens.shape[1]:
            raise ValueError(f"tree choice {c} needs head {d} rank {r}, have {tuple(topk_tokens.shape)}")
        index[c] = len(toks)
        toks.append(int(topk_tokens[d, r]))
        pars.append(index[c[:-1]] if d else -1)
    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long))


# ------------------------------------------------------------------ dynamic trees (EAGLE-2)

Expand = Callable[[list[list[int]], list[list[int]], list[list[int]]], torch.Tensor]
"""expand(nodes, tokens, parents) -> (B, m, V) draft log-probs after feeding, for each row, these
tree nodes (node ids as numbered by the builder; parents are earlier node ids, -1 = the root)."""


def dynamic_trees(root_logp: torch.Tensor, expand: Expand, depth: int, topk: int,
                  total_tokens: int) -> list[DraftTree]:
    """EAGLE-2 trees for B rows: grow ``depth`` levels, expanding the ``topk`` best nodes of each
    level (by path confidence = sum of draft log-probs along the path), then keep the
    ``total_tokens`` nodes of highest path confidence (closed under parents, since a child never
    scores above its parent).

    root_logp: (B, V) draft log-probs for the first draft position. ``expand`` is called once per
    level after the first: one draft forward per level for the whole batch.
    """
    if depth < 1 or topk < 1 or total_tokens < 1:
        raise ValueError(f"dynamic tree needs depth, topk, total_tokens >= 1 (got {depth}, {topk}, {total_tokens})")
    B = root_logp.shape[0]
    toks = [[] for _ in range(B)]
    pars = [[] for _ in range(B)]
    score = [[] for _ in range(B)]
    frontier = [[] for _ in range(B)]
    lp, ti = _host_topk(root_logp, topk)
    for b in range(B):
        for v, t in zip(lp[b], ti[b]):
            frontier[b].append(len(toks[b]))
            toks[b].append(t); pars[b].append(-1); score[b].append(v)
    for _ in range(depth - 1):
        logp = expand(frontier, [[toks[b][i] for i in frontier[b]] for b in range(B)],
                      [[pars[b][i] for i in frontier[b]] for b in range(B)])
        lp, ti = _host_topk(logp, topk)
        for b in range(B):
            cand = []
            for row, node in enumerate(frontier[b]):
                for v, t in zip(lp[b][row], ti[b][row]):
                    cand.append((score[b][node] + v, node, t))
            cand.sort(key=lambda x: -x[0])
            new_nodes = []
            for s_, node, t in cand:
                new_nodes.append(len(toks[b]))
                toks[b].append(t); pars[b].append(node); score[b].append(s_)
            frontier[b] = new_nodes[:topk]
    trees = []
    for b in range(B):
        keep = sorted(range(len(toks[b])), key=lambda i: (-score[b][i], i))[:total_tokens]
        trees.append(_subtree(toks[b], pars[b], keep))
    return trees


def _host_topk(logp: torch.Tensor, k: int) -> tuple[list, list]:
    """The ``k`` best log-probs and their ids along the last dim, as nested lists: one copy to the host for the
    whole batch (a copy per row would wait for the device once per row and level)."""
    lp, ti = logp.float().topk(k, dim=-1)
    both = torch.cat([lp.double(), ti.double()], -1).cpu()  # float32 values and ids < 2**53: exact in float64
    lp_h, ti_h = both[..., :k], both[..., k:]
    return lp_h.float().tolist(), ti_h.long().tolist()


def _subtree(toks: list[int], pars: list[int], keep: list[int]) -> DraftTree:
    """Renumber the kept nodes (closed under parents) in topological order."""
    kept = set(keep)
    for i in keep:
        if pars[i] >= 0 and pars[i] not in kept:
            raise RuntimeError("dynamic tree selection is not closed under parents")
    order = sorted(keep, key=lambda i: (_depth(pars, i), i))
    new = {old: j for j, old in enumerate(order)}
    return DraftTree(torch.tensor([toks[i] for i in order], dtype=torch.long),
                     torch.tensor([new[pars[i]] if pars[i] >= 0 else -1 for i in order], dtype=torch.long))


def _depth(pars: list[int], i: int) -> int:
    d = 1
    while pars[i] >= 0:
        i, d = pars[i], d + 1
    return d


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64; one-hot argmax at T = 0."""
    logits = logits.double()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return torch.softmax(logits / temperature, -1)


def draw_token(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of ``logits`` (B, V): the argmax at T = 0 (law None), else a sample of
    ``probs(logits, T)`` drawn on the CPU with ``generator``, returned with that law (B, V) float64 on the CPU, which
    the verifier's accept/reject rule needs."""
    if temperature <= 0:
        return logits.argmax(-1), None
    q = probs(logits, temperature).cpu()
    return torch.multinomial(q, 1, generator=generator)[:, 0].to(logits.device), q

