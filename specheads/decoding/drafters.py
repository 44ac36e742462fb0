"""Drafters without training: none (plain decoding), n-gram prompt lookup, a second model
(any smaller model sharing the tokenizer), and the target's own first layers (early exit); and the
prompt lookup as one more branch of any other drafter's tree (``PromptLookupBranch``).

A drafter sees the committed sequences and the target features of committed positions:
``start(prompts, feats)`` after prefill, ``observe(row, new_tokens, hidden_last, hidden_aux)``
after each step (features of the newly committed positions, each paired with the token that
follows it), and ``propose(seqs, active, temperature, generator) -> list[DraftTree]`` whose roots
are each sequence's last token. Head drafters (Medusa, EAGLE) live in ``head_drafters.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from specheads.decoding.ngram_table import NgramTable
from specheads.decoding.runner import ForwardOutput, TargetRunner
from specheads.decoding.tree import DraftTree, dynamic_trees, probs


@dataclass
class TreeShape:
    """How a drafter spends its budget: a chain of ``k`` tokens, or an EAGLE-2 dynamic tree."""

    kind: str = "chain"  # chain | dynamic | static
    k: int = 4  # chain length
    depth: int = 5
    topk: int = 4
    total_tokens: int = 24
    choices: tuple[tuple[int, ...], ...] | None = None  # static trees (Medusa)

    def __post_init__(self):
        if self.kind not in ("chain", "dynamic", "static"):
            raise ValueError(f"tree kind '{self.kind}': use chain, dynamic or static")
        if self.kind == "chain" and self.k < 1:
            raise ValueError(f"chain length k must be >= 1, got {self.k}")

    @classmethod
    def fan(cls, width: int) -> "TreeShape":
        """The ``width`` best drafts of one draft forward, all children of the root, verified together."""
        return cls("dynamic", depth=1, topk=width, total_tokens=width)

    def label(self) -> str:
        if self.kind == "chain":
            return f"chain{self.k}"
        if self.kind == "dynamic":
            return f"tree(d{self.depth},k{self.topk},n{self.total_tokens})"
        return f"static({len(self.choices or ())})"


class Drafter:
    """Base class: drafts nothing. Subclasses override ``propose`` (and the feature hooks)."""

    name = "none"
    aux_layers: tuple[int, ...] = ()
    needs_features = False  # observe() gets target hidden states only when True
    params_per_forward = 0  # parameters read per draft forward (for the GPU cost model)

    def start(self, prompts: list[list[int]], feats: ForwardOutput) -> None:
        self.batch_size = len(prompts)

    def observe(self, row: int, tokens: list[int], hidden_last, hidden_aux) -> None:
        pass

    def observe_forward(self, row: int, logits: torch.Tensor, tree: DraftTree) -> None:
        """The verification forward's logits for ``row`` (root, the tree's nodes, then its extra nodes),
        before anything is committed; drafters that feed extra nodes (lookahead) read them here."""

    def propose(self, seqs: list[list[int]], active: list[bool], temperature: float,
                generator: torch.Generator | None) -> list[DraftTree]:
        return [DraftTree.empty() for _ in seqs]

    def draft_modules(self) -> tuple[nn.Module, ...]:
        """The modules one call of which is one draft forward (a pass of the draft network): the decoding loop counts
        their calls (``generate.ForwardCounter``), so the draft forwards it reports are the ones that ran. None for
        a drafter that runs no network (prompt lookup, lookahead: the target's own forward drafts)."""
        return ()


NoDrafter = Drafter


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose the k tokens that followed it."""

    name = "ngram"

    def __init__(self, k: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def lookup(self, seq: Sequence[int]) -> list[int]:
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = list(seq[L - n:])
            for start in range(L - n - 1, -1, -1):
                if list(seq[start:start + n]) == tail:
                    return list(seq[start + n: start + n + self.k])
        return []

    def propose(self, seqs, active, temperature, generator):
        out = []
        for b, s in enumerate(seqs):
            toks = self.lookup(s) if active[b] else []
            V = 1 + max(max(s), max(toks, default=0))
            q = torch.zeros(len(toks), V, dtype=torch.float64)  # deterministic draft: one-hot q
            q[torch.arange(len(toks)), torch.tensor(toks, dtype=torch.long)] = 1.0
            out.append(DraftTree.chain(toks, q if toks else None))
        return out


class PromptLookupBranch(Drafter):
    """Any drafter's tree plus one more branch: the n-gram prompt lookup's chain (``NgramDrafter``),
    grafted from the root so it shares the nodes the tree already has (``DraftTree.graft_chain``).

    The two draft from different evidence: a trained head predicts the next token from the target's
    features, the lookup copies spans that already occur in the prompt or the output (code,
    extraction, quoting); one target forward verifies both. The lookup costs no draft forward. A
    tree that grew carries no draft probabilities, so sampling verifies it with the target-only
    walk (lossless for any tree with distinct siblings). Trees with extra nodes (lookahead) are
    not accepted: their drafter reads the extra nodes' logits by position.

    With ``extend`` > 0, the inner tree's first ``extend`` root children (its best first drafts, in
    the tree's order) are each continued by up to ``extend_len`` tokens: the prompt lookup's
    continuation of the sequence plus that draft (n-grams of at least 2 tokens), else the chain of
    ``table`` (``NgramTable``, a corpus's most frequent next tokens), else nothing. A head whose
    second draft forward is rarely right (a one-step head) gets depth for no draft forward.
    """

    def __init__(self, inner: Drafter, k: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 table: NgramTable | None = None, extend: int = 0, extend_len: int = 2):
        if isinstance(inner, (NgramDrafter, PromptLookupBranch)):
            raise ValueError("a prompt-lookup branch goes on a drafter other than the n-gram lookup itself")
        if k < 1:
            raise ValueError(f"the prompt-lookup branch needs k >= 1 tokens, got {k}")
        if extend < 0 or (extend and extend_len < 1):
            raise ValueError(f"extend ({extend}) must be >= 0 and extend_len ({extend_len}) >= 1 when extending")
        self.inner, self.lookup = inner, NgramDrafter(k, max_ngram, min_ngram)
        self.table, self.extend = table, extend
        self.continuation = NgramDrafter(extend_len, max_ngram, min(2, max_ngram))
        self.name = f"{inner.name}+ngram{k}" + (f"+x{extend}" if extend else "")
        self.aux_layers, self.needs_features = inner.aux_layers, inner.needs_features
        self.params_per_forward = inner.params_per_forward

    def start(self, prompts, feats):
        self.inner.start(prompts, feats)

    def draft_modules(self):
        return self.inner.draft_modules()  # the lookup runs no network

    def observe(self, row, tokens, hidden_last, hidden_aux):
        self.inner.observe(row, tokens, hidden_last, hidden_aux)

    def propose(self, seqs, active, temperature, generator):
        trees = self.inner.propose(seqs, active, temperature, generator)
        out = []
        for t, s, a in zip(trees, seqs, active):
            if a:
                firsts = [int(x) for x, p in zip(t.tokens.tolist(), t.parents.tolist()) if p == -1][: self.extend]
                t = t.graft_chain(self.lookup.lookup(s))
                for x in firsts:
                    t = t.graft_chain([x] + self._continue(list(s) + [x]))
            out.append(t)
        return out

    def _continue(self, seq: list[int]) -> list[int]:
        found = self.continuation.lookup(seq)
        if not found and self.table is not None:
            found = self.table.chain(seq, self.continuation.k)
        return found


class ModelDrafter(Drafter):
    """A causal LM as drafter with its own KV cache (``TargetRunner``), batched over rows:
    one draft forward per draft depth for the whole batch.

    Chains sample from the draft at the verification temperature (argmax at 0) and carry q;
    dynamic trees are EAGLE-2 trees over the draft's log-probs.
    """

    def __init__(self, model: nn.Module, shape: TreeShape, name: str = "two_model"):
        self.runner = TargetRunner(model)
        self.shape = shape
        self.name = name
        self.params_per_forward = sum(p.numel() for p in model.parameters())
        if shape.kind == "static":
            raise ValueError("a model drafter builds chains or dynamic trees, not static Medusa trees")

    def draft_modules(self):
        # the draft model's decoder: one call per runner forward (an early exit's is a copy of the target's decoder,
        # whose own calls the counter tells apart)
        return (self.runner.decoder,)

    def start(self, prompts, feats):
        """Prefill the draft cache with every prompt but its last (pending) token."""
        self.batch_size = len(prompts)
        self.runner.reset(len(prompts))
        self.runner.forward_chain([list(p[:-1]) for p in prompts], logits=False)
        self.runner.commit([list(range(len(p) - 1)) for p in prompts])
        self.cached = [list(p[:-1]) for p in prompts]

    def _sync(self, seqs, active) -> torch.Tensor:
        """Feed each row's not-yet-cached tokens (committing them); return (B, V) root logits."""
        feed = [s[len(c):] if a else [] for s, c, a in zip(seqs, self.cached, active)]
        lens = [len(f) for f in feed]
        at = torch.tensor([[max(n - 1, 0)] for n in lens], device=self.runner.device)
        out = self.runner.forward_chain(feed, logits_at=at)
        self.runner.commit([list(range(n)) for n in lens])
        for b, f in enumerate(feed):
            self.cached[b] = self.cached[b] + f
        return out.logits[:, 0].double()

    def propose(self, seqs, active, temperature, generator):
        if any(a and len(s) <= len(c) for s, c, a in zip(seqs, self.cached, active)):
            raise RuntimeError("ModelDrafter: a sequence did not grow since the last proposal")
        root = self._sync(seqs, active)
        self._slot = [dict() for _ in seqs]  # tree node id -> scratch entry, per row
        if self.shape.kind == "chain":
            trees = self._chains(root, temperature, generator)
        else:
            trees = dynamic_trees(torch.log_softmax(root, -1), self._expand, self.shape.depth,
                                  self.shape.topk, self.shape.total_tokens)
        self.runner.discard()
        return [t if a else DraftTree.empty() for t, a in zip(trees, active)]

    def _chains(self, root_logits, temperature, generator) -> list[DraftTree]:
        B, k = root_logits.shape[0], self.shape.k
        toks, qs = [[] for _ in range(B)], [[] for _ in range(B)]
        logits = root_logits
        for i in range(k):
            q = probs(logits, temperature).cpu()
            t = (torch.multinomial(q, 1, generator=generator)[:, 0] if temperature > 0 else q.argmax(-1)).tolist()
            for b in range(B):
                toks[b].append(t[b]); qs[b].append(q[b])
            if i + 1 < k:
                logits = self.runner.forward_chain([[x] for x in t]).logits[:, 0].double()
        return [DraftTree.chain(toks[b], torch.stack(qs[b])) for b in range(B)]

    def _expand(self, nodes, tokens, parents) -> torch.Tensor:
        """Feed one tree level; node n of row b becomes scratch entry ``self._slot[b][n]``."""
        B, m = len(nodes), max(len(n) for n in nodes)
        s = self.runner.scratch_size
        tok = torch.zeros(B, m, dtype=torch.long)
        par = torch.full((B, m), -1, dtype=torch.long)
        for b in range(B):
            for j, (n, t, p) in enumerate(zip(nodes[b], tokens[b], parents[b])):
                tok[b, j] = t
                par[b, j] = self._slot[b][p] if p >= 0 else -1
                self._slot[b][n] = s + j
        dev = self.runner.device
        return torch.log_softmax(self.runner.forward(tok.to(dev), par.to(dev)).logits.double(), -1)


def shallow_model(model: nn.Module, num_layers: int) -> nn.Module:
    """The target's first ``num_layers`` decoder layers + its final norm + its LM head, sharing
    weights (no copy): the early-exit self-draft."""
    decoder = model.get_decoder()
    n = len(decoder.layers)
    if not 1 <= num_layers < n:
        raise ValueError(f"early exit needs 1 <= layers < {n}, got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    small_dec = copy.copy(decoder)
    small_dec._modules = dict(decoder._modules)
    small_dec.layers = nn.ModuleList(list(decoder.layers)[:num_layers])
    small_dec.config = config
    small = copy.copy(model)
    small._modules = dict(model._modules)
    small.config = config
    for name, mod in model._modules.items():
        if mod is decoder:
            small._modules[name] = small_dec
    return small


def early_exit_params(model: nn.Module, num_layers: int) -> int:
    """Parameters read by one early-exit draft forward: embedding row aside, k layers + norm + LM head."""
    dec = model.get_decoder()
    layer = sum(p.numel() for p in dec.layers[0].parameters())
    return num_layers * layer + model.get_output_embeddings().weight.numel()


class EarlyExitDrafter(ModelDrafter):
    """Self-draft from the target's first ``num_layers`` layers plus its LM head."""

    def __init__(self, target_model: nn.Module, num_layers: int, shape: TreeShape):
        super().__init__(shallow_model(target_model, num_layers), shape, name=f"early_exit{num_layers}")
        self.params_per_forward = early_exit_params(target_model, num_layers)
