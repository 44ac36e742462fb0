"""Attention over a key range plus own keys without a dense mask (``specheads.models.ranged_attention``), and the two
rules built on it: DFlash's ``BlockLayout`` and P-EAGLE's ``ParallelLayout``. Outputs and every gradient equal the
dense masks' (``block_attention_mask``, ``parallel_attention_mask`` / ``parallel_window_mask``): float64 to 1e-10,
float32 to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from specheads.methods.peagle import pack
from specheads.models import ranged_attention, ttt_attention
from specheads.models.dflash import BlockLayout
from specheads.models.peagle import ParallelLayout
from specheads.models.ranged_attention import ranged_attention as ranged

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=dtype)


def _grads(fn, tensors, seed=1):
    """[out, grad of each tensor] of ``fn(*tensors)`` under a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype))
    return [out] + [x.grad for x in leaves]


def _assert_all_close(got, want, tol, names):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- ranged_attention itself


def _problem(heads, kv_heads, dtype, B=2, Q=11, S=9, R=7, J=3, D=8, seed=0):
    """Random queries, context and own keys; ranges including empty ones and ones past S; distinct own keys per
    query, some not allowed; every query sees at least one key."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _randn(g, B, heads, Q, D, dtype=dtype), _randn(g, B, kv_heads, S, D, dtype=dtype), \
        _randn(g, B, kv_heads, S, D, dtype=dtype)
    k_own, v_own = _randn(g, B, kv_heads, R, D, dtype=dtype), _randn(g, B, kv_heads, R, D, dtype=dtype)
    lo = torch.randint(0, max(S, 1), (B, Q), generator=g)
    hi = lo + torch.randint(-2, S + 3, (B, Q), generator=g)  # some ranges empty, some past the last key
    key_valid = torch.rand(B, S, generator=g) > 0.2
    index = torch.stack([torch.randperm(R, generator=g)[:J] for _ in range(B * Q)]).T.reshape(J, B, Q)
    allowed = torch.rand(J, B, Q, generator=g) > 0.3
    allowed[0] = True
    return q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed


def _dense(q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed, scale):
    """The same attention under one (B, Q, S + R) mask."""
    S = k.shape[2]
    pos = torch.arange(S)
    ctx = (pos >= lo[..., None]) & (pos < hi[..., None]) & key_valid[:, None]
    own = torch.zeros(*lo.shape, k_own.shape[2], dtype=torch.bool)
    for idx, ok in zip(index, allowed):
        own.scatter_(2, idx[..., None], ok[..., None])
    mask = torch.cat([ctx, own], 2)
    return F.scaled_dot_product_attention(q, torch.cat([k, k_own], 2), torch.cat([v, v_own], 2),
                                          attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _compare(problem, tol, chunk):
    q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed = problem
    rest = (lo, hi, key_valid, index, allowed)
    got = _grads(lambda *t: ranged(*t[:3], lo, hi, key_valid, *t[3:], index, allowed, 0.3, chunk=chunk),
                 [q, k, v, k_own, v_own])
    want = _grads(lambda *t: _dense(*t[:3], t[3], t[4], *rest, 0.3), [q, k, v, k_own, v_own])
    _assert_all_close(got, want, tol, ["out", "q", "k", "v", "k_own", "v_own"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("chunk", [3, None])
def test_ranged_attention_equals_the_dense_mask(chunk, heads, kv_heads, dtype):
    """Grouped-query heads and not, 3 queries a flash call (four chunks, key ranges overlapping) or one call; queries
    with no context key (their lse -inf) see their own keys only."""
    problem = _problem(heads, kv_heads, dtype, seed=heads + (chunk or 0))
    assert bool(((problem[6] <= problem[5]) | ~problem[7].any(1)[:, None]).any())  # an empty context occurs
    _compare(problem, TOL[dtype], chunk)


def test_ranged_attention_without_context_keys_or_native_gqa(monkeypatch):
    """S = 0 (DFlash's blocks with no cache) and a torch whose flash kernel needs equal head counts."""
    problem = list(_problem(6, 2, torch.float64, S=0))
    problem[5], problem[6] = torch.zeros_like(problem[5]), torch.zeros_like(problem[6])
    problem[7] = torch.ones(2, 0, dtype=torch.bool)
    _compare(problem, TOL[torch.float64], 4)
    monkeypatch.setattr(ttt_attention, "NATIVE_GQA", False)
    _compare(_problem(6, 2, torch.float64, seed=3), TOL[torch.float64], 4)


def _sorted_ranges(problem, window):
    """The problem with P-EAGLE's kind of ranges: queries in anchor order, each seeing the keys up to its anchor
    (within ``window`` of it, if given), one row padded past its length."""
    q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed = problem
    B, Q, S = lo.shape[0], lo.shape[1], k.shape[2]
    hi = torch.linspace(1, S, Q).long().expand(B, Q).clone()
    lo = torch.zeros_like(hi) if window is None else (hi - window).clamp(min=0)
    key_valid = torch.ones(B, S, dtype=torch.bool)
    key_valid[1, S - 5:] = False
    return q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
def test_sorted_ranges_go_through_unmasked_cores(window, dtype):
    """Ranges that grow with the query (P-EAGLE's depths, DFlash's blocks): each chunk's shared keys go to the
    kernel without a mask, the keys near the range ends under one (left edges too when windowed), a padded row's
    invalid keys keep chunks that reach them whole; the result and every gradient equal the dense mask's."""
    problem = _sorted_ranges(_problem(6, 2, dtype, Q=40, S=60, seed=5), window)
    lo, hi, key_valid = problem[5:8]
    blocks = list(ranged_attention.range_blocks(lo, hi, key_valid, 8, dtype))
    cores = [(a, b) for _, _, a, b, mask, _ in blocks if mask is None]
    edges = [(a, b) for _, _, a, b, mask, _ in blocks if mask is not None]
    assert len(cores) >= 3 and edges
    assert any(edge[0] == core[1] for edge in edges for core in cores)  # a right edge after a core
    if window is not None:
        assert any(edge[1] == core[0] for edge in edges for core in cores)  # a left edge before a core
    assert all(bool(key_valid[:, a:b].all()) for a, b in cores)
    _compare(problem, TOL[dtype], 8)


def test_chunks_shrink_until_their_masks_fit(monkeypatch):
    """Ranges with no shared keys (random ones) are cut into smaller chunks until each masked block holds at most
    MASK_ELEMENTS (or MIN_CHUNK queries are left), and still equal the dense mask."""
    monkeypatch.setattr(ranged_attention, "MASK_ELEMENTS", 60)
    monkeypatch.setattr(ranged_attention, "MIN_CHUNK", 2)
    problem = _problem(4, 4, torch.float64, Q=24, S=30, seed=7)
    lo, hi, key_valid = problem[5:8]
    blocks = list(ranged_attention.range_blocks(lo, hi, key_valid, 16, torch.float64))
    sizes = [stop - start for start, stop, *_ in blocks]
    assert max(sizes) < 16
    assert all(mask is None or mask.numel() <= 60 or stop - start <= 2 for start, stop, _, _, mask, _ in blocks)
    _compare(problem, TOL[torch.float64], 16)


def test_a_query_with_no_key_is_refused():
    q, k, v, k_own, v_own, lo, hi, key_valid, index, allowed = _problem(4, 4, torch.float64)
    hi = lo.clone()
    allowed = torch.zeros_like(allowed)
    with pytest.raises(ValueError, match="sees no key"):
        ranged(q, k, v, lo, hi, key_valid, k_own, v_own, index, allowed, 0.3)


# --------------------------------------------------------------------------- DFlash's blocks


def _block_attention(layout, dense: bool):
    def fn(q, ctx_k, ctx_v, k, v):
        out = None if dense else layout.attend(q, ctx_k, ctx_v, k, v, 0.3)
        if out is None:
            mask = layout.dense(ctx_k.shape[2])
            out = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2),
                                                 attn_mask=mask[:, None], scale=0.3, enable_gqa=True)
        return out
    return fn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_layout_equals_block_attention_mask(dtype):
    """Batch 2, 5 blocks of 3 over 17 context positions, grouped heads; anchors at 0 (no context), a hole in one
    row's context_valid, anchors unsorted: outputs and gradients of the queries, context and block keys equal."""
    g = torch.Generator().manual_seed(4)
    B, S, n, bs, D = 2, 17, 5, 3, 8
    anchors = torch.tensor([[0, 3, 9, 16, 12], [5, 5, 1, 0, 17]])
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, 2] = False
    layout = BlockLayout(anchors, bs, valid)
    tensors = [_randn(g, B, 6, n * bs, D, dtype=dtype), _randn(g, B, 2, S, D, dtype=dtype),
               _randn(g, B, 2, S, D, dtype=dtype), _randn(g, B, 2, n * bs, D, dtype=dtype),
               _randn(g, B, 2, n * bs, D, dtype=dtype)]
    _assert_all_close(_grads(_block_attention(layout, False), tensors), _grads(_block_attention(layout, True), tensors),
                      TOL[dtype], ["out", "q", "ctx_k", "ctx_v", "k", "v"])


