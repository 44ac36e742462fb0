"""Tiny targets and test-only drafters (the target itself, always wrong, a noisy oracle, an oracle with wrong
siblings)."""

from __future__ import annotations

import torch

from tests.conftest import make_tiny_model
from specheads.decoding.drafters import Drafter, ModelDrafter, TreeShape
from specheads.decoding.tree import DraftTree


def peaky_model(vocab: int = 64, seed: int = 0, layers: int = 2, scale: float = 30.0, attn: str = "eager",
                embed: float = 1.0):
    """A float64 tiny Llama whose next-token distributions are far from uniform and context-sensitive."""
    m = make_tiny_model(vocab=vocab, hidden=32, layers=layers, heads=4, kv_heads=2, seed=seed, dtype=torch.float64)
    m.config._attn_implementation = attn
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
        m.model.embed_tokens.weight.mul_(embed)
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(8.0)
    return m


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by full recomputation (no cache): the ground truth."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class WrongDrafter(Drafter):
    """Drafts k tokens that are never the target's argmax (uses the target to know which to avoid)."""

    name = "always_wrong"

    def __init__(self, model, k: int):
        self.oracle = ModelDrafter(model, TreeShape("chain", k=1), "oracle")
        self.k, self.vocab = k, model.config.vocab_size

    def start(self, prompts, feats):
        self.oracle.start(prompts, feats)

    def propose(self, seqs, active, temperature, generator):
        first = self.oracle.propose(seqs, active, 0.0, generator)
        out = []
        for t in first:
            if t.size == 0:
                out.append(t)
                continue
            bad = (int(t.tokens[0]) + 1) % self.vocab
            out.append(DraftTree.chain([bad] * self.k))
        return out


class NoisyOracle(Drafter):
    """The target's own greedy chain, each position independently replaced by a wrong token with
    probability 1 - alpha: acceptance is then Bernoulli(alpha) per tested position."""

    name = "noisy_oracle"

    def __init__(self, model, k: int, alpha: float, seed: int = 0):
        self.oracle = ModelDrafter(model, TreeShape("chain", k=k), "oracle")
        self.alpha, self.k, self.vocab = alpha, k, model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def start(self, prompts, feats):
        self.oracle.start(prompts, feats)

    def propose(self, seqs, active, temperature, generator):
        trees = self.oracle.propose(seqs, active, 0.0, generator)
        out = []
        for t in trees:
            toks = t.tokens.clone()
            flip = torch.rand(len(toks), generator=self.gen) >= self.alpha
            toks[flip] = (toks[flip] + 1) % self.vocab
            out.append(DraftTree.chain(toks.tolist()))
        return out


class SiblingOracle(Drafter):
    """Drafts each row's next plain tokens (``plain[b]``, the row's known plain output after its ``prompt_lens[b]``
    prompt tokens) as a chain of ``k`` with a wrong sibling at every depth: trees whose right path is accepted and
    whose wrong branches are verified beside it at the same positions."""

    def __init__(self, plain: list[list[int]], prompt_lens: list[int], k: int = 3):
        self.plain, self.lens, self.k = plain, prompt_lens, k

    def propose(self, seqs, active, temperature, generator):
        trees = []
        for b, seq in enumerate(seqs):
            done = len(seq) - self.lens[b]
            right = self.plain[b][done:done + self.k]
            if not active[b] or not right:
                trees.append(DraftTree.empty())
                continue
            tokens, parents = [], []
            for d, t in enumerate(right):
                tokens += [(t + 1) % 1000, t]  # a wrong sibling first, then the right token
                parents += [-1 if d == 0 else 2 * d - 1] * 2
            trees.append(DraftTree(torch.tensor(tokens), torch.tensor(parents)))
        return trees
