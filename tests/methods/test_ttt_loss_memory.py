"""``methods.ttt.ttt_loss`` without per-step copies of the target's distributions: each step's labels
``rows.probs[idx]`` (times the off-path weights) are gathered a chunk at a time inside the loss
(``losses.linear_soft_cross_entropy`` through EAGLE-3's linear head, ``soft_cross_entropy(index=...)`` otherwise).

The loss, the per-step stats and every gradient equal the old formula's (kept here, not in the package: each step
copied ``rows.probs[idx]`` and ran ``soft_cross_entropy`` on it), float64 to 1e-10 and float32 to rounding; and
nothing of one step's (N, V) labels is kept for backward (saved tensors counted by ``saved_tensors_hooks``, live
tensors by the garbage collector), which the old formula fails.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from specheads.methods import ttt
from specheads.methods.losses import feature_loss, linear_soft_cross_entropy, pad_rows, soft_cross_entropy
from specheads.methods.ttt import StepStats, TargetRows, step_rows, ttt_loss, unroll
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from tests.conftest import make_tiny_target

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5)}


# -- the old formula (the package's before the labels were gathered lazily), the reference ---------------------------

def _old_soft_ce_chunk(head, h, p, lk_weight=0.0):
    z = head(pad_rows(h))[: h.shape[0]]
    # ``.float()`` in the package then: float32 logits even in a float64 head. Float32 and 16-bit logits are taken
    # as they were; float64 ones stay float64 here (as the new path keeps them), so float64 compares to 1e-10.
    logp = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)
    loss = -(p * logp).sum(-1)
    if lk_weight:
        accept = -torch.log(torch.minimum(p, logp.exp()).sum(-1).clamp_min(1e-12))
        loss = (1 - lk_weight) * loss + lk_weight * accept
    return loss.sum(), logp.argmax(-1)


def _old_soft_cross_entropy(head, hidden, probs, chunk=2048, lk_weight=0.0):
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.empty(0, dtype=torch.long)
    if hidden.shape[0] <= chunk:
        return _old_soft_ce_chunk(head, hidden, probs, lk_weight)
    total, preds = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32)), []  # as above
    for s in range(0, hidden.shape[0], chunk):
        loss, pred = checkpoint(_old_soft_ce_chunk, head, hidden[s:s + chunk], probs[s:s + chunk], lk_weight,
                                use_reentrant=False)
        total, preds = total + loss, preds + [pred]
    return total, torch.cat(preds)


def _old_ttt_loss(model, hidden, batch, rows, steps, decay=0.8, chunk=2048, feature_weight=0.0,
                  offpath_weight=1.0, lk_weight=0.0):
    total, stats = None, []
    for i, h_out in unroll(model, hidden, batch["input_ids"], steps):
        b, t = step_rows(batch, i)
        keep = rows.in_vocab[b, t + 1 + i]
        b, t = b[keep], t[keep]
        idx = rows.row_of[b, t + 1 + i]
        probs, n = rows.probs[idx], b.numel()  # the per-step (N, V) copy
        denom = float(max(n, 1))
        if offpath_weight != 1.0:
            offpath = (rows.row_of[b, t + i] >= 0) & (batch["input_ids"][b, t + 1 + i] != rows.argmax[b, t + i])
            weight = torch.where(offpath, offpath_weight, 1.0).to(probs.dtype)
            probs = probs * weight[:, None]
            denom = max(float(weight.sum()), 1e-6)
        loss_sum, pred = _old_soft_cross_entropy(model.logits, h_out[b, t], probs, chunk=chunk, lk_weight=lk_weight)
        step_loss = loss_sum / denom
        if feature_weight:
            true = batch["hidden_last"][b, t + 1 + i]
            step_loss = step_loss + feature_weight * feature_loss(model.normed(h_out[b, t]), true) / max(n, 1)
        correct = int((model.to_target_ids(pred) == rows.argmax[b, t + 1 + i]).sum())
        stats.append(StepStats(step_loss.detach(), correct, n))
        term = decay ** i * step_loss + 0.0 * h_out.sum() if total is None else decay ** i * step_loss
        total = term if total is None else total + term
    return total, stats


# -- fixtures ------------------------------------------------------------------------------------------------------

def _eagle3(dtype, vocab=120, draft_vocab=50, hidden=48):
    target = make_tiny_target("llama", vocab=vocab, hidden=hidden, layers=3, heads=6, kv_heads=2)
    torch.manual_seed(3)
    model = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=draft_vocab, aux_layers=[0, 1, 2]))
    model = model.attach(target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(draft_vocab), t2d)
    return model.to(dtype)


def _data(model, B, T, dtype, seed=11):
    """Features, a batch with some rows out of the loss (so each step's rows differ) and TargetRows whose
    argmaxes are mostly in the draft vocabulary and often the data's own next token (on-path rows)."""
    g = torch.Generator().manual_seed(seed)
    V, H, Vd = model.config.vocab_size, model.config.hidden_size, model.config.draft_vocab_size
    draft_targets = model.to_target_ids(torch.arange(Vd))
    ids = draft_targets[torch.randint(0, Vd, (B, T), generator=g)]
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).float()
    attention = torch.ones(B, T)
    attention[1, T - 3:] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention,
             "hidden_last": torch.randn(B, T, H, generator=g, dtype=dtype)}
    need = torch.zeros(B, T, dtype=torch.bool)
    need[:, : T - 1] = (loss_mask[:, 1:] > 0) & (attention[:, 1:] > 0)
    n = int(need.sum())
    probs = torch.softmax(3 * torch.randn(n, Vd, generator=g), -1)
    probs[0, :] = 0.0  # a row of zeros and exact zeros elsewhere: the acceptance term's clamp and min's ties
    probs[1, : Vd // 2] = 0.0
    argmax = torch.randint(0, V, (B, T), generator=g)  # some outside the draft vocabulary
    onpath = torch.rand(B, T, generator=g) < 0.5
    argmax[:, :-1] = torch.where(onpath[:, :-1], ids[:, 1:], argmax[:, :-1])
    row_of = torch.full((B, T), -1, dtype=torch.long)
    row_of[need] = torch.randperm(n, generator=g)  # the table's rows in no particular order
    feats = torch.randn(B, T, 3 * H, generator=g, dtype=dtype)
    return feats, batch, TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)


