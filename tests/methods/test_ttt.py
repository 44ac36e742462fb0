"""Training-time test: the unrolled attention equals drafting step by step with a KV cache."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from specheads.models.eagle1 import Eagle1Config, Eagle1Model
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.layers import unrolled_attention
from specheads.acceptance_math import chain_tau
from specheads.methods.ttt import (shift_tokens, step_rows, summarize_steps, unroll,
                                    unrolled_accuracy)
from tests.conftest import make_tiny_target

B, T, STEPS = 2, 12, 4


def _eagle3(target):
    torch.manual_seed(3)
    config = Eagle3Config.from_target(target, draft_vocab_size=50, aux_layers=[0, 1, 2])
    model = Eagle3Model(config).attach(target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randperm(target.vocab_size)[:50].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(50), t2d)
    return model


def _eagle1(target):
    torch.manual_seed(4)
    model = Eagle1Model(Eagle1Config.from_target(target)).attach(target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def explicit_unroll(model, h0, ids, steps):
    """Draft a chain from every position at once with model.step and a KV cache.

    Call i appends T entries (one per root t). Root t's entry at call i may see call-0 entries
    of positions <= t and its own entries from calls 1..i.
    """
    cache = model.new_cache()
    h, all_logits = h0, []
    eye = torch.eye(T, dtype=torch.bool)
    for i in range(steps):
        toks = torch.zeros_like(ids)
        toks[:, : T - 1 - i] = ids[:, 1 + i:]
        pos = (torch.arange(T) + i).expand(B, T)
        blocks = [torch.ones(T, T, dtype=torch.bool).tril()] + [eye] * i
        mask = torch.cat(blocks, dim=1).expand(B, T, (i + 1) * T)
        h, logits = model.step(h, toks, pos, mask, cache)
        all_logits.append(logits)
    assert len(cache) == steps * T
    return all_logits


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_unroll_equals_step_api_logits_and_gradients(kind):
    target = make_tiny_target("llama", vocab=120, hidden=64, layers=3)
    model = _eagle3(target) if kind == "eagle3" else _eagle1(target)
    twin = copy.deepcopy(model).attach(target)
    ids = torch.randint(0, 120, (B, T))
    width = 3 * 64 if kind == "eagle3" else 64
    feats = torch.randn(B, T, width)
    weights = [torch.randn(B, T, model.logits(torch.zeros(1, 64)).shape[-1]) for _ in range(STEPS)]

    fast = [model.logits(h) for _, h in unroll(model, model.fuse(feats), ids, STEPS)]
    slow = explicit_unroll(twin, twin.fuse(feats), ids, STEPS)
    for a, b in zip(fast, slow):
        assert_close(a, b, atol=1e-5, rtol=1e-4)

    sum(0.8 ** i * (w * x).sum() for i, (w, x) in enumerate(zip(weights, fast))).backward()
    sum(0.8 ** i * (w * x).sum() for i, (w, x) in enumerate(zip(weights, slow))).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_unrolled_attention_gqa_matches_dense_reference():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8)
    ks = [torch.randn(2, 2, 6, 8) for _ in range(3)]
    vs = [torch.randn(2, 2, 6, 8) for _ in range(3)]
    out = unrolled_attention(q, ks, vs, 8 ** -0.5)
    # Dense reference: a (6, 18) mask over the concatenated keys, heads repeated.
    k = torch.cat(ks, 2).repeat_interleave(2, 1)
    v = torch.cat(vs, 2).repeat_interleave(2, 1)
    mask = torch.cat([torch.ones(6, 6).tril(), torch.eye(6), torch.eye(6)], 1).bool()
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Step 0 alone (one causal block: the fused-kernel path), values and gradients.
    qa, qb = q.clone().requires_grad_(), q.clone().requires_grad_()
    out0 = unrolled_attention(qa, ks[:1], vs[:1], 8 ** -0.5)
    s0 = (qb @ ks[0].repeat_interleave(2, 1).transpose(-1, -2)) * 8 ** -0.5
    ref0 = torch.softmax(s0.masked_fill(~torch.ones(6, 6).tril().bool(), float("-inf")), -1) @ vs[0].repeat_interleave(2, 1)
    assert_close(out0, ref0, atol=1e-5, rtol=1e-5)
    out0.square().sum().backward()
    ref0.square().sum().backward()
    assert_close(qa.grad, qb.grad, atol=1e-5, rtol=1e-5)


def test_shift_and_step_rows():
    ids = torch.arange(6)[None]
    assert shift_tokens(ids, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    batch = {"input_ids": ids, "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}
    # step 0 at t predicts ids[t+2]: trained where loss_mask[t+2] = 1 -> t in {0, 1, 2}
    assert step_rows(batch, 0)[1].tolist() == [0, 1, 2]
    assert step_rows(batch, 2)[1].tolist() == [0]
    assert step_rows(batch, 5)[1].tolist() == []


def test_unrolled_accuracy_counts_and_tau():
    target = make_tiny_target("llama", vocab=120, hidden=64, layers=3)
    model = _eagle1(target)
    ids = torch.randint(0, 120, (B, T))
    feats = torch.randn(B, T, 64)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    # A target that always agrees with the drafter's step-0 guesses: step-0 accuracy must be 1.
    h0 = next(iter(unroll(model, feats, ids, 1)))[1]
    guess = model.logits(h0).argmax(-1)
    argmax = torch.zeros_like(ids)
    argmax[:, 1:] = guess[:, :-1]
    m = unrolled_accuracy(model, feats, batch, argmax, 3)
    assert m["step0_total"] == B * (T - 2) and m["step0_correct"] == m["step0_total"]
    assert m["step2_total"] == B * (T - 4)
    assert m["joint1_correct"] <= m["step1_correct"]
    s = summarize_steps(m)
    assert s["step0_acc"] == 1.0
    assert s["tau_estimate"] == pytest.approx(chain_tau([1.0, s["step1_acc"], s["step2_acc"]], "marginal"))
    assert chain_tau([0.5, 0.5], "marginal") == pytest.approx(1 + 0.5 + 0.25)


class _Oracle:
    """A drafter whose step-i guess at t is ``plan[b, t + 2 + i]`` (token ids as one-hot logits)."""

    num_draft_layers = 1

    def __init__(self, plan, vocab):
        self.plan, self.vocab = plan, vocab

    def decode(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        nxt = torch.zeros_like(input_ids)
        n = input_ids.shape[1]
        shift = int(position_ids[0, 0]) + 2
        nxt[:, : max(n - shift, 0)] = self.plan[:, shift:]
        return F.one_hot(nxt, self.vocab).float()

    def logits(self, h):
        return h

    def to_target_ids(self, ids):
        return ids


def test_unrolled_accuracy_against_data_tokens():
    """data{i}: step i at t scored against ids[t+2+i]; a guess plan equal to the data on row 0 and
    wrong on row 1 gives exactly row 0's assistant positions."""
    V = 50
    ids = torch.randint(1, V, (2, T))
    plan = ids.clone()
    plan[1] = 0  # row 1: never the data token (ids >= 1)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: the first 5 tokens are not trained
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    m = unrolled_accuracy(_Oracle(plan, V), torch.zeros(2, T, 4), batch, torch.zeros_like(ids), 2)
    assert m["data0_total"] == (T - 5) + (T - 2)
    assert m["data0_correct"] == T - 5
    assert m["data1_correct"] == T - 5 and m["data1_total"] == (T - 5) + (T - 3)


