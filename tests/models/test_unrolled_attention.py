"""The training-time test's attention without a dense mask (``specheads.models.ttt_attention``): its output and every
gradient equal the dense path's (``layers.dense_unrolled_attention``, one attention under ``unroll_mask``), alone
and through an EAGLE-3 unroll, and it builds no tensor of T x T elements at T = 4096."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specheads.methods.ttt import TargetRows, ttt_loss, unroll
from specheads.models import layers, ttt_attention
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.layers import dense_unrolled_attention, unrolled_attention
from specheads.models.ttt_attention import fused_unrolled_attention
from tests.conftest import make_tiny_target
from tests.models.tensor_watch import LargestTensor

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _inputs(steps, heads, kv_heads, T=13, B=2, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, T, D, generator=g, dtype=dtype)
    keys = [torch.randn(B, kv_heads, T, D, generator=g, dtype=dtype) for _ in range(steps)]
    values = [torch.randn(B, kv_heads, T, D, generator=g, dtype=dtype) for _ in range(steps)]
    return q, keys, values


def _output_and_grads(attention, q, keys, values, window=None, **kw):
    """[out, dq, dk_0.., dv_0..] of ``attention`` under a fixed random output gradient."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, *keys, *values)]
    n = len(keys)
    out = attention(leaves[0], leaves[1:1 + n], leaves[1 + n:], 0.3, window, **kw)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype))
    return [out] + [x.grad for x in leaves]


def _assert_all_close(got, want, tol):
    names = ["out", "q"] + [f"k{i}" for i in range((len(got) - 2) // 2)] + [f"v{i}" for i in range((len(got) - 2) // 2)]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_fused_equals_dense_output_and_gradients(steps, heads, kv_heads, dtype):
    """Steps 1..4, grouped-query heads and not, batch 2, T = 13: float64 to 1e-10, float32 to rounding, the 16-bit
    dtypes to theirs."""
    q, keys, values = _inputs(steps, heads, kv_heads, dtype=dtype)
    _assert_all_close(_output_and_grads(fused_unrolled_attention, q, keys, values),
                      _output_and_grads(dense_unrolled_attention, q, keys, values), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [1, 3, 5, 12, 13, 40])
@pytest.mark.parametrize("steps", [1, 3])
def test_sliding_window_equals_dense(steps, window, dtype):
    """A window goes 5 queries at a time (three chunks at T = 13, their key ranges overlapping)."""
    q, keys, values = _inputs(steps, 6, 2, dtype=dtype, seed=window)
    _assert_all_close(_output_and_grads(fused_unrolled_attention, q, keys, values, window, chunk=5),
                      _output_and_grads(dense_unrolled_attention, q, keys, values, window), TOL[dtype])


def test_kv_heads_repeated_without_native_gqa(monkeypatch):
    """A torch whose flash kernel needs equal head counts gets the key/value heads repeated, and their gradients
    summed back."""
    monkeypatch.setattr(ttt_attention, "NATIVE_GQA", False)
    q, keys, values = _inputs(3, 6, 2)
    for window in (None, 4):
        _assert_all_close(_output_and_grads(fused_unrolled_attention, q, keys, values, window, chunk=5),
                          _output_and_grads(dense_unrolled_attention, q, keys, values, window), TOL[torch.float64])


def test_unrolled_attention_takes_the_fused_path_on_cpu(monkeypatch):
    """CPU unroll steps go to the fused path; the dense one answers only where ``supported`` says no."""
    q, keys, values = _inputs(3, 4, 2)
    want = _output_and_grads(dense_unrolled_attention, q, keys, values, 4)

    def refuse(*args, **kw):
        raise AssertionError("the dense path ran")

    monkeypatch.setattr(layers, "dense_unrolled_attention", refuse)
    _assert_all_close(_output_and_grads(unrolled_attention, q, keys, values, 4), want, TOL[torch.float64])
    monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    with pytest.raises(AssertionError, match="dense path ran"):
        unrolled_attention(q, keys, values, 0.3)


def test_bfloat16_autocast_casts_like_attention():
    """Under CPU bfloat16 autocast float32 queries/keys and bfloat16 values are taken in bfloat16, as the dense
    path's ``scaled_dot_product_attention`` takes them: same output dtype, values and gradient dtypes."""
    q, keys, values = _inputs(3, 6, 2, dtype=torch.float32)
    values = [v.bfloat16() for v in values]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _output_and_grads(unrolled_attention, q, keys, values)
        want = _output_and_grads(dense_unrolled_attention, q, keys, values)
    assert got[0].dtype == torch.bfloat16
    _assert_all_close(got, want, TOL[torch.bfloat16])


def _largest_tensor(attention, T, window=None):
    q, keys, values = _inputs(3, 2, 1, T=T, B=1, D=8, dtype=torch.float32)
    leaves = [x.requires_grad_() for x in (q, *keys, *values)]
    with LargestTensor() as watch:
        out = attention(leaves[0], leaves[1:4], leaves[4:], 8 ** -0.5, window)
        out.square().sum().backward()
    assert all(x.grad is not None for x in leaves)
    return watch


@pytest.mark.parametrize("window", [None, 700])
def test_no_t_by_t_tensor_at_4096_tokens(window):
    """Forward and backward of a 3-step unroll at T = 4096 (grouped heads, a window or none) create no tensor of
    T * T elements or more; the watch sees the flash backward, and catches the dense path's mask (at T = 256)."""
    T = 4096
    watch = _largest_tensor(unrolled_attention, T, window)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in watch.ops
    assert watch.largest < T * T, watch.largest
    assert _largest_tensor(dense_unrolled_attention, 256, window).largest >= 256 * 256


def _eagle3(window=None, dtype=torch.float64):
    target = make_tiny_target("llama", vocab=120, hidden=48, layers=3, heads=6, kv_heads=2)
    torch.manual_seed(3)
    config = Eagle3Config.from_target(target, draft_vocab_size=50, aux_layers=[0, 1, 2], sliding_window=window)
    model = Eagle3Model(config).attach(target)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(5))[:50].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(50), t2d)
    return model.to(dtype)


