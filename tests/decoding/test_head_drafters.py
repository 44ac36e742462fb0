"""Medusa and EAGLE-1/3 drafters: greedy exactness, and drafts equal to a cache-free recomputation."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.head_drafters import EagleDrafter, MedusaDrafter
from specheads.decoding.runner import TargetRunner
from specheads.targets import Target

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return Target(peaky_model(layers=4), name="tiny")  # EAGLE-3 fuses three distinct layers


def _medusa(target):
    from specheads.models.medusa import medusa_for_target

    heads = medusa_for_target(target, num_heads=3).double()
    torch.manual_seed(1)
    with torch.no_grad():
        for b in heads.blocks:
            for layer in b.layers:
                layer.weight.normal_(0, 0.3)
    return heads


NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}  # speculators' options


def _eagle(target, kind, **norms):
    torch.manual_seed(2)
    if kind == "eagle1":
        from specheads.models.eagle1 import Eagle1Config, Eagle1Model

        m = Eagle1Model(Eagle1Config.from_target(target)).double().attach(target)
    else:
        from specheads.models.eagle3 import Eagle3Config, Eagle3Model
        from specheads.models.vocab import build_draft_vocab

        m = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=40, **norms)).double().attach(target)
        counts = torch.arange(target.vocab_size).flip(0).double() + (torch.arange(target.vocab_size) % 3) * 50
        d2t, t2d = build_draft_vocab(counts.long(), 40)
        m.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.eval()


def _drafters(target):
    heads = _medusa(target)
    yield MedusaDrafter(heads, TreeShape("chain", k=3))
    yield MedusaDrafter(heads, TreeShape("static", choices=tuple([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])))
    for kind in ("eagle1", "eagle3"):
        m = _eagle(target, kind)
        yield EagleDrafter(m, TreeShape("chain", k=3), kind)
        yield EagleDrafter(m, TreeShape("dynamic", depth=3, topk=2, total_tokens=6), kind)
    yield EagleDrafter(_eagle(target, "eagle3", **NORMS), TreeShape("dynamic", depth=3, topk=2, total_tokens=6),
                       "eagle3")


def test_greedy_exact_with_head_drafters(target):
    ref = [reference_greedy(target.model, p, 14) for p in PROMPTS]
    for d in _drafters(target):
        res = speculative_generate(TargetRunner(target.model), d, PROMPTS, 14)
        assert res.tokens == ref, (d.name, d.shape)
        assert all(s.steps > 0 and sum(s.tested) > 0 for s in res.stats)


def test_medusa_chain_is_heads_argmax(target):
    heads = _medusa(target)
    d = MedusaDrafter(heads, TreeShape("chain", k=3))
    runner = TargetRunner(target.model)
    feats = runner.prefill(PROMPTS)
    d.start(PROMPTS, feats)
    tree = d.propose(PROMPTS, [True, True], 0.0, None)[1]
    with torch.no_grad():
        last = target.model.model(torch.tensor([PROMPTS[1][:-1]])).last_hidden_state[0, -1]
        want = heads(last[None, None])[:, 0, 0].argmax(-1)
    assert tree.tokens.tolist() == want.tolist()


@pytest.mark.parametrize("kind,norms", [("eagle1", {}), ("eagle3", {}), ("eagle3", NORMS)])
def test_eagle_chain_matches_cache_free_unroll(target, kind, norms):
    """The cached, batched drafter proposes what a plain causal unroll of the model proposes (EAGLE-3 with
    speculators' normalisations too: the state fed back is what ``step`` returns)."""
    m = _eagle(target, kind, **norms)
    d = EagleDrafter(m, TreeShape("chain", k=3), kind)
    runner = TargetRunner(target.model, d.aux_layers)
    runner.aux_layers = d.aux_layers
    feats = runner.prefill(PROMPTS)
    d.start(PROMPTS, feats)
    trees = d.propose(PROMPTS, [True, True], 0.0, None)
    for b, p in enumerate(PROMPTS):
        ids = torch.tensor([p[:-1]])
        f = target.forward_features(ids, aux_layers=d.aux_layers)
        h = m.fuse(torch.cat(f.aux, -1) if kind == "eagle3" else f.last)
        toks, nxt = [], torch.tensor([p[1:]])
        with torch.no_grad():
            for _ in range(3):
                h_out, logits = m.step(h, nxt, torch.arange(h.shape[1])[None])
                t = m.to_target_ids(logits[0, -1].argmax())
                toks.append(int(t))
                h = torch.cat([h, h_out[:, -1:]], 1)
                nxt = torch.cat([nxt, t.view(1, 1)], 1)
        assert trees[b].tokens.tolist() == toks
        assert trees[b].q is None  # greedy verification reads tokens only: no (k, V) distribution is built
    # Sampling: each draft carries its distribution over the target vocabulary (p/q verification).
    d.start(PROMPTS, runner.prefill(PROMPTS))
    sampled = d.propose(PROMPTS, [True, True], 1.0, torch.Generator().manual_seed(0))
    for t in sampled:
        assert t.q.shape == (3, target.vocab_size)
        assert torch.allclose(t.q.sum(-1), torch.ones(3, dtype=t.q.dtype))


def _tree_log(drafter):
    """Wrap ``drafter.propose`` to record, per step, each active row's (tokens, parents)."""
    log, real = [], drafter.propose

    def propose(seqs, active, *a):
        trees = real(seqs, active, *a)
        log.append({b: (t.tokens.tolist(), t.parents.tolist()) for b, t in enumerate(trees) if active[b]})
        return trees
    drafter.propose = propose
    return log


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_eagle_trees_drafted_in_a_batch_are_each_rows_own(target, kind):
    """A batch of rows at different lengths (and so with different numbers of pending features each step) gets,
    row for row, the dynamic trees each row drafts alone: the batch's inputs are gathered without mixing rows."""
    m = _eagle(target, kind)
    shape = TreeShape("dynamic", depth=3, topk=2, total_tokens=6)
    prompts = PROMPTS + [[4, 4, 8, 1, 9, 9, 3, 2, 2, 6, 1], [7, 3]]
    batched = EagleDrafter(m, shape, kind)
    log = _tree_log(batched)
    speculative_generate(TargetRunner(target.model), batched, prompts, 10, verify_backend="torch")
    for b, p in enumerate(prompts):
        alone = EagleDrafter(m, shape, kind)
        own = _tree_log(alone)
        speculative_generate(TargetRunner(target.model), alone, [p], 10)
        mine = [step[b] for step in log if b in step]
        assert mine == [step[0] for step in own] and len(mine) >= 2
