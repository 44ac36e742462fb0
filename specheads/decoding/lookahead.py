"""Lookahead decoding (Fu et al., 2024): a training-free drafter that runs Jacobi iterations on the
target itself and verifies n-grams it collected, both in the target's ONE forward per step.

Each step feeds, after the pending token (the root), two branches:

* the **verification branch**: up to ``guesses`` (G) n-grams from the pool whose first token is the
  root, merged into a trie of candidates; this is the ``DraftTree`` the usual verifier checks
  (greedy identity; target-only tree sampling at T > 0, lossless for distinct siblings);
* the **lookahead branch**: a 2-D window of ``ngram - 1`` (N-1) levels by ``window`` (W) columns of
  guessed tokens, fed as extra nodes (``DraftTree.extra_*``) that are never verified or committed.
  Level 0 is a chain from the root (the current Jacobi guess of the next W tokens; its column 0
  *is* the root); for levels j >= 1, node (j, i) follows node (j-1, i) (node (0, 0) being the root),
  one position later. So column i is the trajectory ``level0[0..i], (1, i), ..., (j, i)``: each
  node sees the committed context, the level-0 guesses up to its column and its own column below
  it, which is the attention pattern of the paper's lookahead branch, expressed as a tree.

After the forward, the target's outputs at the last level (one per column, greedy at T = 0, sampled
at T > 0) become the newest level; the oldest level drops out, and each column yields one n-gram
``(level0 token, (1, i), ..., (N-2, i), new token)``, stored in the pool under its first token
(most recent first, at most G per key). The window keeps its guesses across steps whatever was
accepted: they only ever steer what is proposed, never what is emitted.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from specheads.decoding.drafters import Drafter
from specheads.decoding.tree import DraftTree, probs


class NgramPool:
    """n-grams by first token: the ``capacity`` most recently seen continuations (N-1 tokens each)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        if self.capacity <= 0 or len(ngram) < 2:
            return
        slot = self.by_first.setdefault(ngram[0], OrderedDict())
        slot.pop(ngram[1:], None)
        slot[ngram[1:]] = None
        while len(slot) > self.capacity:
            slot.popitem(last=False)

    def lookup(self, first: int) -> list[tuple[int, ...]]:
        """Continuations of ``first``, most recent first."""
        return list(reversed(self.by_first.get(first, {})))

    def __len__(self) -> int:
        return sum(len(s) for s in self.by_first.values())


def trie(continuations: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of ``continuations`` hanging from the root (-1); siblings distinct."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for cont in continuations:
        node = -1
        for t in cont:
            key = (node, int(t))
            if key not in child:
                child[key] = len(tokens)
                tokens.append(int(t))
                parents.append(node)
            node = child[key]
    return tokens, parents


class LookaheadDrafter(Drafter):
    """Lookahead decoding: window W, n-gram size N, up to G verified n-grams per step (batched rows)."""

    name = "lookahead"

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, seed: int = 0):
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError(f"lookahead needs window >= 1, ngram >= 2, guesses >= 0; got window={window}, "
                             f"ngram={ngram}, guesses={guesses}")
        self.W, self.N, self.G, self.seed = window, ngram, guesses, seed

    def label(self) -> str:
        return f"lookahead(W{self.W},N{self.N},G{self.G})"

    # ------------------------------------------------------------------ state per row
    def start(self, prompts, feats) -> None:
        self.batch_size = len(prompts)
        g = torch.Generator().manual_seed(self.seed)
        self.levels: list[list[list[int]]] = []  # row -> level j -> W guesses
        self.pools = [NgramPool(self.G) for _ in prompts]
        for p in prompts:  # initial guesses: tokens drawn from the prompt (as the paper does)
            src = torch.tensor(list(p), dtype=torch.long)
            pick = src[torch.randint(0, len(src), ((self.N - 1) * self.W,), generator=g)].tolist()
            self.levels.append([pick[j * self.W:(j + 1) * self.W] for j in range(self.N - 1)])
        self._layout: list[dict | None] = [None] * len(prompts)

    def _lookahead_nodes(self, b: int, root: int, n_cand: int) -> tuple[list[int], list[int], dict]:
        """Extra nodes of row b's window: tokens, parents (indices into candidates + extras, -1 = root)
        and where each (level, column) sits (root = -1)."""
        W, N, lv = self.W, self.N, self.levels[b]
        tokens: list[int] = []
        parents: list[int] = []
        at: dict[tuple[int, int], int] = {(0, 0): -1}
        for i in range(1, W):
            at[(0, i)] = n_cand + len(tokens)
            parents.append(at[(0, i - 1)])
            tokens.append(lv[0][i])
        for j in range(1, N - 1):
            for i in range(W):
                at[(j, i)] = n_cand + len(tokens)
                parents.append(at[(j - 1, i)])
                tokens.append(lv[j][i])
        return tokens, parents, {"at": at, "root": root, "n_cand": n_cand}

    def propose(self, seqs, active, temperature, generator) -> list[DraftTree]:
        out = []
        for b, s in enumerate(seqs):
            if not active[b]:
                self._layout[b] = None
                out.append(DraftTree.empty())
                continue
            root = int(s[-1])
            cand_tokens, cand_parents = trie(self.pools[b].lookup(root)[: self.G])
            n = len(cand_tokens)
            x_tokens, x_parents, layout = self._lookahead_nodes(b, root, n)
            self._layout[b] = layout
            out.append(DraftTree(torch.tensor(cand_tokens, dtype=torch.long), torch.tensor(cand_parents, dtype=torch.long),
                                 extra_tokens=torch.tensor(x_tokens, dtype=torch.long),
                                 extra_parents=torch.tensor(x_parents, dtype=torch.long)))
        self._temperature, self._generator = temperature, generator
        return out

    def observe_forward(self, row: int, logits: torch.Tensor, tree: DraftTree) -> None:
        """The target's logits for row ``row``'s fed nodes (root first, then candidates, then extras):
        one Jacobi update of the window and the n-grams it completes."""
        layout = self._layout[row]
        if layout is None:
            return
        W, N, lv, at = self.W, self.N, self.levels[row], layout["at"]
        last = N - 2
        idx = torch.tensor([1 + at[(last, i)] for i in range(W)], device=logits.device)  # root at index 0
        p = probs(logits.index_select(0, idx).double(), self._temperature).cpu()
        new = (torch.multinomial(p, 1, generator=self._generator)[:, 0] if self._temperature > 0
               else p.argmax(-1)).tolist()
        fed = [[layout["root"] if (j, i) == (0, 0) else lv[j][i] for i in range(W)] for j in range(N - 1)]
        for i in range(W):
            self.pools[row].add(tuple(fed[j][i] for j in range(N - 1)) + (int(new[i]),))
        self.levels[row] = lv[1:] + [[int(t) for t in new]]
