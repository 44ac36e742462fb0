"""Draft forwards are counted, not declared: the decoding loop hooks each drafter's draft network
(``Drafter.draft_modules``) and counts its forward calls per step (``generate.ForwardCounter``).

P-EAGLE and DSpark record one draft forward per step from that count; a drafter that runs its network twice per step
while returning the very drafts of the honest one (all a declaration could go by) is counted twice, and the check
"one draft forward per step" fails on it. The other drafters' counts match what their loops run (a chain of k from
EAGLE or a draft model: k forwards), the target's verification forward never counts (an early exit's decoder copies
the target's, a self-draft runs the target's own), and the hooks are gone after the decode."""

from __future__ import annotations

import copy

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import EarlyExitDrafter, ModelDrafter, NgramDrafter, PromptLookupBranch, TreeShape
from specheads.decoding.dspark_drafter import DSparkDrafter
from specheads.decoding.generate import ForwardCounter, GenerationResult, speculative_generate
from specheads.decoding.head_drafters import EagleDrafter, MedusaDrafter
from specheads.decoding.peagle_drafter import PEagleDrafter
from specheads.decoding.runner import TargetRunner
from specheads.targets import Target

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [4, 4]]
NEW = 12


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # float64; EAGLE-3 style heads fuse three distinct layers


def _noisy(m):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.eval()


def _peagle(target):
    from specheads.models.peagle import PEagleConfig, PEagleModel

    torch.manual_seed(0)
    cfg = PEagleConfig.from_target(target, draft_vocab_size=target.vocab_size, num_layers=2, num_depths=4)
    return _noisy(PEagleModel(cfg).double().attach(target))


def _dspark(target):
    from specheads.models.dspark import DSparkConfig, DSparkModel

    torch.manual_seed(0)
    cfg = DSparkConfig.from_target(target, num_layers=2, block_size=4, markov_rank=8)
    return _noisy(DSparkModel(cfg).double().attach(target))


def _eagle3(target):
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model

    torch.manual_seed(2)
    return _noisy(Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=target.vocab_size)).double()
                  .attach(target))


@pytest.fixture(scope="module")
def heads(target):
    return {"peagle": _peagle(target), "dspark": _dspark(target)}


def assert_one_draft_forward_per_step(res: GenerationResult) -> None:
    """What "one draft forward per step" (P-EAGLE, DSpark) means, checked on the counted forwards."""
    assert res.draft_forwards_by_step == [1] * res.target_forwards, res.draft_forwards_by_step
    assert all(s.draft_forwards == s.steps for s in res.stats), [(s.draft_forwards, s.steps) for s in res.stats]


class TwicePEagle(PEagleDrafter):
    """A planted fault: P-EAGLE's drafts, then one more pass of the draft network whose result is thrown away."""

    def propose(self, seqs, active, temperature, generator):
        trees = super().propose(seqs, active, temperature, generator)
        with torch.no_grad():
            hidden = self.model.mask_state()[None].to(self.dtype)  # (1, 1, H)
            ids = torch.tensor([[int(self.model.config.mask_token_id)]], device=self.device)
            self.model.step(hidden, ids, torch.zeros_like(ids))  # no cache: nothing of the drafter's state moves
        return trees


class TwiceDSpark(DSparkDrafter):
    """A planted fault: DSpark's drafts from a block computed twice (the second forward gives the same states)."""

    def block_states(self, seqs, active):
        super().block_states(seqs, active)
        return super().block_states(seqs, active)


def _drafter(kind, model, twice=False):
    if kind == "peagle":
        return (TwicePEagle if twice else PEagleDrafter)(model)
    return (TwiceDSpark if twice else DSparkDrafter)(model)


