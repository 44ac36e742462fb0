"""Suffix decoding: the trie's counts, matches and drafts against brute force over the raw sequences, the global
trie across requests, greedy identity and lossless sampling on a tiny target, and planted bugs each caught."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.generate import plain_generate, speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.decoding.suffix_drafter import SuffixDraft, SuffixDrafter, SuffixTrie
from specheads.decoding.tree import DraftTree
from specheads.decoding.verify import verify

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [40, 41]]


# ------------------------------------------------------------------ brute force over the raw sequences

def substring_counts(seqs, max_depth) -> Counter:
    """{string: its occurrences (sequence, start)} for every string of at most ``max_depth`` tokens; () = every
    start."""
    out = Counter()
    for s in seqs:
        for i in range(len(s)):
            out[()] += 1
            for n in range(1, min(max_depth, len(s) - i) + 1):
                out[tuple(s[i:i + n])] += 1
    return out


def trie_strings(trie: SuffixTrie) -> dict:
    """{string: count} of every node of ``trie``, read by walking it."""
    out, stack = {}, [((), 0)]
    while stack:
        w, n = stack.pop()
        out[w] = trie.count[n]
        stack += [(w + (t,), c) for t, c in trie.children[n].items()]
    return out


def brute_draft(seqs, context, k, max_depth, factor=1.0, offset=0.0, min_prob=0.1, tree=False) -> SuffixDraft:
    """The suffix decoding draft after ``context`` from occurrence counts of the raw ``seqs``."""
    counts = substring_counts(seqs, max_depth)

    def kids(w):  # (token, count) of w's continuations, most frequent first, smallest token among equals
        return sorted(((x[-1], c) for x, c in counts.items() if len(x) == len(w) + 1 and x[:-1] == w),
                      key=lambda tc: (-tc[1], tc[0]))

    best = SuffixDraft()
    for m in range(1, min(len(context), max_depth - 1) + 1):
        w = tuple(context[len(context) - m:])
        if counts[w] == 0:
            break
        cap = max(0, min(k, int(m * factor + offset + 1e-9)))
        d = SuffixDraft(match_len=m)
        if not tree:
            p, node = 1.0, w
            while len(d.tokens) < cap and kids(node):
                t, c = kids(node)[0]
                p *= c / counts[node]
                if p < min_prob:
                    break
                d.parents.append(len(d.tokens) - 1); d.tokens.append(t); d.probs.append(p); d.score += p
                node = node + (t,)
        else:  # frontier: (p, parent index, rank among its siblings, token, string)
            frontier = [(1.0 * c / counts[w], -1, r, t, w + (t,)) for r, (t, c) in enumerate(kids(w))]
            while len(d.tokens) < cap:
                frontier = [f for f in frontier if f[0] >= min_prob]
                if not frontier:
                    break
                f = min(frontier, key=lambda f: (-f[0], f[1], f[2]))
                frontier.remove(f)
                d.parents.append(f[1]); d.tokens.append(f[3]); d.probs.append(f[0]); d.score += f[0]
                i = len(d.tokens) - 1
                frontier += [(f[0] * c / counts[f[4]], i, r, t, f[4] + (t,)) for r, (t, c) in enumerate(kids(f[4]))]
        if d.score >= best.score:
            best = d
    return best


def same_draft(a: SuffixDraft, b: SuffixDraft) -> bool:
    return (a.tokens, a.parents, a.match_len) == (b.tokens, b.parents, b.match_len) and \
        all(abs(x - y) < 1e-12 for x, y in zip(a.probs, b.probs)) and abs(a.score - b.score) < 1e-12


def random_cases(seed: int, n: int = 60):
    """Random sequences over 3-4 tokens (so suffixes recur) and settings."""
    rng = random.Random(seed)
    for _ in range(n):
        vocab = rng.choice([3, 4])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 4))]
        context = seqs[0][-rng.randrange(1, 12):] if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(6)]
        yield seqs, context, dict(k=rng.choice([1, 3, 8]), max_depth=rng.choice([2, 4, 7]),
                                  factor=rng.choice([0.5, 1.0, 2.5]), offset=rng.choice([0.0, 1.0]),
                                  min_prob=rng.choice([0.0, 0.1, 0.4]), tree=rng.random() < 0.5)


def draft_mismatches(seed: int) -> list:
    out = []
    for seqs, context, s in random_cases(seed):
        trie = SuffixTrie(s["max_depth"])
        for i, seq in enumerate(seqs):
            trie.extend(i, seq)
        got = trie.speculate(context, s["k"], s["factor"], s["offset"], s["min_prob"], s["tree"])
        want = brute_draft(seqs, context, s["k"], s["max_depth"], s["factor"], s["offset"], s["min_prob"], s["tree"])
        if not same_draft(got, want):
            out.append((seqs, context, s, got, want))
    return out


# ------------------------------------------------------------------ the trie

@pytest.mark.parametrize("max_depth", [2, 3, 6, 40])
def test_counts_are_the_occurrences_of_every_suffix_window(max_depth):
    rng = random.Random(max_depth)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 50))] for _ in range(4)]
    trie = SuffixTrie(max_depth)
    for i, s in enumerate(seqs):
        for t in s:  # grown token by token, sequences interleaved
            trie.append(i, t)
    assert trie_strings(trie) == substring_counts(seqs, max_depth)
    assert len(trie) == len(substring_counts(seqs, max_depth))
    assert all(trie.depth[trie.node(w)] == len(w) for w in substring_counts(seqs, max_depth))


def test_removing_a_sequence_leaves_the_trie_of_the_others_and_frees_its_nodes():
    rng = random.Random(7)
    seqs = {i: [rng.randrange(3) for _ in range(rng.randrange(5, 40))] for i in range(5)}
    trie = SuffixTrie(5)
    for i, s in seqs.items():
        trie.extend(i, s)
    for gone in (3, 0, 4):
        trie.remove(gone)
        del seqs[gone]
        assert trie_strings(trie) == substring_counts(seqs.values(), 5)
    trie.extend(9, [0, 1, 2, 0, 1])  # freed nodes are reused
    seqs[9] = [0, 1, 2, 0, 1]
    assert trie_strings(trie) == substring_counts(seqs.values(), 5)
    for i in list(seqs):
        trie.remove(i)
    assert len(trie) == 1 and trie.count[0] == 0


def test_a_worked_example_match_counts_caps_and_the_chance_threshold():
    seq = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    trie = SuffixTrie(8)
    trie.extend(0, seq)
    assert trie.count[trie.node([1, 2])] == 4  # three continue (3, 3, 4), the last one ends the sequence
    assert trie.node([2, 1]) is None
    # m = 2 drafts 3 (2/4), then 1 (2/2): two tokens, as a match of 2 at factor 1 allows; m = 3 (4, 1, 2) has none
    d = trie.speculate(seq, k=8)
    assert (d.tokens, d.probs, d.score, d.match_len) == ([3, 1], [0.5, 0.5], 1.0, 2)
    d = trie.speculate(seq, k=8, spec_factor=2.0)  # m = 2 may draft 4: (1, 2, 3, 1, 2) goes on to 3 or 4 (1/2 each)
    assert (d.tokens, d.probs, d.match_len) == ([3, 1, 2, 3], [0.5, 0.5, 0.5, 0.25], 2)
    assert trie.speculate(seq, k=8, spec_factor=2.0, min_token_prob=0.3).tokens == [3, 1, 2]
    assert trie.speculate(seq, k=3, spec_factor=2.0).tokens == [3, 1, 2]
    d = trie.speculate(seq, k=4, spec_factor=2.0, tree=True)  # best first: 3, 1, 2 (1/2 each), then 4 (1/4, first seen)
    assert (d.tokens, d.parents, d.score) == ([3, 1, 2, 4], [-1, 0, 1, -1], 1.75)
    assert trie.speculate([7, 7], k=8).tokens == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drafts_equal_brute_force_on_random_sequences(seed):
    assert draft_mismatches(seed) == []


def test_planted_bug_a_match_one_token_short_is_caught(monkeypatch):
    """The match looks up the context's last m tokens; looking up the m before the last token (an off-by-one) drafts
    other tokens, and the brute-force comparison sees it."""
    node = SuffixTrie.node
    monkeypatch.setattr(SuffixTrie, "node", lambda self, tokens: node(self, list(tokens)[:-1]) if len(tokens) > 1
                        else node(self, tokens))
    assert draft_mismatches(0)


# ------------------------------------------------------------------ the drafter: its two tries

def test_the_global_trie_holds_outputs_across_requests_and_forgets_a_repeated_prompts_own():
    d = SuffixDrafter(k=4, max_depth=6, spec_factor=4.0, max_cached_requests=3)
    d.start([[10, 11]], None)
    d.observe(0, [5, 6, 7, 8], None, None)
    d.start([[20, 21]], None)
    d.observe(0, [30, 31], None, None)
    assert trie_strings(d.outputs) == substring_counts([[5, 6, 7, 8], [30, 31]], 6)
    d.start([[22, 5]], None)  # a third request drafts from the first one's output
    assert d.propose([[22, 5]], [True], 0.0, None)[0].tokens.tolist() == [6, 7, 8]
    d.start([[23]], None)  # a fourth: at most 3 kept, the oldest goes first
    assert list(d.cached.values()) == [(20, 21), (22, 5), (23,)]
    assert trie_strings(d.outputs) == substring_counts([[30, 31]], 6)
    d.start([[20, 21], [22, 5]], None)  # the same prompts again: their earlier outputs go
    assert list(d.cached.values()) == [(23,), (20, 21), (22, 5)] and d.outputs.count[0] == 0
    d.observe(0, [1, 2, 3], None, None)  # rows of one batch read each other's output
    assert d.propose([[20, 21, 1, 2, 3], [22, 5, 1]], [True, True], 0.0, None)[1].tokens.tolist() == [2, 3]
    off = SuffixDrafter(k=4, max_depth=6, spec_factor=4.0, max_cached_requests=0)
    off.start([[10, 11]], None)
    off.observe(0, [5, 6, 7, 8], None, None)
    off.start([[22, 5]], None)
    assert off.outputs.count[0] == 0 and off.propose([[22, 5]], [True], 0.0, None)[0].size == 0


def test_the_drafter_drafts_the_better_of_its_two_tries_as_brute_force_does():
    rng = random.Random(3)
    for case in range(40):
        tree = case % 2 == 1
        d = SuffixDrafter(k=6, max_depth=5, spec_factor=2.0, min_token_prob=0.1, tree=tree)
        history = []
        for _ in range(2):  # earlier requests, other prompts
            prompt = [100 + len(history)] + [rng.randrange(3) for _ in range(3)]
            d.start([prompt], None)
            out = [rng.randrange(3) for _ in range(rng.randrange(1, 15))]
            d.observe(0, out, None, None)
            history.append(out)
        prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(2)]
        d.start(prompts, None)
        seqs = [list(p) for p in prompts]
        for step in range(3):
            for b in range(2):
                new = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
                seqs[b] += new
                d.observe(b, new, None, None)
            outputs = history + [s[len(p):] for s, p in zip(seqs, prompts)]
            for b in range(2):
                local = brute_draft([seqs[b]], seqs[b][-5:], 6, 5, 2.0, 0.0, 0.1, tree)
                glob = brute_draft(outputs, seqs[b][-5:], 6, 5, 2.0, 0.0, 0.1, tree)
                want = glob if glob.score > local.score else local
                assert same_draft(d.speculate(b, seqs[b]), want), (case, step, b)
            trees = d.propose(seqs, [True, True], 0.0, None)
            for b, t in enumerate(trees):
                t.check_distinct_siblings()
                assert t.tokens.tolist() == d.speculate(b, seqs[b]).tokens
                assert (t.q is None) == (tree or t.size == 0)


def test_bad_settings_are_refused():
    for kw in [dict(k=0), dict(max_depth=1), dict(spec_factor=-1.0), dict(min_token_prob=1.5),
               dict(max_cached_requests=-2)]:
        with pytest.raises(ValueError, match="suffix decoding needs"):
            SuffixDrafter(**kw)


# ------------------------------------------------------------------ decoding with it

@pytest.fixture(scope="module")
def target():
    return peaky_model()


@pytest.mark.parametrize("tree,backend", [(False, None), (True, None), (False, "torch"), (True, "torch")])
def test_greedy_suffix_decoding_is_exact_in_batches(target, tree, backend):
    want = [reference_greedy(target, p, 24) for p in PROMPTS]
    d = SuffixDrafter(k=8, tree=tree)
    res = speculative_generate(TargetRunner(target), d, PROMPTS, 24, verify_backend=backend)
    assert res.tokens == want
    again = speculative_generate(TargetRunner(target), d, PROMPTS, 24, verify_backend=backend)  # same drafter, same
    assert again.tokens == want  # prompts: identical, whatever the global trie holds
    tested = sum(sum(s.tested) for s in res.stats)
    assert tested > 0 and sum(sum(s.accepted) for s in res.stats) > 0


def test_tau_exceeds_one_on_text_that_repeats_itself(target):
    """The peaky target's greedy continuations settle into short loops, which the request's own trie then drafts:
    τ clearly above 1 (it is exactly 1 if no draft is ever accepted)."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [7, 7, 8, 7, 7, 8, 7]]
    plain = plain_generate(TargetRunner(target), prompts, 64)
    res = speculative_generate(TargetRunner(target), SuffixDrafter(k=8), prompts, 64)
    assert res.tokens == plain.tokens
    tau = sum(s.emitted for s in res.stats) / sum(s.steps for s in res.stats)
    assert tau > 1.5, tau


