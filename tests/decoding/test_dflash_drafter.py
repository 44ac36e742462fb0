"""DFlash as a drafter: greedy identity (chain, trees, batches, several blocks), its proposals equal the model's
own block forward on the same context (the training path's mask), sampling stays exact (the χ² harness of
test_sampling.py) and a planted q bug fails it, shapes it cannot draft are refused."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.head_drafters import DFlashDrafter
from specheads.decoding.runner import TargetRunner
from specheads.models.dflash import DFlashConfig, DFlashModel, block_attention_mask
from specheads.targets import Target

BLOCK = 4  # slot 0 the anchor, 3 drafted tokens
PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [4, 4], [7, 1, 60, 33, 12, 9, 9, 40, 2, 17, 5]]
NEW = 18  # several blocks per prompt
SHAPES = [None, TreeShape("chain", k=2), TreeShape("dynamic", depth=3, topk=2, total_tokens=6), TreeShape.fan(3),
          TreeShape("static", choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))]


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # float64: exact comparisons


def random_head(target, seed=0, block=BLOCK, aux_layers=None, noise=0.2) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(target, num_layers=1, block_size=block, aux_layers=aux_layers)
    m = DFlashModel(cfg).double().attach(target)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * noise)
    return m.eval()


@pytest.fixture(scope="module")
def heads(target):
    """A random head and one trained for a few steps on the target's greedy continuations (DFlashMethod.loss)."""
    from specheads.data.features import add_features
    from specheads.methods import build_method
    from specheads.methods.base import ARGMAX_KEY

    method = build_method("dflash", block_size=BLOCK, anchors=12, num_layers=1)
    model = method.build(target).double()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 64, (4,), generator=g).tolist() for _ in range(32)]
    seqs = [r + reference_greedy(target.model, r, 20) for r in rows]
    ids = torch.tensor(seqs)
    lm = torch.zeros_like(ids)
    lm[:, 4:] = 1
    batch = add_features({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}, target,
                         method.feature_spec)
    with torch.no_grad():
        batch[ARGMAX_KEY] = target.model(ids).logits.argmax(-1)  # the labels (the stored features are float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(80):
        out = method.loss(model, batch, target)
        opt.zero_grad(); out.loss.backward(); opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    return {"random": random_head(target), "trained": model.eval()}


@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_speculative_equals_plain_greedy(target, heads, which):
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    taus = {}
    for shape in SHAPES:
        d = DFlashDrafter(heads[which], shape)
        for batch in ([[p] for p in PROMPTS], [PROMPTS]):  # batch 1, then all rows at once
            got = []
            for prompts in batch:
                res = speculative_generate(TargetRunner(target.model), d, prompts, NEW)
                got += res.tokens
                assert all(s.draft_forwards == s.steps for s in res.stats)  # one draft forward per step
            assert got == ref, (which, d.shape.label(), len(batch))
        taus[d.shape.label()] = sum(s.emitted for s in res.stats) / sum(s.steps for s in res.stats)
    if which == "trained":  # the briefly trained head does draft accepted tokens, blocks deep
        assert taus["chain3"] > 1.4, taus
        assert any(len(s.accepted) == 3 and s.accepted[2] > 0 for s in res.stats)  # a block accepted to its end


def _reference_logits(model, seq: list[int], context: torch.Tensor, depth: int) -> torch.Tensor:
    """Slots 1..depth of one block anchored at the last token of ``seq``, drafted from a fresh cache of its whole
    context (``context`` (p, k·H): the target states of positions 0..p-1) with the training path's block mask."""
    p = len(seq) - 1
    assert len(context) == p
    cache = model.new_cache()
    model.extend_context(cache, model.fuse(context[None]), torch.arange(p)[None])
    block = model.block_inputs(torch.tensor([seq[-1]]))
    mask = block_attention_mask(torch.tensor([[p]]), model.block_size, p)
    with torch.no_grad():
        h = model.decode(block, (p + torch.arange(model.block_size))[None], cache, mask)
        return model.logits(h[:, 1: 1 + depth])[0].double()