def test_block_layout_leaves_other_devices_to_the_mask(monkeypatch):
    """Where ``ranged_attention`` does not take the tensors, ``attend`` answers None and the mask is the path."""
    monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    t = torch.randn(1, 2, 4, 8)
    assert BlockLayout(torch.tensor([[2, 3]]), 2).attend(t, t, t, t, t, 0.3) is None


# --------------------------------------------------------------------------- P-EAGLE's packed depths


def _parallel(layout, window, dense: bool):
    def fn(q, k, v):
        if dense:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense(window)[:, None], scale=0.3,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        return layout.attend(q, k, v, 0.3, window)
    return fn


def _packed(lengths, T, depths, seed):
    att = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    p = pack(att, depths, 0.7, 0.2, generator=torch.Generator().manual_seed(seed))
    return ParallelLayout(p.anchor, p.depth, p.valid)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 1, 2, 5, 40])
def test_parallel_layout_equals_the_parallel_masks(window, dtype):
    """A pack of 4 depths over rows of 19 and 13 of 19 tokens (padding in the depth-0 part and in every depth's
    block), grouped heads, windows narrower than the depths (a slot then sees only its anchor's depth-0 key and its
    chain) and wider than the row: every output, padding included, and every gradient equal the mask's."""
    layout = _packed([19, 13], 19, 4, seed=window or 0)
    plan = layout.plan()
    assert plan is not None and plan["head"] == 13 and plan["T"] == 19
    g = torch.Generator().manual_seed(2)
    Q = layout.anchor.shape[1]
    tensors = [_randn(g, 2, heads, Q, 8, dtype=dtype) for heads in (6, 2, 2)]
    _assert_all_close(_grads(_parallel(layout, window, False), tensors),
                      _grads(_parallel(layout, window, True), tensors), TOL[dtype], ["out", "q", "k", "v"])


