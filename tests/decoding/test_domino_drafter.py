"""Domino as a drafter: greedy speculative decoding equals plain greedy (shifted and unshifted labels, batch 1 and
batched), the drafted logits are the teacher-forced ones of the tokens drafted before (what training computes), a
sampled chain's q is the law each token was drawn from, and sampling stays exact at T = 1 (the χ² harness of
test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.domino_drafter import DominoDrafter
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.models.domino import DominoConfig, DominoModel
from specheads.targets import Target

BLOCK = 4
PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [4, 4], [7, 1, 60, 33, 12, 9, 9, 40, 2, 17, 5]]
NEW = 14


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # float64: exact comparisons


def random_head(target, shift_label=True, seed=0, noise=0.2, **kw) -> DominoModel:
    torch.manual_seed(seed)
    cfg = DominoConfig.from_target(target, num_layers=1, block_size=BLOCK, shift_label=shift_label, **kw)
    m = DominoModel(cfg).double().attach(target)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * noise)
    return m.eval()


@pytest.mark.parametrize("shift_label", [True, False])
def test_greedy_speculative_equals_plain_greedy(target, shift_label):
    head = random_head(target, shift_label)
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    for shape in (None, TreeShape("chain", k=2)):
        d = DominoDrafter(head, shape)
        for batch in ([[p] for p in PROMPTS[:2]] + [PROMPTS[2:]], [PROMPTS]):
            got = []
            for prompts in batch:
                res = speculative_generate(TargetRunner(target.model), d, prompts, NEW)
                got += res.tokens
                assert all(s.draft_forwards == s.steps for s in res.stats)  # one block forward per step
            assert got == ref, (shift_label, d.shape.label(), len(batch))


@pytest.mark.parametrize("shift_label, prefix_len", [(True, 1), (False, 1), (True, 0)])
def test_drafted_logits_are_the_teacher_forced_ones(target, shift_label, prefix_len):
    """The drafter feeds the GRU its own drafts; with those as the block's tokens, training's ``block_logits``
    gives the same logits slot by slot."""
    head = random_head(target, shift_label, pure_draft_prefix_len=prefix_len)
    d = DominoDrafter(head)
    seen = {}
    real_states, real_chain = d.block_states, d.chain

    def states(seqs, active):
        return seen.setdefault("h", real_states(seqs, active))  # the first proposal's block

    def chain(h, anchors, temperature, generator):
        return seen.setdefault("out", real_chain(h, anchors, temperature, generator))

    d.block_states, d.chain = states, chain
    speculative_generate(TargetRunner(target.model), d, [PROMPTS[0]], 2)
    h, logits = seen["h"], seen["out"][1]
    toks = logits.argmax(-1)
    prefix = torch.cat([torch.tensor([[PROMPTS[0][-1]]]), toks, toks[:, -1:]], 1)[:, :BLOCK]
    want = head.block_logits(h, prefix).double()
    f = head.first_slot
    torch.testing.assert_close(logits[0], want[0, f: f + logits.shape[1]])


def test_a_sampled_chain_carries_the_law_of_each_draw(target):
    d = DominoDrafter(random_head(target))
    seen = {}
    real = d.propose

    def propose(seqs, active, temperature, generator):
        trees = real(seqs, active, temperature, generator)
        seen.setdefault("x", (trees, d.last_logits.clone()))
        return trees

    d.propose = propose
    speculative_generate(TargetRunner(target.model), d, [PROMPTS[3]], 4, temperature=0.7,
                         generator=torch.Generator().manual_seed(0))
    trees, logits = seen["x"]
    torch.testing.assert_close(trees[0].q, torch.softmax(logits[0] / 0.7, -1).cpu())


def test_trees_and_long_chains_are_refused(target):
    m = random_head(target)
    with pytest.raises(ValueError, match="chains"):
        DominoDrafter(m, TreeShape("dynamic", depth=2, topk=2, total_tokens=4))
    with pytest.raises(ValueError, match="at most 3"):
        DominoDrafter(m, TreeShape("chain", k=4))


def test_sampling_is_lossless():
    """T = 1: the emitted tokens follow the target's law (the joint law of the first three tokens, χ²), with drafts
    both accepted and rejected."""
    import test_sampling as harness

    model = harness.peaky_model(vocab=harness.V, seed=0, scale=8.0, embed=5.0)
    tgt = Target(model, name="tiny6")
    torch.manual_seed(4)
    cfg = DominoConfig.from_target(tgt, num_layers=1, block_size=BLOCK, aux_layers=(0, 1))
    head = DominoModel(cfg).double().attach(tgt)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))
    d = DominoDrafter(head.eval())
    res = speculative_generate(TargetRunner(model), d, [harness.PROMPT] * harness.N, 3, temperature=1.0,
                               method="chain", generator=torch.Generator().manual_seed(0))
    accepted = sum(sum(s.accepted) for s in res.stats)
    tested = sum(sum(s.tested) for s in res.stats)
    assert 0.05 * tested < accepted < 0.95 * tested
    assert harness.chi2_pvalue(res.tokens, harness.exact_law(model)) > harness.THRESH
