"""DSpark as a drafter: greedy speculative decoding equals plain greedy with the confidence schedule off and on
(batch 1 and batched, random and trained heads), the Markov bias follows the drafted prefix, the schedule cuts
chains where the survival of the confidences falls below the threshold, a sampled chain's q is the law each
token was drawn from, and sampling with the schedule on stays exact at T = 1 and T = 0.7 (the χ² harness of
test_sampling.py, plus the first two tokens' law) while a planted off-by-one schedule fails it."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import TreeShape
from specheads.decoding.dspark_drafter import DSparkDrafter
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.models.dspark import DSparkConfig, DSparkModel
from specheads.targets import Target

BLOCK = 4
PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [4, 4], [7, 1, 60, 33, 12, 9, 9, 40, 2, 17, 5]]
NEW = 18


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # float64: exact comparisons


def random_head(target, seed=0, noise=0.2) -> DSparkModel:
    torch.manual_seed(seed)
    m = DSparkModel(DSparkConfig.from_target(target, num_layers=1, block_size=BLOCK, markov_rank=8)).double()
    m.attach(target)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * noise)
    return m.eval()


@pytest.fixture(scope="module")
def heads(target):
    """A random head and one trained for a few steps on the target's greedy continuations (DSparkMethod.loss)."""
    from specheads.data.features import add_features
    from specheads.methods import build_method
    from specheads.methods.base import ARGMAX_KEY

    method = build_method("dspark", block_size=BLOCK, anchors=12, num_layers=1, markov_rank=16)
    model = method.build(target).double()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 64, (4,), generator=g).tolist() for _ in range(32)]
    ids = torch.tensor([r + reference_greedy(target.model, r, 20) for r in rows])
    lm = torch.zeros_like(ids)
    lm[:, 4:] = 1
    batch = add_features({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}, target,
                         method.feature_spec)
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    with torch.no_grad():
        batch[ARGMAX_KEY] = target.model(ids).logits.argmax(-1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(80):
        out = method.loss(model, batch, target)
        opt.zero_grad(); out.loss.backward(); opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses
    return {"random": random_head(target), "trained": model.eval()}


@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("threshold", [None, 0.3, 0.9])
def test_greedy_speculative_equals_plain_greedy(target, heads, which, threshold):
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    for shape in (None, TreeShape("chain", k=2)):
        d = DSparkDrafter(heads[which], shape, threshold)
        for batch in ([[p] for p in PROMPTS], [PROMPTS]):
            got = []
            for prompts in batch:
                res = speculative_generate(TargetRunner(target.model), d, prompts, NEW)
                got += res.tokens
                assert all(s.draft_forwards == s.steps for s in res.stats)  # one block forward per step
            assert got == ref, (which, threshold, d.shape.label(), len(batch))
    if which == "trained" and threshold is None:
        d = DSparkDrafter(heads[which])
        res = speculative_generate(TargetRunner(target.model), d, PROMPTS, NEW)
        assert sum(s.emitted for s in res.stats) / sum(s.steps for s in res.stats) > 1.4


def test_the_markov_bias_follows_the_drafted_prefix(target, heads):
    model = heads["random"]
    d2 = DSparkDrafter(model)
    seqs = [PROMPTS[0]]
    recorded = {}
    real = d2.markov_chain

    def spy(h, anchors, temperature, generator):
        out = real(h, anchors, temperature, generator)
        recorded.update(h=h, anchors=anchors, out=out)
        return out

    d2.markov_chain = spy
    speculative_generate(TargetRunner(target.model), d2, seqs, 2)
    toks, prev, logits, _ = recorded["out"]
    h = recorded["h"]
    assert prev[0, 0] == recorded["anchors"][0] and torch.equal(prev[0, 1:], toks[0, :-1])
    for j in range(toks.shape[1]):
        want = model.logits(h[:, j]).double() + model.markov_bias(prev[:, j]).double()
        torch.testing.assert_close(logits[:, j], want)
        assert int(toks[0, j]) == int(want[0].argmax())


def test_the_schedule_cuts_where_the_survival_falls_below_the_threshold(target, heads):
    model = heads["random"]
    d = DSparkDrafter(model, None, threshold=0.42)
    conf = torch.tensor([[0.9, 0.5, 0.9], [0.1, 0.9, 0.9], [0.95, 0.95, 0.95]], dtype=torch.float64)
    d.model = type("M", (), {"confidence": staticmethod(lambda h, prev: conf)})()
    assert d.scheduled_lengths(None, None) == [2, 1, 3]  # survivals (.9 .45 .405), (.1 ..): at least one


def test_a_sampled_chain_carries_the_law_of_each_draw(target, heads):
    model = heads["trained"]
    d = DSparkDrafter(model)
    # the first proposal of a real decode: its chain's q against the biased logits it was drawn from
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
    q = trees[0].q
    torch.testing.assert_close(q, torch.softmax(logits[0] / 0.7, -1).cpu())
    assert all(q[j, int(t)] > 0 for j, t in enumerate(trees[0].tokens))


def test_trees_and_a_headless_schedule_are_refused(target):
    m = random_head(target)
    with pytest.raises(ValueError, match="chains"):
        DSparkDrafter(m, TreeShape("dynamic", depth=2, topk=2, total_tokens=4))
    with pytest.raises(ValueError, match="at most 3"):
        DSparkDrafter(m, TreeShape("chain", k=4))
    with pytest.raises(ValueError, match="threshold"):
        DSparkDrafter(m, None, threshold=1.5)
    cfg = DSparkConfig.from_target(target, num_layers=1, block_size=BLOCK, markov_rank=8)
    cfg.enable_confidence_head = False
    with pytest.raises(ValueError, match="confidence head"):
        DSparkDrafter(DSparkModel(cfg).double().attach(target), None, threshold=0.5)


def test_the_method_hands_out_this_drafter_cut_to_the_block(target, heads):
    from specheads.methods import build_method

    d = build_method("dspark", block_size=BLOCK).drafter(heads["random"], TreeShape("chain", k=9))
    assert isinstance(d, DSparkDrafter) and d.shape.k == BLOCK - 1 and d.threshold is None


# ------------------------------------------------------------------ sampling: the χ² harness of test_sampling.py

@pytest.fixture(scope="module")
def small():
    """test_sampling's vocabulary-6 target; a random DSpark head (B = 4: a chain of 3) whose confidence reads
    mostly the previous token (the Markov part of ``confidence_head.proj`` scaled up: sharply high after some
    tokens, low after others), so that the schedule cuts chains after 1, 2 or 3 drafts depending on what was
    drafted."""
    import test_sampling as harness

    target = harness.peaky_model(vocab=harness.V, seed=0, scale=8.0, embed=5.0)
    tgt = Target(target, name="tiny6")
    torch.manual_seed(4)
    cfg = DSparkConfig.from_target(tgt, num_layers=1, block_size=BLOCK, aux_layers=(0, 1), markov_rank=4)
    head = DSparkModel(cfg).double().attach(tgt)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))
        head.confidence_head.proj.weight[:, cfg.hidden_size:].mul_(10.0)
    return harness, target, head.eval()