def test_parallel_layout_not_packed_goes_to_the_mask(monkeypatch):
    """A layout that is not ``pack``'s (depth-0 entries after a slot) has no plan and runs under its mask; so does
    every layout where ``ranged_attention`` does not take the tensors."""
    layout = _packed([9, 9], 9, 3, seed=0)
    order = torch.randperm(layout.anchor.shape[1], generator=torch.Generator().manual_seed(0))
    shuffled = ParallelLayout(layout.anchor[:, order], layout.depth[:, order], layout.valid[:, order])
    assert shuffled.plan() is None
    g = torch.Generator().manual_seed(1)
    Q = layout.anchor.shape[1]
    tensors = [_randn(g, 2, 4, Q, 8, dtype=torch.float64) for _ in range(3)]
    _assert_all_close(_grads(_parallel(shuffled, 2, False), tensors), _grads(_parallel(shuffled, 2, True), tensors),
                      TOL[torch.float64], ["out", "q", "k", "v"])
    calls = []
    monkeypatch.setattr(ranged_attention, "ranged_attention", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(ttt_attention, "supported", lambda *a: False)
    _parallel(layout, None, False)(*tensors)
    assert not calls


def test_grouped_heads_reach_the_flash_backward_one_per_query_head(monkeypatch):
    """As in ``ttt_attention``: the context keys' flash backward is handed the keys repeated per query head (its
    threads split the heads it is handed), the forward the grouped ones; the result stays the dense mask's."""
    seen, real = [], ranged_attention._flash_backward

    def spy(grad_out, q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(grad_out, q, k, v, *args, **kwargs)

    monkeypatch.setattr(ranged_attention, "_flash_backward", spy)
    _compare(_problem(6, 2, torch.float64, seed=5), TOL[torch.float64], 4)
    assert seen and all(s == (6, 6, 6) for s in seen), seen


def test_parallel_slots_of_every_depth_attend_in_anchor_order(monkeypatch):
    """P-EAGLE's slots go to the kernel in anchor order, all depths together: a chunk of queries spans few anchors,
    so its key range is almost all an unmasked core. Each depth apart (the packed order), a chunk of a deep depth,
    which keeps few anchors, spans many of them, and most of its keys went under a mask (66 % of the key elements
    here, 11 % in anchor order); the output stays the dense mask's."""
    monkeypatch.setattr(ranged_attention, "CHUNK", 64)
    seen, real = {"masked": 0, "core": 0}, ranged_attention._flash

    def spy(q, k, v, *args, attn_mask=None, **kwargs):
        seen["masked" if attn_mask is not None else "core"] += q.shape[2] * k.shape[2]
        return real(q, k, v, *args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(ranged_attention, "_flash", spy)
    torch.manual_seed(0)
    packed = pack(torch.ones(1, 512, dtype=torch.long), 7, 0.7, 0.2)
    q, k, v = (torch.randn(1, 2, packed.anchor.shape[1], 8, dtype=torch.float64) for _ in range(3))
    layout = ParallelLayout(packed.anchor, packed.depth, packed.valid)
    out = layout.attend(q, k, v, 0.3, None)
    assert seen["masked"] < 0.2 * (seen["masked"] + seen["core"]), seen
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense(None)[:, None], scale=0.3)
    assert_close(out, want, **TOL[torch.float64])
