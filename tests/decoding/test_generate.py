"""Greedy speculative decoding reproduces plain greedy exactly; τ matches known drafters."""

from __future__ import annotations

import math

import pytest
import torch

from decoding_helpers import NoisyOracle, WrongDrafter, peaky_model, reference_greedy
from tests.conftest import make_tiny_model
from specheads.decoding.drafters import (Drafter, EarlyExitDrafter, ModelDrafter, NgramDrafter, PromptLookupBranch,
                                        TreeShape)
from specheads.decoding.ngram_table import NgramTable
from specheads.decoding.tree import DraftTree
from specheads.decoding.generate import plain_generate, speculative_generate
from specheads.decoding.runner import TargetRunner

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [40, 41]]
SHAPES = [TreeShape("chain", k=1), TreeShape("chain", k=4), TreeShape("dynamic", depth=3, topk=2, total_tokens=5),
          TreeShape("dynamic", depth=4, topk=3, total_tokens=10)]


@pytest.fixture(scope="module")
def target():
    return peaky_model()


@pytest.fixture(scope="module")
def reference(target):
    return [reference_greedy(target, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_plain_matches_recomputation(attn, reference):
    model = peaky_model(attn=attn)
    res = plain_generate(TargetRunner(model), PROMPTS, 16)
    assert res.tokens == reference
    assert res.target_forwards == 16


def _drafters(target):
    other = make_tiny_model(vocab=64, hidden=32, layers=2, seed=3, dtype=torch.float64)
    for shape in SHAPES:
        yield ModelDrafter(other, shape, "two_model")
        yield ModelDrafter(target, shape, "self")
        yield EarlyExitDrafter(target, 1, shape)
        yield PromptLookupBranch(ModelDrafter(other, shape, "two_model"), k=3)
    noise = NgramTable.build([(torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(0)).tolist(), None)])
    for shape in SHAPES[2:]:
        yield PromptLookupBranch(ModelDrafter(other, shape, "two_model"), k=3, table=noise, extend=2, extend_len=3)
    yield NgramDrafter(k=3)
    yield WrongDrafter(target, 3)
    yield PromptLookupBranch(WrongDrafter(target, 3), k=2)


def test_greedy_speculative_is_exact_for_every_drafter_and_shape(target, reference):
    for drafter in _drafters(target):
        res = speculative_generate(TargetRunner(target), drafter, PROMPTS, 16)
        assert res.tokens == reference, f"{drafter.name} {getattr(drafter, 'shape', '')}"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_drafter_gives_tau_k_plus_one(target, k):
    res = speculative_generate(TargetRunner(target), ModelDrafter(target, TreeShape("chain", k=k)), PROMPTS,
                               4 * (k + 1))
    for s in res.stats:
        assert s.emitted == s.steps * (k + 1)
        assert s.accepted == s.tested


def test_always_wrong_drafter_gives_tau_one(target, reference):
    res = speculative_generate(TargetRunner(target), WrongDrafter(target, 4), PROMPTS, 16)
    assert res.tokens == reference
    for s in res.stats:
        assert s.emitted == s.steps and sum(s.accepted) == 0 and s.tested[0] == s.steps


def test_noisy_oracle_tau_matches_leviathan(target):
    alpha, k = 0.6, 4
    res = speculative_generate(TargetRunner(target), NoisyOracle(target, k, alpha), [PROMPTS[0]] * 4, 150)
    per_step = []
    for s in res.stats:
        per_step.append(s.emitted / s.steps)
    steps = sum(s.steps for s in res.stats)
    tau = sum(s.emitted for s in res.stats) / steps
    expect = (1 - alpha ** (k + 1)) / (1 - alpha)
    # accepted length per step is a truncated geometric; its variance bounds the mean's error
    var = sum((min(j, k) + 1 - expect) ** 2 * (alpha ** j * (1 - alpha) if j < k else alpha ** k)
              for j in range(k + 1))
    assert abs(tau - expect) < 4 * math.sqrt(var / steps), (tau, expect)


def test_batch_uses_one_target_forward_per_step(target):
    runner = TargetRunner(target)
    res = speculative_generate(runner, ModelDrafter(target, TreeShape("chain", k=2)), PROMPTS, 9)
    assert res.target_forwards == max(s.steps for s in res.stats)
    assert runner.forward_calls == res.target_forwards + 1  # + prefill


def test_batched_greedy_verification_equals_row_by_row(target, reference):
    """verify_backend='torch': one batched verification call per step gives the same tokens and the
    same per-depth counts as the per-row references, for chains, trees and a drafter that is always wrong."""
    import specheads.decoding.batched_verify as bv

    calls = []
    real = bv.verify_greedy_batched

    def counting(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    bv.verify_greedy_batched = counting
    try:
        for drafter in [ModelDrafter(target, SHAPES[1], "self"), EarlyExitDrafter(target, 1, SHAPES[3]),
                        WrongDrafter(target, 3)]:
            a = speculative_generate(TargetRunner(target), drafter, PROMPTS, 16)
            calls.clear()
            b = speculative_generate(TargetRunner(target), drafter, PROMPTS, 16, verify_backend="torch")
            assert b.tokens == a.tokens == reference
            assert [(s.tested, s.accepted, s.emitted) for s in b.stats] == \
                [(s.tested, s.accepted, s.emitted) for s in a.stats]
            assert len(calls) == b.target_forwards and set(calls) == {len(PROMPTS)}
    finally:
        bv.verify_greedy_batched = real


def test_tau_and_alpha_count_only_tokens_that_reach_the_output(target):
    """Issue 12.1: a self-draft chain of 4 under a 32-token cap emits 5 tokens a step for 6 steps, then
    2 of the 7th step's 5: τ = 32 / 7 = 4.57 (not 35 / 7 = 5.00), and the 7th step's drafts 3 and 4
    never reach the output, so they are neither accepted nor rejected."""
    res = speculative_generate(TargetRunner(target), ModelDrafter(target, TreeShape("chain", k=4), "self"),
                               [PROMPTS[0]], 32)
    s = res.stats[0]
    assert len(res.tokens[0]) == 32 and s.steps == 7
    assert s.emitted == 32 and s.emitted / s.steps == pytest.approx(32 / 7)
    assert s.tested == [7, 7, 6, 6] and s.accepted == s.tested
    assert s.nodes_by_depth == [7, 7, 7, 7]  # what was drafted (the cost) still counts every node


def test_eos_cut_counts_the_same_way(target, reference):
    """At EOS the output ends mid-step: emitted = the output's length, and a draft depth counts only
    when its output position was produced; for every drafter and batching path."""
    eos = reference[0][9]
    stop = reference[0].index(eos) + 1
    for drafter in [ModelDrafter(target, TreeShape("chain", k=4), "self"), NoisyOracle(target, 4, 0.6),
                    WrongDrafter(target, 3), EarlyExitDrafter(target, 1, SHAPES[3])]:
        for backend in (None, "torch"):
            res = speculative_generate(TargetRunner(target), drafter, PROMPTS, 30, eos_ids=[eos],
                                       verify_backend=backend)
            assert res.tokens[0] == reference_greedy(target, PROMPTS[0], 30)[:stop]
            for toks, s in zip(res.tokens, res.stats):
                assert s.emitted == len(toks)
                # a step emits its counted accepted drafts + 1 (the bonus), except the last step of a
                # row cut inside its accepted path; every step tests depth 1, whose token is always output
                assert s.emitted - sum(s.accepted) in (s.steps, s.steps - 1)
                assert s.tested[0] == s.steps and all(a <= t for a, t in zip(s.accepted, s.tested))


def test_stop_ends_a_row_at_the_step_it_says_and_leaves_the_others(target, reference):
    """``stop`` (the evaluator's exact pass stops a decode at its first token off the reference): the row it stops
    ends at that step's end, a prefix of its greedy output; the batch's other rows decode on to max_new_tokens."""
    want = [r[:3] for r in reference]
    want[0] = want[0][:2] + [(want[0][2] + 1) % 64]  # row 0's reference goes wrong at its third token
    res = speculative_generate(TargetRunner(target), ModelDrafter(target, TreeShape("chain", k=2), "self"), PROMPTS,
                               16, stop=lambda b, got: b == 0 and got[:3] != want[0][:len(got[:3])])
    assert 3 <= len(res.tokens[0]) < 16 and res.tokens[0] == reference[0][:len(res.tokens[0])]
    assert res.tokens[1:] == reference[1:]


def test_row_stats_add_drops_depths_beyond_the_output():
    from specheads.decoding.tree import DraftTree
    from specheads.decoding.verify import Verdict
    from specheads.decoding.generate import RowStats

    tree = DraftTree.chain([1, 2, 3, 4])
    v = Verdict(path=[0, 1], bonus=9, tested=[1, 1, 1], accepted=[1, 1, 0])  # draft 3 rejected, bonus at 3
    s = RowStats()
    s.add(v, tree)  # the whole step reached the output: the rejection counts
    assert (s.emitted, s.tested, s.accepted) == (3, [1, 1, 1], [1, 1, 0])
    s.add(v, tree, emitted=2)  # the output ended after draft 2: the rejected draft 3 never counted
    assert (s.emitted, s.tested, s.accepted) == (5, [2, 2, 1], [2, 2, 0])
    s.add(v, tree, emitted=1)
    assert (s.steps, s.emitted, s.tested, s.accepted) == (3, 6, [3, 2, 1], [3, 2, 0])


def test_prompt_lookup_branch_adds_the_lookups_acceptance_to_a_drafter_that_never_hits(target, reference):
    # The inner drafter is never right, so every accepted token comes from the grafted lookup chain:
    # the hybrid accepts exactly what the n-gram drafter alone accepts, step by step.
    alone = speculative_generate(TargetRunner(target), NgramDrafter(k=3), PROMPTS, 16)
    both = speculative_generate(TargetRunner(target), PromptLookupBranch(WrongDrafter(target, 2), k=3), PROMPTS, 16)
    assert both.tokens == alone.tokens == reference
    assert sum(sum(s.accepted) for s in alone.stats) > 0  # the lookup hits on these prompts
    for a, b in zip(alone.stats, both.stats):
        assert (b.steps, b.emitted) == (a.steps, a.emitted)
        assert b.draft_nodes > a.draft_nodes  # the wrong chain was verified beside the lookup's
    with pytest.raises(ValueError, match="other than the n-gram"):
        PromptLookupBranch(NgramDrafter(k=3))


class _Fan(Drafter):
    """Always the same three first drafts, best first."""

    def propose(self, seqs, active, temperature, generator):
        return [DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, -1])) for _ in seqs]


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()

    def path(i):
        return (path(pars[i]) if pars[i] >= 0 else ()) + (toks[i],)

    return {path(i) for i in range(len(toks))}