def _loss_stats_grads(fn, model, feats, batch, rows, steps, **kw):
    model.zero_grad()
    feats = feats.clone().requires_grad_()
    loss, stats = fn(model, model.fuse(feats), batch, rows, steps, **kw)
    loss.backward()
    grads = {"features": feats.grad}
    grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return loss.detach(), stats, grads


def _assert_same(new, old, tol):
    assert_close(new[0], old[0].to(new[0].dtype), **tol)
    assert len(new[1]) == len(old[1])
    for i, (a, b) in enumerate(zip(new[1], old[1])):
        assert (a.correct, a.total) == (b.correct, b.total), i
        assert_close(a.loss, b.loss.to(a.loss.dtype), **tol, msg=lambda m: f"step {i}: {m}")
    assert new[2].keys() == old[2].keys()
    for name in new[2]:
        assert_close(new[2][name], old[2][name], **tol, msg=lambda m: f"{name}: {m}")


OPTIONS = {"plain": {}, "offpath": {"offpath_weight": 0.3}, "lk": {"lk_weight": 0.4},
           "feature": {"feature_weight": 0.5, "decay": 0.7}}


@pytest.mark.parametrize("linear_head", [True, False], ids=["linear-head", "any-head"])
@pytest.mark.parametrize("chunk", [16, 2048], ids=["chunked", "one-chunk"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ttt_loss_stats_and_gradients_equal_the_old_formula(monkeypatch, dtype, option, chunk, linear_head):
    """A 3-step EAGLE-3 loss, batch 2, T = 23, rows left out by the loss mask and padding: loss, each step's loss,
    accuracy counts and the gradient of every parameter and of the features equal the old per-step-copy formula's:
    float64 to 1e-10, float32 to rounding; through the linear head's path and the generic head's
    (``soft_cross_entropy(index=...)``; its float64 logits are float32 as before, so float32's tolerance)."""
    model = _eagle3(dtype)
    feats, batch, rows = _data(model, 2, 23, dtype)
    if not linear_head:
        monkeypatch.setattr(ttt, "_linear_head", lambda model: None)
    kw = dict(OPTIONS[option], chunk=chunk)
    new = _loss_stats_grads(ttt_loss, model, feats, batch, rows, 3, **kw)
    old = _loss_stats_grads(_old_ttt_loss, model, feats, batch, rows, 3, **kw)
    assert new[2]["lm_head.weight"].abs().sum() > 0
    _assert_same(new, old, TOL[dtype if linear_head else torch.float32])


def test_the_linear_head_path_is_taken_for_eagle3():
    assert ttt._linear_head(_eagle3(torch.float32)) is not None


@pytest.mark.parametrize("lk_weight", [0.0, 0.5])
def test_linear_soft_cross_entropy_equals_soft_cross_entropy_with_softcap_and_bias(lk_weight):
    """Through a biased, soft-capped layer (float64), chunked: the loss, argmax and the gradients of hidden, weight
    and bias equal ``soft_cross_entropy`` on the gathered, weighted labels."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(90, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(90, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.softmax(torch.randn(50, 90, generator=g), -1)
    index = torch.randint(0, 50, (37,), generator=g)
    row_weight = torch.rand(37, generator=g)

    def head(h):
        return torch.tanh(torch.nn.functional.linear(h, weight, bias) / 2.0) * 2.0

    got, pred = linear_soft_cross_entropy(hidden, weight, table, index, row_weight, bias, softcap=2.0, chunk=10,
                                          lk_weight=lk_weight)
    grads = torch.autograd.grad(got, (hidden, weight, bias))
    want, want_pred = _old_soft_ce_chunk(head, hidden, table[index] * row_weight[:, None], lk_weight)
    want_grads = torch.autograd.grad(want, (hidden, weight, bias))
    assert_close(got, want, **TOL[torch.float64])
    assert torch.equal(pred, want_pred)
    for a, b in zip(grads, want_grads):
        assert_close(a, b, **TOL[torch.float64])


# -- memory: nothing of the (N, V) labels kept for backward ---------------------------------------------------------

def _dense_tensors() -> list[torch.Tensor]:
    """The live tensors of this process that have a storage: earlier tests in the same worker may leave oneDNN
    (mkldnn) or meta tensors about, whose storage cannot be read, and none of them is the loss's."""
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta and not o.is_mkldnn]


def _alive_before() -> set[int]:
    """The storages alive before the call under test (what earlier tests in the same worker keep, a cached model's
    among them): only tensors made from here on are the loss's."""
    gc.collect()
    return {o.untyped_storage().data_ptr() for o in _dense_tensors()}


def _kept(fn, model, feats, batch, rows, steps, **kw):
    """(bytes of the storages saved for backward, the largest of them, the largest storage of a live tensor) in
    ``fn``'s forward, leaving out the parameters, the inputs and the target table ``rows.probs``."""
    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    known |= {t.untyped_storage().data_ptr() for t in (feats, rows.probs, *batch.values())}
    known |= _alive_before()
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in known:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = fn(model, model.fuse(feats), batch, rows, steps, **kw)
    gc.collect()
    live = _dense_tensors()
    largest_live = max((o.untyped_storage().nbytes() for o in live
                        if o.untyped_storage().data_ptr() not in known), default=0)
    loss.backward()
    return sum(saved.values()), max(saved.values(), default=0), largest_live


def _unroll_only(model, hidden, batch, rows, steps, **kw):
    return sum(h.sum() for _, h in unroll(model, hidden, batch["input_ids"], steps)), None


@pytest.mark.parametrize("chunk", [2048, 64], ids=["one-chunk", "chunked"])
def test_no_copy_of_the_labels_is_kept_for_backward(chunk):
    """Draft vocabulary 4096 against hidden 48, 3 steps, 130 to 190 rows a step: between forward and backward no
    saved tensor and no live tensor (other than the target table) is as large as one step's (N, V) float32
    labels, and the loss saves no more than the unroll alone does plus, per step, the head's gradients ((V, H) and
    (N, H)) and a few (N, H) tensors of the norm, less than one such copy. The old formula keeps one per step
    (saved by autograd in one chunk; held by its checkpoints when chunked), and the same counts catch it."""
    torch.manual_seed(0)
    model = _eagle3(torch.float32, vocab=8192, draft_vocab=4096)
    feats, batch, rows = _data(model, 2, 110, torch.float32)
    steps, V, H = 3, model.config.draft_vocab_size, model.config.hidden_size
    counts = [int(rows.in_vocab[b, t + 1 + i].sum()) for i, (b, t) in ((i, step_rows(batch, i)) for i in range(steps))]
    copy = min(counts) * V * 4
    head = V * H * 4 + 6 * max(counts) * H * 4
    assert head < copy  # the shapes tell a copy from the head's gradients
    unrolled, _, _ = _kept(_unroll_only, model, feats, batch, rows, steps)
    total, largest, live = _kept(ttt_loss, model, feats, batch, rows, steps, chunk=chunk)
    assert largest < copy and live < copy, (largest, live, copy)
    assert total <= unrolled + steps * head, (total, unrolled, head)
    old_total, old_largest, old_live = _kept(_old_ttt_loss, model, feats, batch, rows, steps, chunk=chunk)
    assert max(old_largest, old_live) >= copy
    assert old_total > unrolled + steps * head or chunk < min(counts)  # checkpoints hide theirs from the hooks


def test_soft_cross_entropy_keeps_no_gathered_copy_in_its_checkpoints():
    """The generic path (any head): ``soft_cross_entropy(index=...)`` over several checkpointed chunks holds the
    table and index slices only, not ``probs[index]``."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(300, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 2048)
    table = torch.softmax(torch.randn(400, 2048, generator=g), -1)
    index = torch.randint(0, 400, (300,), generator=g)
    before = _alive_before()
    loss, _ = soft_cross_entropy(head, hidden, table, chunk=64, index=index)
    gc.collect()
    known = {table.untyped_storage().data_ptr(), head.weight.untyped_storage().data_ptr()} | before
    big = [o.untyped_storage().nbytes() for o in _dense_tensors() if o.untyped_storage().data_ptr() not in known]
    assert max(big) < 300 * 2048 * 4
    want, _ = soft_cross_entropy(head, hidden, table[index], chunk=64)
    assert_close(loss, want)