def test_unrolled_accuracy_on_the_targets_path():
    """onpath{i}: step i scored only where the input token ids[t+1+i] is the reference (target argmax) at
    t+i. Row 0's inputs are on the path at every position, row 1's at none; the plan is right on both."""
    V = 50
    ids = torch.randint(1, V, (2, T))
    ref = torch.zeros_like(ids)
    ref[0, :-1] = ids[0, 1:]  # row 0: the data is the target's own greedy path
    ref[1, :-1] = 0           # row 1: never (ids >= 1)
    plan = torch.zeros_like(ids)
    plan[0] = ids[0]          # guesses ids[t+2]: the reference at t+1 on row 0
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    m = unrolled_accuracy(_Oracle(plan, V), torch.zeros(2, T, 4), batch, ref, 2)
    assert m["onpath0_total"] == T - 2 and m["onpath0_correct"] == T - 2
    assert m["onpath1_total"] == T - 3 and m["onpath1_correct"] == T - 3
    # row 1 is right too (plan 0 == reference 0) but off the path: counted in step0 only
    assert m["step0_total"] == 2 * (T - 2) and m["step0_correct"] == 2 * (T - 2)


def test_unrolled_attention_saves_no_dense_scores_for_backward():
    """Later unroll steps keep no (B, heads, T, >=T) score or probability tensor for the backward pass (the
    fused kernel saves its output and row statistics), and their gradients match the dense reference."""
    torch.manual_seed(0)
    B, nh, nkv, T, D = 2, 4, 2, 32, 8
    q = torch.randn(B, nh, T, D, requires_grad=True)
    ks = [torch.randn(B, nkv, T, D, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, D, requires_grad=True) for _ in range(3)]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unrolled_attention(q, ks, vs, D ** -0.5)
    assert max(saved) < B * nh * T * T, max(saved)
    out.square().sum().backward()
    grads = [q.grad] + [k.grad for k in ks] + [v.grad for v in vs]
    leaves = [x.detach().clone().requires_grad_() for x in [q] + ks + vs]
    qr, kr, vr = leaves[0], leaves[1:4], leaves[4:]
    k = torch.cat(kr, 2).repeat_interleave(nh // nkv, 1)
    v = torch.cat(vr, 2).repeat_interleave(nh // nkv, 1)
    mask = torch.cat([torch.ones(T, T).tril(), torch.eye(T), torch.eye(T)], 1).bool()
    ref = torch.softmax(((qr @ k.transpose(-1, -2)) * D ** -0.5).masked_fill(~mask, float("-inf")), -1) @ v
    ref.square().sum().backward()
    for g, leaf in zip(grads, leaves):
        assert_close(g, leaf.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unrolled_attention_on_cuda_matches_cpu_without_dense_scores():
    """On CUDA a grouped-query unroll step goes to a fused kernel that takes the mask (the key/value heads
    repeated: the memory-efficient kernel does not take unequal head counts): the CPU values, and a peak
    far below the (B, heads, T, 3T) scores the math fallback would hold."""
    torch.manual_seed(0)
    B, nh, nkv, T, D = 2, 32, 8, 2048, 64
    q = torch.randn(B, nh, T, D, dtype=torch.bfloat16)
    ks = [torch.randn(B, nkv, T, D, dtype=torch.bfloat16) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, D, dtype=torch.bfloat16) for _ in range(3)]
    ref = unrolled_attention(q.float(), [k.float() for k in ks], [v.float() for v in vs], D ** -0.5)
    qc = q.cuda().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = unrolled_attention(qc, [k.cuda() for k in ks], [v.cuda() for v in vs], D ** -0.5)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert peak < B * nh * T * 3 * T * 2 / 4, peak  # a quarter of the bf16 scores alone
