"""DSpark as a drafter: greedy speculative decoding equals plain greedy with the confidence schedule off and on
(batch 1 and batched, random and trained heads), the Markov bias follows the drafted prefix, the schedule cuts
chains where the survival of the confidences falls below the threshold, and a sampled chain's q is the law each
token was drawn from."""

from __future__ import annotations

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
