"""Speculative sampling is lossless: the joint law of the first 3 generated tokens equals the
target's (exact enumeration, vocabulary 6), for chains (p/q) and trees (target-only walk); planted
bugs fail the same test.

Test: Pearson χ² over the 216 outcomes (cells with expected count < 5 pooled), N = 3000 samples,
one batched run. A correct sampler fails with probability 1e-4 (the threshold); the planted bugs
shift the law by a total-variation distance well above the test's resolution (~0.05 at N = 3000).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from decoding_helpers import peaky_model
from specheads.decoding import generate as gen_mod
from specheads.decoding import verify as verify_mod
from specheads.decoding.drafters import ModelDrafter, PromptLookupBranch, TreeShape
from specheads.decoding.ngram_table import NgramTable
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.decoding.verify import verify

V, N, PROMPT, THRESH = 6, 3000, [1, 2, 3, 4], 1e-4


@pytest.fixture(scope="module")
def target():
    return peaky_model(vocab=V, seed=0, scale=8.0, embed=5.0)


def perturbed(target, noise: float):
    """The target with a perturbed LM head (noise relative to the weights' spread)."""
    m = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = m.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g, dtype=w.dtype) * w.std() * noise)
    return m


@pytest.fixture(scope="module")
def draft(target):
    """Close to the target: full acceptance is common (α ≈ 0.75), rejections still happen."""
    return perturbed(target, 1.0)


@pytest.fixture(scope="module")
def far_draft(target):
    """Far from the target: rejections are common, so the residual and the rollback matter."""
    return perturbed(target, 4.0)


@pytest.fixture(scope="module")
def exact(target):
    return exact_law(target)


def exact_law(target) -> torch.Tensor:
    """(V, V, V) exact probabilities of the first three tokens at temperature 1 (test_dflash_drafter.py too)."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=3)])
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.double(), -1)
    L = len(PROMPT)
    cols = [logp[torch.arange(len(seqs)), L - 1 + i, seqs[:, L + i]] for i in range(3)]
    return torch.exp(sum(cols)).reshape(V, V, V)


def chi2_pvalue(samples: list[list[int]], exact: torch.Tensor) -> float:
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for s in samples:
        counts[s[0], s[1], s[2]] += 1
    e, o = (exact * len(samples)).flatten(), counts.flatten()
    small = e < 5
    e = torch.cat([e[~small], e[small].sum()[None]])
    o = torch.cat([o[~small], o[small].sum()[None]])
    stat = ((o - e) ** 2 / e).sum()
    df = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def run(target, draft, shape, method, runner_cls=TargetRunner, verify_fn=verify, seed=0, check_len=True):
    g = torch.Generator().manual_seed(seed)
    res = speculative_generate(runner_cls(target), ModelDrafter(draft, shape), [PROMPT] * N, 3,
                               temperature=1.0, method=method, generator=g, verify_fn=verify_fn)
    if check_len:
        assert all(len(t) == 3 for t in res.tokens)
    return [t for t in res.tokens if len(t) == 3]


CHAIN = TreeShape("chain", k=2)
TREE = TreeShape("dynamic", depth=2, topk=2, total_tokens=4)


def test_exact_is_a_distribution(exact):
    assert abs(float(exact.sum()) - 1) < 1e-9
    assert float(exact.max()) < 0.5  # not degenerate: the test has something to detect


@pytest.mark.parametrize("shape,method,far", [(CHAIN, "chain", False), (CHAIN, "chain", True),
                                              (CHAIN, "tree", False), (TREE, "tree", True)])
def test_sampling_is_lossless(target, draft, far_draft, exact, shape, method, far):
    assert chi2_pvalue(run(target, far_draft if far else draft, shape, method), exact) > THRESH


@pytest.mark.parametrize("shape,extend", [(CHAIN, 0), (TREE, 0), (TREE, 2)])
def test_sampling_with_a_prompt_lookup_branch_is_lossless(target, far_draft, exact, shape, extend):
    """Chains that grow a lookup branch lose their q and go through the target-only walk ("auto"); so do
    trees whose first drafts are continued from an n-gram table (a next token for every token)."""
    table = NgramTable.build([(torch.randint(0, V, (60,), generator=torch.Generator().manual_seed(2)).tolist(), None)],
                             orders=(1,))
    assert all(table.next_token([t]) is not None for t in range(V))
    drafter = PromptLookupBranch(ModelDrafter(far_draft, shape), k=2, max_ngram=2, table=table, extend=extend)
    g = torch.Generator().manual_seed(1)
    res = speculative_generate(TargetRunner(target), drafter, [PROMPT] * N, 3, temperature=1.0, method="auto",
                               generator=g)
    assert all(len(t) == 3 for t in res.tokens)
    inner_nodes = shape.k if shape.kind == "chain" else shape.total_tokens
    assert sum(s.draft_nodes for s in res.stats) > inner_nodes * sum(s.steps for s in res.stats)  # grafts happened
    assert chi2_pvalue(res.tokens, exact) > THRESH


def test_planted_bug_residual_not_subtracted(target, far_draft, exact, monkeypatch):
    monkeypatch.setattr(verify_mod, "_residual", lambda p, q: p)
    assert chi2_pvalue(run(target, far_draft, CHAIN, "chain"), exact) < THRESH


def test_planted_bug_bonus_dropped(target, draft, exact, monkeypatch):
    """The bonus token enters the context (it is the next step's root) but not the output."""
    full: list[bool] = []  # per verified row, in the order the loop then appends them

    def record(method, logits, tree, temperature, generator):
        v = verify(method, logits, tree, temperature, generator)
        full.append(tree.size > 0 and len(v.path) == tree.size)
        return v

    real_append = gen_mod._append

    def dropping_append(b, tokens, seqs, new, active, max_new_tokens, eos):
        if not full.pop(0):
            return real_append(b, tokens, seqs, new, active, max_new_tokens, eos)
        real_append(b, tokens[:-1], seqs, new, active, max_new_tokens, eos)
        if active[b]:
            seqs[b].append(tokens[-1])

    monkeypatch.setattr(gen_mod, "_append", dropping_append)
    res = run(target, draft, CHAIN, "chain", verify_fn=record, check_len=False)
    assert chi2_pvalue(res, exact) < THRESH


class NoRollbackRunner(TargetRunner):
    """Planted bug: rejected draft entries stay in the KV cache (positions still advance correctly)."""

    def commit(self, keep):
        live = [torch.nonzero(self.slots.scratch_live[b]).flatten().tolist() for b in range(self.batch_size)]
        extra = [len(set(l) - set(k)) for l, k in zip(live, keep)]
        super().commit([sorted(set(l) | set(k)) if k else [] for l, k in zip(live, keep)])
        self.slots.num_tokens -= torch.tensor(extra) * torch.tensor([bool(k) for k in keep])


def test_planted_bug_cache_not_rolled_back(target, far_draft, exact):
    assert chi2_pvalue(run(target, far_draft, CHAIN, "chain", runner_cls=NoRollbackRunner), exact) < THRESH
