"""Suffix decoding (Oliaro, Jia, Campos, Qiao, NeurIPS 2025, arXiv 2411.04975): a training-free drafter that
copies what followed earlier occurrences of the sequence's latest tokens, weighing each continuation by how often
it was seen. vLLM serves it as ``speculative_config={"method": "suffix", ...}``.

Two suffix tries hold what it copies from (``SuffixTrie``):

* one per request, over its prompt and its output so far;
* one global trie over the outputs of requests, each added token by token while it is decoded (so a batch's rows
  read each other's), the oldest dropped past ``max_cached_requests`` (0 turns the global trie off). A request
  whose prompt equals an earlier request's prompt drops that request's output first: the evaluator decodes each
  prompt several times (warm-up, temperatures, timing repeats, the exact pass), and a draft read off the same
  prompt's earlier answer would measure memory of the answer, not drafting.

Each step, for every match length m = 1, 2, ... up to ``max_depth - 1`` (and the sequence's length), the node of
the sequence's last m tokens is looked up in a trie (a longer suffix matches only where every shorter one does, so
the search stops at the first miss). From there the draft follows the most frequent continuation: the chance of
each drafted token is the product, along its path, of count(child) / count(parent), and drafting stops below
``min_token_prob``, or at ``min(k, floor(m * spec_factor + spec_offset))`` tokens (a short match drafts little). A
draft's score is the sum of its tokens' chances; the best score over m wins (the longer match among equals), then
the better of the request's trie and the global one (the request's among equals). ``tree=False`` drafts a chain
(the most frequent child at each node: what vLLM drafts), ``tree=True`` a tree grown best first by chance (at most
``k`` nodes), as the paper does.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specheads.decoding.drafters import Drafter
from specheads.decoding.tree import DraftTree

ROOT = 0


@dataclass
class SuffixDraft:
    """A trie's draft: tokens in topological order, each one's parent (an earlier index, -1 = the sequence's last
    token), its estimated chance, their sum (``score``) and the match length it continues."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTrie:
    """The suffixes of several token sequences, each cut to ``max_depth`` tokens, in one trie with counts.

    A node stands for the string on its path from the root; ``count[node]`` is how many (sequence, start) pairs
    have that string at the start (its occurrences, the root: every start, i.e. every token). Sequences grow one
    token at a time (``append``): each of the at most ``max_depth`` windows still open at the sequence's end goes
    one node deeper, and a new window opens at the root. ``remove`` takes a whole sequence out again.
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"a suffix trie needs max_depth >= 2 (a match plus a draft token), got {max_depth}")
        self.max_depth = max_depth
        self.count: list[int] = [0]
        self.depth: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.free: list[int] = []
        self.seqs: dict[int, list[int]] = {}
        self.open: dict[int, list[int]] = {}  # sequence -> nodes where its open windows end (shallower than max_depth)

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self.count) - len(self.free)

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(seq_id, int(t))

    def append(self, seq_id: int, token: int) -> None:
        self.seqs.setdefault(seq_id, []).append(token)
        windows = self.open.get(seq_id, []) + [ROOT]
        self.count[ROOT] += 1
        still_open = []
        for node in windows:
            child = self.children[node].get(token)
            if child is None:
                child = self._new_node(node, token)
            self.count[child] += 1
            if self.depth[child] < self.max_depth:
                still_open.append(child)
        self.open[seq_id] = still_open

    def remove(self, seq_id: int) -> None:
        """Take sequence ``seq_id`` out: every window of it loses one count along its path; nodes left at zero go."""
        seq = self.seqs.pop(seq_id, [])
        self.open.pop(seq_id, None)
        for start in range(len(seq)):
            self.count[ROOT] -= 1
            node, dead = ROOT, []
            for t in seq[start:start + self.max_depth]:
                child = self.children[node][t]
                self.count[child] -= 1
                if self.count[child] == 0:
                    del self.children[node][t]
                    dead.append(child)
                node = child
            for n in dead:  # their own children were on this window's path: dead too
                self.children[n] = {}
                self.free.append(n)

    def _new_node(self, parent: int, token: int) -> int:
        if self.free:
            n = self.free.pop()
            self.count[n], self.depth[n] = 0, self.depth[parent] + 1
        else:
            n = len(self.count)
            self.count.append(0); self.depth.append(self.depth[parent] + 1); self.children.append({})
        self.children[parent][token] = n
        return n

    def node(self, tokens: Sequence[int]) -> int | None:
        """The node of string ``tokens``, None where it never occurred."""
        node = ROOT
        for t in tokens:
            node = self.children[node].get(int(t))
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], k: int, spec_factor: float = 1.0, spec_offset: float = 0.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> SuffixDraft:
        """The best draft after ``context`` over its match lengths (module docstring); empty when nothing matches."""
        best = SuffixDraft()
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            node = self.node(context[len(context) - m:])
            if node is None:
                break  # no longer suffix can occur either
            cap = max(0, min(k, int(m * spec_factor + spec_offset + 1e-9)))
            draft = self._tree(node, cap, min_token_prob) if tree else self._path(node, cap, min_token_prob)
            if draft.score >= best.score:
                best = draft
                best.match_len = m
        return best

    def _best_child(self, node: int) -> tuple[int, int] | None:
        """(token, child) of ``node``'s most frequent child (the smallest token among equals), None for a leaf."""
        kids = self.children[node]
        if not kids:
            return None
        token = min(kids, key=lambda t: (-self.count[kids[t]], t))
        return token, kids[token]

    def _path(self, node: int, cap: int, min_token_prob: float) -> SuffixDraft:
        out, p = SuffixDraft(), 1.0
        while len(out.tokens) < cap:
            best = self._best_child(node)
            if best is None:
                break
            token, child = best
            p *= self.count[child] / self.count[node]
            if p < min_token_prob:
                break
            out.parents.append(len(out.tokens) - 1)
            out.tokens.append(token); out.probs.append(p)
            out.score += p
            node = child
        return out

    def _tree(self, node: int, cap: int, min_token_prob: float) -> SuffixDraft:
        """Best first: the most likely node not yet drafted whose parent is drafted, until ``cap`` nodes."""
        out, heap, order = SuffixDraft(), [], 0

        def push(parent_node: int, parent_index: int, p_parent: float) -> None:
            nonlocal order
            kids = self.children[parent_node]
            for t in sorted(kids, key=lambda t: (-self.count[kids[t]], t)):
                p = p_parent * self.count[kids[t]] / self.count[parent_node]
                if p >= min_token_prob:
                    heapq.heappush(heap, (-p, order, t, kids[t], parent_index))
                    order += 1

        push(node, -1, 1.0)
        while heap and len(out.tokens) < cap:
            neg_p, _, token, child, parent = heapq.heappop(heap)
            out.tokens.append(token); out.parents.append(parent); out.probs.append(-neg_p)
            out.score += -neg_p
            push(child, len(out.tokens) - 1, -neg_p)
        return out


