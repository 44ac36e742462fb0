"""Lookahead decoding: the window's layout, greedy identity, lossless sampling, planted bugs, and τ > 1
on text that repeats itself."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.generate import plain_generate, speculative_generate
from specheads.decoding.lookahead import LookaheadDrafter, NgramPool, trie
from specheads.decoding.runner import TargetRunner
from specheads.decoding.tree import DraftTree
from specheads.decoding.verify import Verdict, verify

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [40, 41]]
SETTINGS = [(1, 2, 1), (3, 2, 2), (4, 3, 3), (5, 4, 5)]  # (W, N, G)


@pytest.fixture(scope="module")
def target():
    return peaky_model()


@pytest.fixture(scope="module")
def reference(target):
    return [reference_greedy(target, p, 24) for p in PROMPTS]


def _ancestors(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_window_columns_are_trajectories_one_position_apart():
    W, N = 4, 4
    d = LookaheadDrafter(window=W, ngram=N, guesses=2)
    d.start([[7, 8, 9, 10]], None)
    d.levels[0] = [[100 + 10 * j + i for i in range(W)] for j in range(N - 1)]
    tree = d.propose([[7, 8, 9, 10]], [True], 0.0, None)[0]
    assert tree.size == 0  # empty pool: nothing to verify yet
    tokens, parents = tree.fed_tokens_parents()
    tokens, parents = tokens.tolist(), parents.tolist()
    assert len(tokens) == (W - 1) + (N - 2) * W
    for j in range(1, N - 1):
        for i in range(W):
            node = tokens.index(100 + 10 * j + i)
            path = [tokens[k] for k in _ancestors(parents, node)]
            # root, level-0 guesses of columns 1..i, then this column's levels 1..j
            assert path == [100 + c for c in range(1, i + 1)] + [100 + 10 * jj + i for jj in range(1, j + 1)]
            assert len(path) == i + j  # its position is the root's + i + j


def test_pool_keeps_the_most_recent_per_first_token_and_the_trie_merges_prefixes():
    pool = NgramPool(2)
    for g in [(1, 2, 3), (1, 2, 4), (1, 5, 6), (1, 2, 4), (9, 9, 9)]:
        pool.add(g)
    assert pool.lookup(1) == [(2, 4), (5, 6)]
    tokens, parents = trie([(2, 4), (2, 3), (5, 6)])
    assert tokens == [2, 4, 3, 5, 6] and parents == [-1, 0, 0, -1, 3]
    DraftTree(torch.tensor(tokens), torch.tensor(parents)).check_distinct_siblings()


@pytest.mark.parametrize("W,N,G", SETTINGS)
def test_greedy_lookahead_is_exact(target, reference, W, N, G):
    res = speculative_generate(TargetRunner(target), LookaheadDrafter(W, N, G), PROMPTS, 24)
    assert res.tokens == reference
    assert res.target_forwards < 3 * 24  # one target forward per step, never more


def test_batched_greedy_verification_sees_only_the_draft_nodes(target, reference):
    res = speculative_generate(TargetRunner(target), LookaheadDrafter(4, 3, 3), PROMPTS, 24, verify_backend="torch")
    assert res.tokens == reference


def _accept_first_candidate(method, logits, tree, temperature, generator):
    """Planted bug: the first candidate path is accepted without checking it against the target."""
    v = verify(method, logits, tree, temperature, generator)
    if tree.size:
        path, node = [0], 0
        while (kids := tree.children(node)):
            node = kids[0]
            path.append(node)
        return Verdict(path, v.bonus)
    return v


def test_planted_bug_accepting_an_unverified_ngram_breaks_identity(target, reference):
    res = speculative_generate(TargetRunner(target), LookaheadDrafter(4, 3, 3), PROMPTS, 24,
                               verify_fn=_accept_first_candidate)
    assert res.tokens != reference


def test_tau_exceeds_one_on_text_that_repeats_itself(target):
    """The peaky tiny target's greedy continuations settle into short loops; once a loop has gone round,
    the Jacobi trajectories have put its n-grams in the pool. Measured on these two prompts, 96 tokens,
    W5 N4 G5: τ 2.77 and 3.13 (n-gram prompt lookup, k=3: 1.88 and 2.16; plain decoding: exactly 1),
    so the bound 1.5 leaves room and still fails if lookahead never gets an n-gram accepted."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [7, 7, 8, 7, 7, 8, 7]]
    plain = plain_generate(TargetRunner(target), prompts, 96)
    res = speculative_generate(TargetRunner(target), LookaheadDrafter(5, 4, 5), prompts, 96)
    assert res.tokens == plain.tokens
    tau = sum(s.emitted for s in res.stats) / sum(s.steps for s in res.stats)
    assert tau > 1.5, tau


def test_lookahead_sampling_is_lossless_and_a_planted_bug_is_caught():
    """The joint law of 3 sampled tokens equals the target's (the χ² test of test_sampling.py) while
    the window rides in the same forward; accepting unverified n-grams fails the same test."""
    import test_sampling as ts

    target = ts.peaky_model(vocab=ts.V, seed=0, scale=8.0, embed=5.0)
    exact = _exact(ts, target)

    def sample(verify_fn):
        g = torch.Generator().manual_seed(0)
        res = speculative_generate(TargetRunner(target), LookaheadDrafter(3, 2, 3), [ts.PROMPT] * ts.N, 3,
                                   temperature=1.0, method="tree", generator=g, verify_fn=verify_fn)
        if verify_fn is verify:  # candidates really were verified in most steps
            assert sum(sum(s.tested) for s in res.stats) > 0.2 * sum(s.steps for s in res.stats)
        return [t for t in res.tokens if len(t) == 3]

    assert ts.chi2_pvalue(sample(verify), exact) > ts.THRESH
    assert ts.chi2_pvalue(sample(_accept_first_candidate), exact) < ts.THRESH


def _exact(ts, target):
    import itertools

    seqs = torch.tensor([ts.PROMPT + list(c) for c in itertools.product(range(ts.V), repeat=3)])
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.double(), -1)
    L = len(ts.PROMPT)
    cols = [logp[torch.arange(len(seqs)), L - 1 + i, seqs[:, L + i]] for i in range(3)]
    return torch.exp(sum(cols)).reshape(ts.V, ts.V, ts.V)


@pytest.mark.slow
def test_smollm2_lookahead_is_exact_and_drafts_on_a_repeat_prompt(smollm2):
    """On the real target: greedy identity on a prompt whose answer repeats itself (code that prints a
    range), and τ clearly above 1 there. Measured with W5 N4 G5 over 64 tokens: τ 1.68 (n-gram prompt
    lookup k=3: 1.39); the bound 1.4 fails if lookahead's own n-grams are never accepted."""
    tok = smollm2.tokenizer
    chat = [{"role": "user", "content": "Write ten Python print statements that print the numbers 1 to 10, "
                                        "one statement per line."}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    from specheads.targets import eos_token_ids

    eos = eos_token_ids(smollm2)
    plain = plain_generate(TargetRunner(smollm2.model), [prompt], 64, eos_ids=eos)
    res = speculative_generate(TargetRunner(smollm2.model), LookaheadDrafter(5, 4, 5), [prompt], 64, eos_ids=eos)
    assert res.tokens == plain.tokens
    tau = res.stats[0].emitted / res.stats[0].steps
    print(f"lookahead on SmolLM2, repeat prompt: tau {tau:.2f}; {tok.decode(res.tokens[0])!r}")
    assert tau > 1.4, tau