@pytest.mark.parametrize("kind", ["peagle", "dspark"])
def test_peagle_and_dspark_count_one_draft_forward_per_step(target, heads, kind):
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    d = _drafter(kind, heads[kind])
    layer = d.draft_modules()[0]
    for batch in ([[p] for p in PROMPTS], [PROMPTS]):  # batch 1, then all rows in one batch
        got = []
        for prompts in batch:
            res = speculative_generate(TargetRunner(target.model), d, prompts, NEW)
            got += res.tokens
            assert_one_draft_forward_per_step(res)
            assert len(res.draft_forwards_by_step) == res.target_forwards > 0
        assert got == ref
    assert not layer._forward_pre_hooks  # the counter's hooks are removed after the decode


@pytest.mark.parametrize("kind", ["peagle", "dspark"])
def test_a_drafter_running_two_forwards_per_step_is_counted_twice(target, heads, kind):
    honest = speculative_generate(TargetRunner(target.model), _drafter(kind, heads[kind]), PROMPTS, NEW)
    faulty = speculative_generate(TargetRunner(target.model), _drafter(kind, heads[kind], twice=True), PROMPTS, NEW)
    # the same drafts, output and steps: nothing the drafter returns tells the two apart
    assert faulty.tokens == honest.tokens and faulty.target_forwards == honest.target_forwards
    assert [s.tested for s in faulty.stats] == [s.tested for s in honest.stats]
    assert faulty.draft_forwards_by_step == [2] * faulty.target_forwards
    assert all(s.draft_forwards == 2 * s.steps for s in faulty.stats)
    with pytest.raises(AssertionError):
        assert_one_draft_forward_per_step(faulty)
    assert_one_draft_forward_per_step(honest)


def test_counts_follow_what_each_drafter_runs(target):
    from specheads.models.medusa import medusa_for_target

    eagle = _eagle3(target)
    torch.manual_seed(1)
    medusa = medusa_for_target(target, num_heads=3).double().eval()
    cases = [(EagleDrafter(eagle, TreeShape("chain", k=3), "eagle3"), 3),  # the pending pairs, then 2 chain steps
             (EagleDrafter(eagle, TreeShape("dynamic", depth=3, topk=2, total_tokens=6), "eagle3"), 3),  # one a level
             (MedusaDrafter(medusa, TreeShape("chain", k=3)), 1),
             (PromptLookupBranch(EagleDrafter(eagle, TreeShape("chain", k=2), "eagle3")), 2),
             (NgramDrafter(k=3), 0)]
    for d, per_step in cases:
        res = speculative_generate(TargetRunner(target.model), d, PROMPTS, NEW)
        assert res.draft_forwards_by_step == [per_step] * res.target_forwards, d.name
        assert [s.draft_forwards for s in res.stats] == [per_step * s.steps for s in res.stats], d.name


def test_drafts_from_the_target_count_the_drafters_forwards_not_the_verification(target):
    """An early exit's decoder is a shallow copy of the target's, sharing its hook table, and a model drafter over the
    target itself hooks the target's own decoder: the verification forward (one per step) counts in neither."""
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    for d in (EarlyExitDrafter(target.model, 2, TreeShape("chain", k=3)),
              ModelDrafter(target.model, TreeShape("chain", k=3), "self")):
        res = speculative_generate(TargetRunner(target.model), d, PROMPTS, NEW)
        assert res.tokens == ref, d.name
        assert res.draft_forwards_by_step == [3] * res.target_forwards, d.name  # the new tokens, then 2 chain steps
        assert not target.model.model._forward_pre_hooks


def test_the_counter_counts_calls_and_removes_its_hooks():
    lin = torch.nn.Linear(2, 2)
    with ForwardCounter([lin, lin]) as c:  # a module named twice is hooked once
        lin(torch.zeros(1, 2)); lin(torch.zeros(1, 2))
    assert c.count == 2 and not lin._forward_pre_hooks
    lin(torch.zeros(1, 2))
    assert c.count == 2
    twin = copy.copy(lin)  # a shallow copy shares the original's hook table
    with ForwardCounter([twin]) as c:
        lin(torch.zeros(1, 2))
        with c.paused():
            twin(torch.zeros(1, 2))
        twin(torch.zeros(1, 2))
    assert c.count == 1 and not lin._forward_pre_hooks