class SuffixDrafter(Drafter):
    """Suffix decoding over a per-request trie and a global trie of outputs (module docstring), batched over rows.

    k: the most tokens a step drafts (vLLM's ``num_speculative_tokens``); max_depth: the tries' depth, which caps
    a match plus its draft (``suffix_decoding_max_tree_depth``); spec_factor, spec_offset: a match of m tokens
    drafts at most ``floor(m * spec_factor + spec_offset)`` (``suffix_decoding_max_spec_factor``); min_token_prob:
    the least estimated chance a drafted token may have (``suffix_decoding_min_token_prob``);
    max_cached_requests: the outputs the global trie keeps, oldest dropped first (0: no global trie, -1: no
    limit; ``suffix_decoding_max_cached_requests``); tree: draft a tree of at most k nodes instead of a chain.
    """

    name = "suffix"

    def __init__(self, k: int = 24, max_depth: int = 24, spec_factor: float = 1.0, spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 10000, tree: bool = False):
        if k < 1 or max_depth < 2 or spec_factor < 0 or not 0 <= min_token_prob <= 1 or max_cached_requests < -1:
            raise ValueError(f"suffix decoding needs k >= 1, max_depth >= 2, spec_factor >= 0, 0 <= min_token_prob "
                             f"<= 1 and max_cached_requests >= -1 (-1: no limit); got k={k}, max_depth={max_depth}, "
                             f"spec_factor={spec_factor}, min_token_prob={min_token_prob}, "
                             f"max_cached_requests={max_cached_requests}")
        self.k, self.max_depth, self.tree = k, max_depth, tree
        self.spec_factor, self.spec_offset, self.min_token_prob = spec_factor, spec_offset, min_token_prob
        self.max_cached_requests = max_cached_requests
        self.outputs = SuffixTrie(max_depth)  # the global trie: outputs of requests, by request id
        self.cached: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # request id -> its prompt, oldest first
        self.next_id = 0
        self.local: list[SuffixTrie] = []
        self.ids: list[int] = []

    def label(self) -> str:
        return f"suffix({'tree' if self.tree else 'chain'}{self.k},d{self.max_depth})"

    def vllm_speculative_config(self) -> dict:
        """vLLM's ``speculative_config`` that drafts as this drafter does (its V1 runner, through
        ``arctic-inference``); vLLM drafts chains with no offset, so a tree or an offset has none."""
        if self.tree or self.spec_offset:
            raise ValueError("vLLM's suffix method drafts a chain with no offset: no serve line for tree=True or "
                             f"spec_offset={self.spec_offset}")
        return {"method": "suffix", "num_speculative_tokens": self.k,
                "suffix_decoding_max_tree_depth": self.max_depth,
                "suffix_decoding_max_spec_factor": self.spec_factor,
                "suffix_decoding_min_token_prob": self.min_token_prob,
                "suffix_decoding_max_cached_requests": self.max_cached_requests}

    def serve_line(self, target: str) -> str:
        """The command that serves ``target`` with vLLM drafting as this drafter does."""
        return f"vllm serve {target} --speculative-config '{json.dumps(self.vllm_speculative_config())}'"

    def start(self, prompts, feats) -> None:
        """New requests: a trie of each prompt; earlier outputs of these same prompts leave the global trie."""
        self.batch_size = len(prompts)
        keys = [tuple(int(t) for t in p) for p in prompts]
        repeated = set(keys)
        for rid in [r for r, key in self.cached.items() if key in repeated]:
            self._evict(rid)
        self.local, self.ids = [], []
        for key in keys:
            trie = SuffixTrie(self.max_depth)
            trie.extend(0, key)
            self.local.append(trie)
            self.ids.append(self.next_id)
            if self.max_cached_requests != 0:
                self.cached[self.next_id] = key
            self.next_id += 1
        while self.max_cached_requests > 0 and len(self.cached) > self.max_cached_requests:
            self._evict(next(iter(self.cached)))

    def _evict(self, rid: int) -> None:
        del self.cached[rid]
        self.outputs.remove(rid)

    def observe(self, row, tokens, hidden_last, hidden_aux) -> None:
        self._extend(row, tokens)

    def _extend(self, row: int, tokens: Sequence[int]) -> None:
        self.local[row].extend(0, tokens)
        if self.ids[row] in self.cached:  # its output may have been dropped already (oldest first)
            self.outputs.extend(self.ids[row], tokens)

    def speculate(self, row: int, seq: Sequence[int]) -> SuffixDraft:
        """Row ``row``'s draft after ``seq``: the request's trie's, or the global trie's where it scores higher."""
        context = list(seq[-self.max_depth:])
        args = (self.k, self.spec_factor, self.spec_offset, self.min_token_prob, self.tree)
        draft = self.local[row].speculate(context, *args)
        if self.max_cached_requests != 0:
            other = self.outputs.speculate(context, *args)
            if other.score > draft.score:
                draft = other
        return draft

    def propose(self, seqs, active, temperature, generator) -> list[DraftTree]:
        out = []
        for b, s in enumerate(seqs):
            if not active[b]:
                out.append(DraftTree.empty())
                continue
            known = len(self.local[b].seqs.get(0, ()))
            if len(s) > known:  # a caller that does not report its steps through observe()
                self._extend(b, [int(t) for t in s[known:]])
            out.append(self._draft_tree(self.speculate(b, s), s))
        return out

    def _draft_tree(self, draft: SuffixDraft, seq: Sequence[int]) -> DraftTree:
        """A chain carries one-hot q (a deterministic draft: the p/q test verifies it); a tree carries none (the
        target-only walk verifies it, lossless since a trie's siblings are distinct)."""
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        parents = torch.tensor(draft.parents, dtype=torch.long)
        if self.tree or not draft.tokens:
            return DraftTree(tokens, parents)
        q = torch.zeros(len(draft.tokens), 1 + max(max(seq), max(draft.tokens)), dtype=torch.float64)
        q[torch.arange(len(draft.tokens)), tokens] = 1.0
        return DraftTree(tokens, parents, q)
