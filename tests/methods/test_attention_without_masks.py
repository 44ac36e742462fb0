"""Training without dense attention masks on the CPU: DFlash's and DSpark's blocks (``dflash.BlockLayout``), P-EAGLE's
packed depths (``peagle.ParallelLayout``) and EAGLE-1's causal step give the loss, every output and every parameter's
gradient of the dense masks they replace (float64, 1e-10), and build no tensor of T x T elements at T = 4096."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specheads.methods import build_method
from specheads.models import ttt_attention
from specheads.models.layers import causal_mask
from tests.conftest import make_tiny_target
from tests.models.tensor_watch import LargestTensor

V, H = 160, 48
ROWS = [{"input_ids": list(range(V)), "loss_mask": [1] * V}]


def _target(dtype=torch.float64, hidden=H, heads=6, kv_heads=2):
    return make_tiny_target("llama", vocab=V, hidden=hidden, layers=4, heads=heads, kv_heads=kv_heads, dtype=dtype)


def _batch(target, B=2, T=23, seed=0, pad=True):
    """Random ids and features (no target forward), row 1 right-padded, the first tokens not trained."""
    g = torch.Generator().manual_seed(seed)
    dtype, Ht = target.lm_head.weight.dtype, target.hidden_size
    att = torch.ones(B, T, dtype=torch.long)
    if pad and B > 1:
        att[1, T * 2 // 3:] = 0
    lm = att.clone()
    lm[:, :2] = 0
    return {"input_ids": torch.randint(0, V, (B, T), generator=g), "attention_mask": att, "loss_mask": lm,
            "hidden_aux": torch.randn(B, T, 3 * Ht, generator=g, dtype=dtype),
            "hidden_last": torch.randn(B, T, Ht, generator=g, dtype=dtype)}


def _loss_and_grads(method, model, batch, target, seed=5):
    """The step's loss and every parameter's gradient (anchors and depth draws from ``seed``)."""
    model.zero_grad()
    torch.manual_seed(seed)
    out = method.loss(model, batch, target)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_as_dense(monkeypatch, method, model, batch, target, outputs=None):
    """Loss, ``outputs()`` (a list of tensors) and gradients with the CPU path, then with the dense masks forced."""
    fused = _loss_and_grads(method, model, batch, target)
    with torch.no_grad():
        fused_out = outputs() if outputs else []
    monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    dense = _loss_and_grads(method, model, batch, target)
    with torch.no_grad():
        dense_out = outputs() if outputs else []
    monkeypatch.undo()
    assert_close(fused[0], dense[0], atol=1e-10, rtol=1e-10)
    for a, b in zip(fused_out, dense_out):
        assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert fused[1].keys() == dense[1].keys() and len(fused[1]) > 5
    for name, grad in fused[1].items():
        assert_close(grad, dense[1][name], atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")
    assert any(bool(g.abs().sum() > 0) for n, g in fused[1].items() if "self_attn" in n)


# --------------------------------------------------------------------------- DFlash / DSpark


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_dflash_and_dspark_losses_and_gradients_equal_the_block_mask(monkeypatch, name):
    """Two layers, grouped heads (6 / 2), blocks of 4, 6 anchors a row (row 1 padded: fewer anchors, the extras
    invalid), float64: loss, block states and every gradient equal ``block_attention_mask``'s."""
    target = _target()
    method = build_method(name, block_size=4, anchors=6, num_layers=2, labels="data")
    model = method.build(target).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    batch = _batch(target)

    def states():
        return [method._blocks(model, batch, target, 6, torch.Generator().manual_seed(3))[0]]

    _assert_same_as_dense(monkeypatch, method, model, batch, target, states)


# --------------------------------------------------------------------------- P-EAGLE


def _peagle(target, window=None, num_layers=2, depths=4):
    method = build_method("peagle", draft_vocab_size=40, vocab_data=ROWS, num_depths=depths, num_layers=num_layers)
    model = method.build(target).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.midlayer.self_attn.window = window  # layer 0 slides, layer 1 (if any) attends to the whole row
    return method, model


@pytest.mark.parametrize("window", [None, 2, 6])
def test_peagle_loss_and_gradients_equal_the_parallel_mask(monkeypatch, window):
    """Two layers (the first sliding when a window is given: 2 is narrower than the depths), grouped heads, 4
    depths, batch 2 with row 1 padded, float64: loss, every packed output (padding included) and every gradient
    equal ``parallel_attention_mask`` (& ``parallel_window_mask``)'s."""
    target = _target()
    method, model = _peagle(target, window)
    batch = _batch(target)

    def outputs():
        return [method.forward_depths(model, batch, torch.Generator().manual_seed(3))[0]]

    _assert_same_as_dense(monkeypatch, method, model, batch, target, outputs)


# --------------------------------------------------------------------------- EAGLE-1


def test_eagle1_causal_step_equals_the_causal_mask():
    """EAGLE-1's training forward (``decode`` with no mask and no cache) equals the same forward under an explicit
    (T, T) causal mask: outputs and every gradient, float64."""
    target = _target()
    model = build_method("eagle1", num_layers=2).build(target).double()
    batch = _batch(target, pad=False)
    ids = batch["input_ids"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    weight = torch.randn(*ids.shape, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(mask):
        model.zero_grad()
        out = model.decode(model.fuse(batch["hidden_last"]), ids, pos, mask)
        (out * weight).sum().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    got, want = run(None), run(causal_mask(ids.shape[1]).expand(ids.shape[0], -1, -1))
    assert len(got) > 5
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-10, rtol=1e-10)


# --------------------------------------------------------------------------- no T x T tensor at 4096 tokens


def _watch_step(method, model, batch, target):
    with LargestTensor() as watch:
        torch.manual_seed(0)
        method.loss(model, batch, target).loss.backward()
    return watch


def _tiny(name, **kw):
    """A float32 head of a 32-wide target (2 query heads, 1 key/value head) and its method."""
    target = _target(torch.float32, hidden=32, heads=2, kv_heads=1)
    if name == "peagle":
        method = build_method("peagle", draft_vocab_size=40, vocab_data=ROWS, num_layers=1, **kw)
    else:
        method = build_method(name, num_layers=1, **kw)
    return method, method.build(target), target


@pytest.mark.parametrize("name,kw", [("dflash", dict(block_size=4, anchors=1024, labels="data")),
                                     ("peagle", dict(num_depths=3)), ("eagle1", {})])
def test_no_t_by_t_tensor_at_4096_tokens(monkeypatch, name, kw):
    """One training step (forward and backward) of a row of 4096 tokens (DFlash: 1024 blocks of 4, as many queries as
    tokens; P-EAGLE: 3 depths, about 2.2 T packed entries) creates no tensor of T * T elements or more; the watch
    sees the flash backward, and catches the dense masks at T = 256."""
    method, model, target = _tiny(name, **kw)
    T = 4096
    watch = _watch_step(method, model, _batch(target, B=1, T=T), target)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in watch.ops
    assert watch.largest < T * T, watch.largest
    small = dict(kw, anchors=64) if name == "dflash" else kw
    method, model, target = _tiny(name, **small)
    if name == "eagle1":  # the dense form: the same step under an explicit causal mask
        decode = model.decode
        monkeypatch.setattr(model, "decode", lambda h, ids, pos, mask=None, cache=None: decode(
            h, ids, pos, causal_mask(ids.shape[1]).expand(ids.shape[0], -1, -1), cache))
    else:
        monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    assert _watch_step(method, model, _batch(target, B=1, T=256), target).largest >= 256 * 256