def _record_proposals(target, model, shape=None, squeeze_slack=None):
    """Decode PROMPTS in one batch; every step's (sequences, active rows, drafter logits, holes in the cache,
    each row's context so far: the target states the drafter was handed)."""
    d = DFlashDrafter(model, shape)
    if squeeze_slack is not None:
        d.squeeze_slack = squeeze_slack
    seen, ctx = [], []
    real_start, real_observe, real_propose = d.start, d.observe, d.propose

    def start(prompts, feats):
        ctx[:] = [feats.hidden_aux[b, : len(p) - 1].clone() for b, p in enumerate(prompts)]
        real_start(prompts, feats)

    def observe(row, tokens, hidden_last, hidden_aux):
        ctx[row] = torch.cat([ctx[row], hidden_aux])
        real_observe(row, tokens, hidden_last, hidden_aux)

    def propose(seqs, active, temperature, generator):
        trees = real_propose(seqs, active, temperature, generator)
        seen.append(([list(s) for s in seqs], list(active), d.last_logits.clone(), (int((~d.ctx_valid).sum()), d.ctx_valid.shape[1], int(d.ctx_valid.sum(1).max())),
                     list(ctx)))
        return trees

    d.start, d.observe, d.propose = start, observe, propose
    speculative_generate(TargetRunner(target.model), d, PROMPTS, NEW)
    return d, seen


def _max_gap(model, seen) -> float:
    gap = 0.0
    for seqs, active, logits, _, ctx in seen:
        for b, s in enumerate(seqs):
            if active[b]:
                want = _reference_logits(model, s, ctx[b], logits.shape[1])
                gap = max(gap, float((logits[b] - want).abs().max()))
    return gap


@pytest.mark.parametrize("squeeze_slack", [None, -10 ** 6])  # the default, or squeezed at every feed
def test_proposals_equal_the_models_own_block_forward(target, heads, squeeze_slack):
    """Batched, cached, with holes (rows accept different lengths) and squeezed caches: the drafter's block
    logits equal one block decoded from the whole context with training's mask (block_attention_mask)."""
    model = heads["trained"]
    d, seen = _record_proposals(target, model, squeeze_slack=squeeze_slack)
    holes, length, longest = zip(*(h for _, _, _, h, _ in seen))
    assert max(holes) > 0  # rows committed different lengths
    squeezed = all(n == m for n, m in zip(length, longest))  # no more slots than the longest row's context
    assert squeezed == (squeeze_slack is not None)
    assert _max_gap(model, seen) < 1e-10
    # The states the drafter was handed are the target's (a decode's verify forwards round RoPE, which
    # transformers computes in float32, a little differently from one forward over the whole sequence).
    seqs, active, logits = seen[-1][:3]
    for b, s in enumerate(seqs):
        if not active[b]:
            continue
        f = target.forward_features(torch.tensor([s[:-1]]), aux_layers=tuple(model.config.aux_layers))
        assert torch.allclose(seen[-1][4][b], torch.cat(f.aux, -1)[0], atol=1e-6)


def test_planted_mask_bugs_break_the_agreement(target, heads, monkeypatch):
    """The agreement test detects a drafter that lets slots see cache holes (padding of shorter rows) or
    attend causally inside the block (training's block is bidirectional)."""
    model = heads["trained"]

    def holes_visible(self, anchor_pos):
        B, bs = len(anchor_pos), self.block
        ctx = self.ctx_pos < anchor_pos[:, None]
        return torch.cat([ctx[:, None, :].expand(B, bs, -1), torch.ones(B, bs, bs, dtype=torch.bool)], 2)

    real = DFlashDrafter.block_mask

    def causal_block(self, anchor_pos):
        m = real(self, anchor_pos).clone()
        m[:, :, -self.block:] &= torch.ones(self.block, self.block, dtype=torch.bool).tril()
        return m

    for bug in (holes_visible, causal_block):
        monkeypatch.setattr(DFlashDrafter, "block_mask", bug)
        _, seen = _record_proposals(target, model)
        assert _max_gap(model, seen) > 1e-3, bug.__name__


