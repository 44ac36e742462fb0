"""Verification of one draft tree against the target: exact PyTorch references.

Every function takes the target's logits for the root and the n nodes, ``logits (n+1, V)``
(row 0 = after the root, row i+1 = after node i), and the ``DraftTree``; it returns a
``Verdict``: the accepted node indices (a root-to-leaf path), the bonus token the target adds
after the last accepted node, and ``tested``/``accepted`` flags per draft depth (for α).

- ``verify_greedy``: longest path whose tokens equal the target's argmax (lossless at T = 0).
- ``verify_chain_sampling``: Leviathan et al. / Chen et al. speculative sampling for a chain
  drafted from q: accept with min(1, p/q), else resample from norm(max(0, p - q)); bonus from p.
- ``verify_tree_sampling``: target-only walk: one draw x ~ p per visited node; move to the child
  whose token is x, else emit a draw from p with the (rejected) children removed. Lossless for
  any tree with distinct siblings, no draft probabilities needed.
- ``verify_typical``: Medusa's typical acceptance (p(x) > min(eps, delta * exp(-H(p)))). LOSSY.

``specheads.kernels`` may hold fused GPU versions with the same signatures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.decoding.tree import DraftTree, probs

LOSSLESS = {"greedy": True, "chain": True, "tree": True, "typical": False}


@dataclass
class Verdict:
    """path: accepted node indices; bonus: the target's extra token; per-depth α counts."""

    path: list[int]
    bonus: int
    tested: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def tokens_emitted(self) -> int:
        return len(self.path) + 1


def _record(v: Verdict, depth: int, ok: bool) -> None:
    while len(v.tested) < depth:
        v.tested.append(0); v.accepted.append(0)
    v.tested[depth - 1] += 1
    v.accepted[depth - 1] += int(ok)


def _check(logits: torch.Tensor, tree: DraftTree) -> None:
    if logits.dim() != 2 or logits.shape[0] != tree.size + 1:
        raise ValueError(f"verify: logits {tuple(logits.shape)} must be (n+1, V) for a tree of {tree.size} nodes")


def verify_greedy(logits: torch.Tensor, tree: DraftTree) -> Verdict:
    """Follow the target's argmax down the tree."""
    _check(logits, tree)
    best = logits.argmax(-1).tolist()
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    v = Verdict([], 0)
    node, depth = -1, 0
    while True:
        kids = [i for i in range(tree.size) if pars[i] == node]
        want = best[node + 1]
        if not kids:
            v.bonus = want
            return v
        depth += 1
        hit = next((i for i in kids if toks[i] == want), None)
        _record(v, depth, hit is not None)
        if hit is None:
            v.bonus = want
            return v
        v.path.append(hit)
        node = hit


def verify_chain_sampling(logits: torch.Tensor, tree: DraftTree, temperature: float,
                          generator: torch.Generator | None = None) -> Verdict:
    """p/q speculative sampling for a chain whose token i was drawn from ``tree.q[i]``."""
    _check(logits, tree)
    if not tree.is_chain() or (tree.size and tree.q is None):
        raise ValueError("verify_chain_sampling needs a chain with draft probabilities q")
    if temperature <= 0:
        return verify_greedy(logits, tree)
    p_all = probs(logits, temperature).cpu()  # small; draws use a CPU generator
    qs = _pad_vocab(tree.q.double().cpu(), p_all.shape[-1]) if tree.size else None
    v = Verdict([], 0)
    for i, x in enumerate(tree.tokens.tolist()):
        p, q = p_all[i], qs[i]
        ratio = p[x] / q[x] if q[x] > 0 else torch.tensor(0.0)
        ok = bool(torch.rand((), generator=generator, dtype=torch.float64) < ratio)
        _record(v, i + 1, ok)
        if not ok:
            v.bonus = _draw(_residual(p, q), generator)
            return v
        v.path.append(i)
    v.bonus = _draw(p_all[tree.size], generator)
    return v


def _pad_vocab(q: torch.Tensor, V: int) -> torch.Tensor:
    """Draft probabilities may cover only the first ids (e.g. one-hot n-gram drafts): zero-pad to V."""
    if q.shape[-1] > V:
        raise ValueError(f"draft distribution over {q.shape[-1]} ids, target vocabulary has {V}")
    return torch.nn.functional.pad(q, (0, V - q.shape[-1])) if q.shape[-1] < V else q


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    s = r.sum()
    return r / s if s > 0 else p


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def verify_tree_sampling(logits: torch.Tensor, tree: DraftTree, temperature: float,
                         generator: torch.Generator | None = None) -> Verdict:
    """Target-only walk (lossless for distinct siblings); greedy at temperature 0."""
    _check(logits, tree)
    if temperature <= 0:
        return verify_greedy(logits, tree)
    p_all = probs(logits, temperature).cpu()  # small; draws use a CPU generator
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    v = Verdict([], 0)
    node, depth = -1, 0
    while True:
        p = p_all[node + 1]
        kids = [i for i in range(tree.size) if pars[i] == node]
        if not kids:
            v.bonus = _draw(p, generator)
            return v
        depth += 1
        x = _draw(p, generator)
        hit = next((i for i in kids if toks[i] == x), None)
        _record(v, depth, hit is not None)
        if hit is None:
            rest = p.clone()
            rest[[toks[i] for i in kids]] = 0
            v.bonus = _draw(rest / rest.sum(), generator) if rest.sum() > 0 else x
            return v
        v.path.append(hit)
        node = hit


def verify_typical(logits: torch.Tensor, tree: DraftTree, temperature: float,
                   generator: torch.Generator | None = None, eps: float = 0.09,
                   delta: float = 0.3) -> Verdict:
    """Medusa typical acceptance: longest path whose every token is 'typical' under p. LOSSY."""
    _check(logits, tree)
    if temperature <= 0:
        return verify_greedy(logits, tree)
    p_all = probs(logits, temperature).cpu()  # small; draws use a CPU generator
    ent = -(p_all * torch.log(p_all.clamp_min(1e-30))).sum(-1)
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    ok = [bool(p_all[pars[i] + 1, toks[i]] > thresh[pars[i] + 1]) for i in range(tree.size)]
    best: list[int] = []
    for i in range(tree.size):
        path, j = [], i
        while j >= 0 and ok[j]:
            path.append(j); j = pars[j]
        if j < 0 and len(path) > len(best):
            best = path[::-1]
    v = Verdict(best, 0)
    for d in range(1, len(best) + 2):
        parent = best[d - 2] if d >= 2 else -1
        if any(pars[i] == parent for i in range(tree.size)):
            _record(v, d, d <= len(best))
    last = best[-1] if best else -1
    v.bonus = _draw(p_all[last + 1], generator)
    return v


def verify(method: str, logits: torch.Tensor, tree: DraftTree, temperature: float,
           generator: torch.Generator | None = None) -> Verdict:
    """Dispatch by name: greedy | chain | tree | typical | auto (chain p/q when q is there, else tree)."""
    if temperature <= 0 or method == "greedy":
        return verify_greedy(logits, tree)
    if method == "auto":
        method = "chain" if tree.is_chain() and tree.q is not None else "tree"
    if method == "chain":
        return verify_chain_sampling(logits, tree, temperature, generator)
    if method == "tree":
        return verify_tree_sampling(logits, tree, temperature, generator)
    if method == "typical":
        return verify_typical(logits, tree, temperature, generator)
    raise ValueError(f"unknown verification method '{method}' (greedy, chain, tree, typical, auto)")