def _uniform_q(self, draft, seq):
    """Planted bug: a chain that claims to be drawn from the uniform law (not the one-hot law it was drafted from)."""
    if not draft.tokens:
        return DraftTree.empty()
    q = torch.full((len(draft.tokens), 1 + max(max(seq), max(draft.tokens))), 1.0, dtype=torch.float64)
    return DraftTree.chain(draft.tokens, q / q.shape[1])


@pytest.mark.parametrize("tree", [False, True])
def test_suffix_sampling_is_lossless_and_a_planted_bug_is_caught(tree, monkeypatch):
    """The joint law of 3 sampled tokens equals the target's (the χ² test of test_sampling.py), drafting from the
    request's trie and from the other rows' outputs; a chain whose q misstates how it was drafted fails the test."""
    import test_sampling as ts

    target = ts.peaky_model(vocab=ts.V, seed=0, scale=8.0, embed=5.0)
    exact = ts.exact_law(target)

    def sample():
        g = torch.Generator().manual_seed(0)
        res = speculative_generate(TargetRunner(target), SuffixDrafter(k=4, tree=tree), [ts.PROMPT] * ts.N, 3,
                                   temperature=1.0, method="auto", generator=g, verify_fn=verify)
        assert sum(sum(s.tested) for s in res.stats) > 0.2 * sum(s.steps for s in res.stats)  # drafts were verified
        return [t for t in res.tokens if len(t) == 3]

    assert ts.chi2_pvalue(sample(), exact) > ts.THRESH
    if not tree:
        monkeypatch.setattr(SuffixDrafter, "_draft_tree", _uniform_q)
        assert ts.chi2_pvalue(sample(), exact) < ts.THRESH


def test_the_serve_line_is_vllms_suffix_method_and_the_guide_shows_the_rows():
    from pathlib import Path

    d = SuffixDrafter(k=4)
    assert d.vllm_speculative_config() == {
        "method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
        "suffix_decoding_max_cached_requests": 10000}
    guide = (Path(__file__).resolve().parents[2] / "docs" / "evaluate.md").read_text()
    assert d.serve_line("$TARGET") in guide
    for other in (SuffixDrafter(tree=True), SuffixDrafter(spec_offset=1.0)):
        with pytest.raises(ValueError, match="no serve line"):
            other.vllm_speculative_config()