def _rows(model, B, T):
    """TargetRows of every position whose next token is trained: random distributions and in-vocabulary argmaxes."""
    g = torch.Generator().manual_seed(7)
    need = torch.zeros(B, T, dtype=torch.bool)
    need[:, : T - 1] = True
    probs = torch.softmax(torch.randn(int(need.sum()), model.config.draft_vocab_size, generator=g), -1)
    argmax = torch.zeros(B, T, dtype=torch.long)
    draft_ids = torch.randint(0, model.config.draft_vocab_size, (int(need.sum()),), generator=g)
    argmax[need] = model.to_target_ids(draft_ids)
    row_of = torch.full((B, T), -1, dtype=torch.long)
    row_of[need] = torch.arange(probs.shape[0])
    return TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)


def _ttt_loss_and_grads(model, feats, batch, rows, steps):
    model.zero_grad()
    loss, _ = ttt_loss(model, model.fuse(feats), batch, rows, steps)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("window", [None, 4])
def test_eagle3_ttt_loss_and_gradients_equal_dense(monkeypatch, window):
    """A float64 EAGLE-3 head (6 query, 2 key/value heads), batch 2, T = 19, a 4-step training-time test
    (``methods.ttt.unroll`` through ``ttt_loss``): loss, each step's output and every parameter's gradient equal the
    dense path's to 1e-10."""
    B, T, steps = 2, 19, 4
    model = _eagle3(window)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 120, (B, T), generator=g)
    feats = torch.randn(B, T, 3 * 48, generator=g, dtype=torch.float64)
    batch = {"input_ids": ids, "loss_mask": torch.ones(B, T), "attention_mask": torch.ones(B, T)}
    rows = _rows(model, B, T)

    fused = _ttt_loss_and_grads(model, feats, batch, rows, steps)
    with torch.no_grad():
        fused_steps = [h for _, h in unroll(model, model.fuse(feats), ids, steps)]
    monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    dense = _ttt_loss_and_grads(model, feats, batch, rows, steps)
    with torch.no_grad():
        dense_steps = [h for _, h in unroll(model, model.fuse(feats), ids, steps)]

    assert_close(fused[0], dense[0], atol=1e-10, rtol=1e-10)
    for a, b in zip(fused_steps, dense_steps):
        assert_close(a, b, atol=1e-10, rtol=1e-10)
    for name, grad in fused[1].items():
        assert grad.abs().sum() > 0, name
        assert_close(grad, dense[1][name], atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


def _record_flash_backward(monkeypatch, module):
    """Patch ``module``'s flash backward to record the (query heads, key heads) it is handed."""
    seen, real = [], module._flash_backward

    def spy(grad_out, q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(grad_out, q, k, v, *args, **kwargs)

    monkeypatch.setattr(module, "_flash_backward", spy)
    return seen


@pytest.mark.parametrize("steps,window", [(1, None), (3, None), (2, 5)])
def test_grouped_heads_reach_the_flash_backward_one_per_query_head(monkeypatch, steps, window):
    """The CPU flash backward runs one thread per (row, key/value head) it is handed: grouped heads (2 here, 3 in
    SmolLM2) would leave the other cores idle, so it is handed the keys repeated per query head. Step 0 of a
    training unroll (one causal key set, gradients needed) takes this path too, not the SDPA kernel's own backward;
    the result stays the dense path's."""
    seen = _record_flash_backward(monkeypatch, ttt_attention)
    q, keys, values = _inputs(steps, 6, 2)
    got = _output_and_grads(unrolled_attention, q, keys, values, window)
    assert seen and all(s == (6, 6, 6) for s in seen), seen
    _assert_all_close(got, _output_and_grads(dense_unrolled_attention, q, keys, values, window), TOL[torch.float64])


def test_step_zero_without_gradients_stays_on_the_sdpa_kernel(monkeypatch):
    """Decoding (no gradients) and equal head counts keep plain causal SDPA for step 0: nothing to parallelise."""
    calls = []
    monkeypatch.setattr(ttt_attention, "fused_unrolled_attention", lambda *a, **k: calls.append(a))
    q, keys, values = _inputs(1, 6, 2)
    with torch.no_grad():
        unrolled_attention(q, keys, values, 0.3)
    q4, keys4, values4 = _inputs(1, 4, 4)
    unrolled_attention(q4.requires_grad_(), keys4, values4, 0.3)
    assert calls == []
