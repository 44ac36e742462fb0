"""P-EAGLE as a drafter: greedy speculative decoding equals plain greedy (batch 1 and batched, random and trained
heads), one draft forward per step, its proposals equal the model's own parallel forward from a fresh context,
sampling stays exact (the chi-square harness of test_sampling.py), shapes it cannot draft are refused."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.peagle_drafter import PEagleDrafter
from specheads.decoding.runner import TargetRunner
from specheads.models.peagle import PEagleConfig, PEagleModel
from specheads.models.vocab import build_draft_vocab
from specheads.targets import Target

K = 4
PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [4, 4], [7, 1, 60, 33, 12, 9, 9, 40, 2, 17, 5]]
NEW = 16


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # float64: exact comparisons


def random_head(target, seed=0, num_layers=2, draft_vocab=40, noise=0.2) -> PEagleModel:
    torch.manual_seed(seed)
    cfg = PEagleConfig.from_target(target, draft_vocab_size=draft_vocab, num_layers=num_layers, num_depths=K)
    m = PEagleModel(cfg).double().attach(target)
    counts = torch.arange(target.vocab_size).flip(0) + (torch.arange(target.vocab_size) % 3) * 50
    d2t, t2d = build_draft_vocab(counts.long(), draft_vocab)
    m.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * noise)
    return m.eval()


@pytest.fixture(scope="module")
def heads(target):
    """A random head and one trained for a few steps on the target's greedy continuations (PEagleMethod.loss)."""
    from specheads.data.features import add_features
    from specheads.methods import build_method
    from specheads.methods.base import ARGMAX_KEY

    V = target.vocab_size
    method = build_method("peagle", num_depths=K, draft_vocab_size=V, ratio_min=0.5,
                          vocab_data=[{"input_ids": list(range(V)), "loss_mask": [1] * V}])
    model = method.build(target).double()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, V, (4,), generator=g).tolist() for _ in range(32)]
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
    for _ in range(60):
        out = method.loss(model, batch, target)
        opt.zero_grad(); out.loss.backward(); opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    return {"random": random_head(target), "trained": model.eval()}


@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_speculative_equals_plain_greedy(target, heads, which):
    ref = [reference_greedy(target.model, p, NEW) for p in PROMPTS]
    taus, stats = {}, {}
    for shape in (None, TreeShape("chain", k=2), TreeShape("chain", k=1)):
        d = PEagleDrafter(heads[which], shape)
        for batch in ([[p] for p in PROMPTS], [PROMPTS]):  # batch 1, then all rows at once
            got = []
            for prompts in batch:
                res = speculative_generate(TargetRunner(target.model), d, prompts, NEW)
                got += res.tokens
                assert all(s.draft_forwards == s.steps for s in res.stats)  # one draft forward per step
            assert got == ref, (which, d.shape.label(), len(batch))
        taus[d.shape.label()] = sum(s.emitted for s in res.stats) / sum(s.steps for s in res.stats)
        stats[d.shape.label()] = res.stats
    if which == "trained":  # the briefly trained head drafts accepted tokens beyond the first depth
        assert taus[f"chain{K}"] > 1.4, taus
        assert any(s.accepted[1] > 0 for s in stats[f"chain{K}"])


def _reference_logits(model, seq: list[int], context: torch.Tensor, k: int) -> torch.Tensor:
    """Depths 0..k-1 drafted from scratch: one causal forward over every verified (state, next token) pair of
    ``seq`` (``context`` (p, n_aux·H): the target states of positions 0..p-1, p = len(seq) - 1) and k-1 slots."""
    p = len(seq) - 1
    hid = torch.cat([model.fuse(context), model.mask_state().expand(k - 1, -1)])[None]
    tok = torch.tensor(seq[1:] + [int(model.config.mask_token_id)] * (k - 1))[None]
    with torch.no_grad():
        _, logits = model.step(hid, tok, torch.arange(p + k - 1)[None])
    return logits[0, p - 1:].double()


def test_proposals_equal_the_models_own_forward_from_scratch(target, heads):
    """Batched and cached (rows accept different lengths): each step's logits equal a fresh forward over the
    whole context, so no mask slot of an earlier step stays in the drafter's cache."""
    model = heads["trained"]
    d = PEagleDrafter(model)
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
        seen.append(([list(s) for s in seqs], list(active), d.last_logits.clone(), list(ctx)))
        return trees

    d.start, d.observe, d.propose = start, observe, propose
    res = speculative_generate(TargetRunner(target.model), d, PROMPTS, NEW)
    assert len({tuple(s.accepted) for s in res.stats}) > 1  # rows accepted differently
    gap = 0.0
    for seqs, active, logits, context in seen:
        for b, s in enumerate(seqs):
            if active[b]:
                gap = max(gap, float((logits[b] - _reference_logits(model, s, context[b], K)).abs().max()))
    assert gap < 1e-9


@pytest.mark.parametrize("method", ["chain", "auto"])
def test_sampling_with_peagle_is_lossless(method):
    """test_sampling's vocabulary-6 target and exact law of the first three tokens; a random P-EAGLE head (K=2,
    its full vocabulary as the draft vocabulary) drafting chains at T=1: the chi-square test passes."""
    import test_sampling as harness

    small = harness.peaky_model(vocab=harness.V, seed=0, scale=8.0, embed=5.0)
    tgt = Target(small, name="tiny6")
    torch.manual_seed(4)
    cfg = PEagleConfig.from_target(tgt, draft_vocab_size=harness.V, aux_layers=(0, 1), num_depths=2)
    head = PEagleModel(cfg).double().attach(tgt)
    head.set_draft_vocab(torch.zeros(harness.V, dtype=torch.long), torch.ones(harness.V, dtype=torch.bool))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))
    res = speculative_generate(TargetRunner(small), PEagleDrafter(head.eval()), [harness.PROMPT] * harness.N, 3,
                               temperature=1.0, method=method, generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 3 for t in res.tokens)
    accepted, tested = sum(sum(s.accepted) for s in res.stats), sum(sum(s.tested) for s in res.stats)
    assert 0.05 * tested < accepted < 0.95 * tested  # drafts are both accepted and rejected
    assert harness.chi2_pvalue(res.tokens, harness.exact_law(small)) > harness.THRESH


def test_shapes_it_cannot_draft_are_refused(target):
    m = random_head(target)
    with pytest.raises(ValueError, match="trained to draft 4"):
        PEagleDrafter(m, TreeShape("chain", k=5))
    with pytest.raises(ValueError, match="chain"):
        PEagleDrafter(m, TreeShape("dynamic", depth=3, topk=2, total_tokens=6))
    d = PEagleDrafter(m)
    assert d.shape.k == K and d.name == "peagle" and d.aux_layers == tuple(m.config.aux_layers)


def test_the_method_hands_out_this_drafter_cut_to_its_depths(target, heads):
    from specheads.methods.peagle import PEagleMethod

    model = heads["random"]
    assert PEagleMethod.drafter(model, TreeShape("chain", k=2)).shape.k == 2
    assert PEagleMethod.drafter(model, TreeShape("chain", k=K + 3)).shape.k == K  # training asks for longer chains