def test_extended_branch_continues_the_best_first_drafts_from_the_context_else_the_table():
    table = NgramTable.build([([1, 5, 20, 21, 22], None), ([1, 6, 30, 31], None)])
    one = PromptLookupBranch(_Fan(), k=2, table=table, extend=1, extend_len=2).propose([[9, 1]], [True], 0.0, None)[0]
    assert _paths(one) == {(5,), (6,), (7,), (5, 20), (5, 20, 21)}  # only the best draft is continued
    two = PromptLookupBranch(_Fan(), k=2, table=table, extend=2, extend_len=3).propose([[9, 1]], [True], 0.0, None)[0]
    assert {(5, 20, 21, 22), (6, 30, 31)} <= _paths(two) and (7,) in _paths(two) and len(two.tokens) == 8
    # the context has "1 5" followed by 40 41: the prompt lookup's continuation wins over the table's
    ctx = PromptLookupBranch(_Fan(), k=2, table=table, extend=1).propose([[1, 5, 40, 41, 9, 1]], [True], 0.0, None)[0]
    assert (5, 40, 41) in _paths(ctx) and (5, 20) not in _paths(ctx)
    # without extend (or without a match) the tree is the branch's alone
    plain = PromptLookupBranch(_Fan(), k=2).propose([[9, 1]], [True], 0.0, None)[0]
    assert _paths(plain) == {(5,), (6,), (7,)}
    with pytest.raises(ValueError, match="extend"):
        PromptLookupBranch(_Fan(), k=2, extend=-1)


def test_extending_a_right_first_draft_from_a_table_of_the_targets_outputs_raises_tau(target, reference):
    # the target's own first token (always accepted) continued by a table built from the target's greedy
    # outputs: more tokens per step than the first draft alone (tau 2), the output unchanged
    table = NgramTable.build([(list(p) + r, None) for p, r in zip(PROMPTS, reference)])
    runs = {}
    for extend in (0, 1):
        drafter = PromptLookupBranch(ModelDrafter(target, TreeShape("chain", k=1), "self"), k=1, table=table,
                                     extend=extend, extend_len=3)
        runs[extend] = speculative_generate(TargetRunner(target), drafter, PROMPTS, 16)
        assert runs[extend].tokens == reference
    tau = {e: sum(s.emitted for s in r.stats) / sum(s.steps for s in r.stats) for e, r in runs.items()}
    assert tau[1] > tau[0] + 0.5, tau