def _exact_law(harness, target, temperature: float) -> torch.Tensor:
    """(V, V, V) exact probabilities of the first three tokens at ``temperature`` (harness.exact_law's, at T)."""
    V, L = harness.V, len(harness.PROMPT)
    seqs = torch.tensor([harness.PROMPT + list(c) for c in itertools.product(range(V), repeat=3)])
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.double() / temperature, -1)
    cols = [logp[torch.arange(len(seqs)), L - 1 + i, seqs[:, L + i]] for i in range(3)]
    return torch.exp(sum(cols)).reshape(V, V, V)


def _pair_pvalue(samples: list[list[int]], exact: torch.Tensor) -> float:
    """Pearson χ² of the first two tokens (36 cells, fewer than the joint test's 216: more power at position 2,
    where a schedule's cut acts first) against the marginal of ``exact``; cells expecting < 5 pooled."""
    counts = torch.zeros(exact.shape[:2], dtype=torch.float64)
    for s in samples:
        counts[s[0], s[1]] += 1
    e, o = (exact.sum(-1) * len(samples)).flatten(), counts.flatten()
    small = e < 5
    e = torch.cat([e[~small], e[small].sum()[None]])
    o = torch.cat([o[~small], o[small].sum()[None]])
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2.0), stat / 2))