def test_shapes_it_cannot_draft_are_refused(target):
    m = random_head(target)
    with pytest.raises(ValueError, match="at most 3"):
        DFlashDrafter(m, TreeShape("chain", k=4))
    with pytest.raises(ValueError, match="at most 3"):
        DFlashDrafter(m, TreeShape("dynamic", depth=4, topk=2, total_tokens=6))
    with pytest.raises(ValueError, match="at most 3"):
        DFlashDrafter(m, TreeShape("static", choices=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))))
    with pytest.raises(ValueError, match="choices"):
        DFlashDrafter(m, TreeShape("static"))
    d = DFlashDrafter(m)
    assert d.shape.k == BLOCK - 1 and d.aux_layers == tuple(m.config.aux_layers)


def test_the_method_hands_out_this_drafter(target):
    from specheads.methods import build_method

    method = build_method("dflash", block_size=BLOCK)
    d = method.drafter(random_head(target), TreeShape("chain", k=2))
    assert isinstance(d, DFlashDrafter) and d.shape.k == 2


def test_sampled_chains_carry_each_slots_distribution(target, heads):
    m = heads["trained"]
    d = DFlashDrafter(m)
    runner = TargetRunner(target.model, d.aux_layers)
    runner.aux_layers = d.aux_layers
    d.start(PROMPTS, runner.prefill(PROMPTS))
    trees = d.propose(PROMPTS, [True] * len(PROMPTS), 0.7, torch.Generator().manual_seed(0))
    for b, t in enumerate(trees):
        assert t.q.shape == (BLOCK - 1, target.vocab_size)
        assert torch.allclose(t.q, torch.softmax(d.last_logits[b] / 0.7, -1))
    greedy = DFlashDrafter(m, TreeShape("dynamic", depth=3, topk=2, total_tokens=6))
    greedy.start(PROMPTS, runner.prefill(PROMPTS))
    assert all(t.q is None for t in greedy.propose(PROMPTS, [True] * len(PROMPTS), 0.7, None))  # trees: target-only walk


# ------------------------------------------------------------------ sampling: the χ² harness of test_sampling.py

@pytest.fixture(scope="module")
def small():
    """test_sampling's vocabulary-6 target and its exact law of the first three tokens; a random DFlash head
    (B = 3: a chain of 2) fusing both target layers."""
    import test_sampling as harness

    target = harness.peaky_model(vocab=harness.V, seed=0, scale=8.0, embed=5.0)
    head = random_head(Target(target, name="tiny6"), seed=4, block=3, aux_layers=(0, 1), noise=1.0)
    return harness, target, head, harness.exact_law(target)


def _sample(harness, target, drafter, method, seed=0):
    res = speculative_generate(TargetRunner(target), drafter, [harness.PROMPT] * harness.N, 3, temperature=1.0,
                               method=method, generator=torch.Generator().manual_seed(seed))
    assert all(len(t) == 3 for t in res.tokens)
    accepted = sum(sum(s.accepted) for s in res.stats)
    tested = sum(sum(s.tested) for s in res.stats)
    assert 0.05 * tested < accepted < 0.95 * tested  # drafts are both accepted and rejected
    return res.tokens


@pytest.mark.parametrize("shape,method", [(None, "chain"), (None, "auto"), (TreeShape("dynamic", depth=2, topk=2,
                                                                                      total_tokens=4), "auto")])
def test_sampling_with_dflash_is_lossless(small, shape, method):
    harness, target, head, exact = small
    assert harness.chi2_pvalue(_sample(harness, target, DFlashDrafter(head, shape), method), exact) > harness.THRESH


def test_planted_bug_q_is_not_the_distribution_drawn_from(small, monkeypatch):
    """The drafter takes each slot's argmax but reports softmax(slot) as q: the harness fails."""
    harness, target, head, exact = small

    def argmax_but_softmax_q(self, logits, temperature, generator):
        return logits.argmax(-1).cpu(), torch.softmax(logits / temperature, -1).cpu()

    monkeypatch.setattr(DFlashDrafter, "draw", argmax_but_softmax_q)
    assert harness.chi2_pvalue(_sample(harness, target, DFlashDrafter(head), "chain"), exact) < harness.THRESH