def _sample_scheduled(harness, target, head, temperature, threshold=0.5, seed=0):
    """Decode 3 tokens for N copies of the prompt with the schedule on -> (tokens, size of every verified chain);
    checks drafts are both accepted and rejected."""
    d = DSparkDrafter(head, None, threshold)
    sizes: list[int] = []
    real = d.propose

    def propose(seqs, active, temperature, generator):
        trees = real(seqs, active, temperature, generator)
        sizes.extend(t.size for t, a in zip(trees, active) if a)
        return trees

    d.propose = propose
    res = speculative_generate(TargetRunner(target), d, [harness.PROMPT] * harness.N, 3, temperature=temperature,
                               method="chain", generator=torch.Generator().manual_seed(seed))
    assert all(len(t) == 3 for t in res.tokens)
    accepted = sum(sum(s.accepted) for s in res.stats)
    tested = sum(sum(s.tested) for s in res.stats)
    assert 0.05 * tested < accepted < 0.95 * tested  # drafts are both accepted and rejected
    return res.tokens, sizes


def _lossless_pvalue(harness, tokens, exact) -> float:
    """The check: the joint law of the first three tokens (harness.chi2_pvalue) and the pairs' law; the smaller
    p-value (a correct sampler fails it with probability at most 2 x THRESH)."""
    return min(harness.chi2_pvalue(tokens, exact), _pair_pvalue(tokens, exact))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_with_the_confidence_schedule_is_lossless(small, temperature):
    """At T > 0 the schedule cuts sampled chains by the confidences of the drafted prefix (c_j reads x_{j-1},
    never x_j): the emitted tokens follow the target's law. The schedule does act: chains of 1, 2 and 3 drafts
    are each verified in at least a tenth of the proposals (unscheduled, every chain has 3)."""
    harness, target, head = small
    tokens, sizes = _sample_scheduled(harness, target, head, temperature)
    for n in (1, 2, 3):
        assert sizes.count(n) > 0.1 * len(sizes), (n, {k: sizes.count(k) for k in (1, 2, 3)})
    assert _lossless_pvalue(harness, tokens, _exact_law(harness, target, temperature)) > harness.THRESH


def test_planted_bug_the_schedule_reads_each_slots_own_draft(small, monkeypatch):
    """Off by one: the schedule reads c_j with the token drafted in slot j (not the one before it), so whether
    x_j is verified depends on x_j itself; a verified x_j then follows q cut to the confident tokens, not the q
    verification divides by, and the draft's law leaks into the output: the same check fails."""
    harness, target, head = small
    real_chain, real_lengths = DSparkDrafter.markov_chain, DSparkDrafter.scheduled_lengths

    def chain_kept(self, h, anchors, temperature, generator):
        out = self.drafted = real_chain(self, h, anchors, temperature, generator)
        return out

    def lengths_from_own_drafts(self, h, prev):
        return real_lengths(self, h, self.drafted[0])

    monkeypatch.setattr(DSparkDrafter, "markov_chain", chain_kept)
    monkeypatch.setattr(DSparkDrafter, "scheduled_lengths", lengths_from_own_drafts)
    tokens, sizes = _sample_scheduled(harness, target, head, 1.0)
    assert len(set(sizes)) == 3  # the buggy schedule cuts too
    assert _lossless_pvalue(harness, tokens, _exact_law(harness, target, 1.0)) < harness.THRESH
