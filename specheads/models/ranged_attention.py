"""Attention over a range of shared keys plus a few keys of each query's own, without a dense mask (CPU).

DFlash's blocks (``models.dflash``) and P-EAGLE's parallel slots (``models.peagle``) attend to two kinds of keys:

* **context keys** ``k`` (B, nkv, S, D), shared by all queries: query ``i`` of row ``b`` sees key ``s`` when
  ``lo[b, i] <= s < hi[b, i]`` and ``key_valid[b, s]`` (DFlash: the context before a block's anchor; P-EAGLE: the
  depth-0 keys up to a slot's anchor, within the sliding window);
* **own keys** ``k_own`` (B, nkv, R, D): query ``i`` sees key ``own_index[j, b, i]`` for every ``j`` with
  ``own_allowed[j, b, i]`` (DFlash: the ``block_size`` keys of its block; P-EAGLE: its chain's slots up to its own).

Their dense forms (``dflash.block_attention_mask``, ``peagle.parallel_attention_mask``) are a (Q, S + Q) or (Q, Q)
mask, Q the row's queries: memory and time in T² for a row of T tokens. Here the two kinds are attended apart and
merged exactly, as ``ttt_attention`` merges an unroll's causal and diagonal keys:

* the context goes to CPU flash attention ``chunk`` queries at a time (``range_blocks``): the keys every query of
  the chunk sees (the core) without a mask, the rest of the key range its queries reach under an additive mask
  (the chunk halved until that mask holds at most ``MASK_ELEMENTS``), the blocks merged by log-sum-exp: output
  ``o0`` and log-sum-exp ``lse0`` per query, ``-inf`` where a query sees no context key;
* each own key is one score per query, ``s_j = scale * q . k_own[own_index[j]]`` (``-inf`` where not allowed),
  its key and value gathered per ``j`` (memory O(Q D), never (Q, J, D));
* the parts merge by log-sum-exp in float32 at least: ``L = logsumexp(lse0, s_1, ..)``,
  ``out = exp(lse0 - L) o0 + sum_j exp(s_j - L) v_j``. Every query must see at least one key.

The backward is exact for the reason ``ttt_attention``'s module gives: each block's flash backward, handed the final
output and the final ``L``, returns the whole softmax's gradient restricted to that block's keys; the own keys add
``dS_j = w_j (dO . v_j - rowsum(dO * out))``, ``dq += scale dS_j k_j``, ``dk_j = scale dS_j q``, ``dv_j = w_j dO``,
scattered back to their rows of ``k_own`` / ``v_own``. Grouped-query heads as in ``ttt_attention``.

``supported`` (``ttt_attention.supported``) says which inputs come here; the callers keep the dense mask for the
rest (CUDA) and as the tests' reference.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from specheads.models import ttt_attention
from specheads.models.ttt_attention import _acc_dtype, _flash, _flash_backward, _grouped, _heads, _sum_heads

MASK_ELEMENTS = 1 << 22
"""Elements of one block's additive mask (B x chunk x masked key range): 16 MiB in float32."""
CHUNK = 1024
"""Queries per flash call at most (``range_blocks``); fewer where the masked keys would exceed ``MASK_ELEMENTS``."""
MIN_CHUNK = 32


def supported(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether ``ranged_attention`` takes these (``ttt_attention.supported``: CPU, one dtype it lists)."""
    return ttt_attention.supported(q, list(kv), [])


def ranged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     key_valid: torch.Tensor | None, k_own: torch.Tensor, v_own: torch.Tensor,
                     own_index: torch.Tensor, own_allowed: torch.Tensor, scale: float,
                     chunk: int | None = None) -> torch.Tensor:
    """q: (B, nh, Q, D); k/v: (B, nkv, S, D) context keys (S may be 0); lo/hi: (B, Q) long, each query's context key
    range [lo, hi); key_valid: (B, S) bool or None (all valid); k_own/v_own: (B, nkv, R, D); own_index: (J, B, Q)
    long indices into R; own_allowed: (J, B, Q) bool. ``chunk``: queries per flash call at most (default
    ``CHUNK``). Returns (B, nh, Q, D) in q's dtype (CPU autocast's, when on)."""
    if q.shape[1] % k.shape[1] or k.shape[1] != k_own.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]} / "
                         f"{k_own.shape[1]}")
    B, Q, S = q.shape[0], q.shape[2], k.shape[2]
    if lo.shape != (B, Q) or hi.shape != (B, Q) or own_index.shape[1:] != (B, Q) or \
            own_allowed.shape != own_index.shape:
        raise ValueError(f"ranged_attention: lo {tuple(lo.shape)}, hi {tuple(hi.shape)}, own_index "
                         f"{tuple(own_index.shape)}, own_allowed {tuple(own_allowed.shape)} for {Q} queries, batch {B}")
    q, k, v, k_own, v_own = ttt_attention.autocast_inputs([q, k, v, k_own, v_own])
    if not supported(q, k, v, k_own, v_own):
        raise ValueError(f"ranged_attention takes CPU tensors of one dtype among {ttt_attention.DTYPES}; got "
                         f"{sorted({(t.device.type, t.dtype) for t in (q, k, v, k_own, v_own)}, key=str)}")
    key_valid = torch.ones(B, S, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.bool()
    chunk = int(chunk or CHUNK)
    with torch.autocast("cpu", enabled=False):
        return _Ranged.apply(q, k, v, k_own, v_own, lo, hi, key_valid, own_index, own_allowed.bool(),
                             float(scale), chunk)


class _Ranged(torch.autograd.Function):
    """``ranged_attention``'s forward and exact backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, k_own, v_own, lo, hi, key_valid, own_index, own_allowed, scale, chunk):
        group = q.shape[1] // k.shape[1]
        o0, lse0 = context_attention(q, _heads(k, group), _heads(v, group), lo, hi, key_valid, scale, chunk)
        out, lse, weights = merge_own(q, o0, lse0, k_own, v_own, own_index, own_allowed, scale)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.save_for_backward(q, k, v, k_own, v_own, lo, hi, key_valid, own_index, out, lse, weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, k_own, v_own, lo, hi, key_valid, own_index, out, lse, weights = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]
        grad_out = grad_out.contiguous()
        k, v = _heads(k, group, backward=True), _heads(v, group, backward=True)
        dq, dk, dv = context_backward(grad_out, q, k, v, lo, hi, key_valid, out, lse, ctx.scale, ctx.chunk)
        dq, dk_own, dv_own = own_backward(grad_out, q, out, weights, k_own, v_own, own_index, ctx.scale, dq)
        return (dq, _sum_heads(dk, group), _sum_heads(dv, group), dk_own, dv_own) + (None,) * 7


def range_blocks(lo: torch.Tensor, hi: torch.Tensor, key_valid: torch.Tensor, chunk: int, dtype: torch.dtype):
    """Yield ``(start, stop, first, last, mask, seen)``: queries ``start..stop-1`` against keys ``first..last-1``.

    Each chunk of queries is cut into up to three blocks of keys: the **core** ``[max lo, min hi)``, seen by every
    query of the chunk (and valid in every row), goes without a mask (``mask`` None, ``seen`` None); the **edges**
    left and right of it, or the whole range when there is no core, go under the additive mask (B, 1, stop - start,
    last - first), with ``seen`` (B, stop - start) bool, whether a query sees any key of the block. P-EAGLE's slots
    and DFlash's blocks sorted by anchor give chunks whose ranges differ only near their ends, so almost every key
    lies in a core: no mask is built or read for it, and the kernel runs its unmasked loop. A chunk whose queries
    see no key yields nothing."""
    Q, S, start = lo.shape[1], key_valid.shape[1], 0
    while start < Q:
        stop, first, last, core_lo, core_hi = _chunk(lo, hi, key_valid, start, chunk)
        l, h = lo[:, start:stop].clamp(min=0), hi[:, start:stop].clamp(max=S)
        for a, b in ((first, core_lo), (core_hi, last)):
            if b > a:  # an edge (the whole range when there is no core)
                kpos = torch.arange(a, b, device=lo.device)
                allowed = (kpos >= l[..., None]) & (kpos < h[..., None]) & key_valid[:, None, a:b]
                mask = torch.zeros(allowed.shape, dtype=dtype, device=lo.device).masked_fill_(~allowed, float("-inf"))
                yield start, stop, a, b, mask[:, None], allowed.any(-1)
        if core_hi > core_lo:
            yield start, stop, core_lo, core_hi, None, None
        start = stop


def _chunk(lo, hi, key_valid, start: int, chunk: int) -> tuple[int, int, int, int, int]:
    """(stop, first, last, core_lo, core_hi) of the chunk of queries from ``start``: at most ``chunk`` queries,
    halved (down to ``MIN_CHUNK``) while its masked edges would hold more than ``MASK_ELEMENTS``; the core is empty
    (``core_lo == core_hi``) where the queries share no valid key. Large chunks matter: each flash call's backward
    costs time in its whole key range, whatever its query count."""
    B, Q, S = lo.shape[0], lo.shape[1], key_valid.shape[1]
    while True:
        stop = min(start + chunk, Q)
        l, h = lo[:, start:stop].clamp(min=0), hi[:, start:stop].clamp(max=S)
        first, last = int(l.min()), int(h.max())
        core_lo, core_hi = int(l.max()), int(h.min())
        if last <= first or core_hi <= core_lo or not bool(key_valid[:, core_lo:core_hi].all()):
            core_lo = core_hi = max(first, last)
        masked = max(0, last - first) - (core_hi - core_lo)
        if B * (stop - start) * masked <= MASK_ELEMENTS or chunk <= MIN_CHUNK:
            return stop, first, last, core_lo, core_hi
        chunk = max(MIN_CHUNK, chunk // 2)


def context_attention(q, k, v, lo, hi, key_valid, scale: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, nh, Q, D), lse (B, nh, Q), -inf where a query sees no context key) of q over its context range:
    each block's flash output merged into its chunk's by log-sum-exp (in float32 at least)."""
    B, nh, Q, D = q.shape
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(B, nh, Q, D, dtype=acc, device=q.device)
    lse = torch.full((B, nh, Q), float("-inf"), dtype=acc, device=q.device)
    for start, stop, first, last, mask, seen in range_blocks(lo, hi, key_valid, chunk, q.dtype):
        o, s = _flash(q[:, :, start:stop], k[:, :, first:last], v[:, :, first:last], 0.0, False, attn_mask=mask,
                      scale=scale)
        if seen is not None:  # the kernel returns 0 and lse 0 for a row that sees no key
            s = s.masked_fill(~seen[:, None], float("-inf"))
        rows = slice(start, stop)
        merged = torch.logaddexp(lse[:, :, rows], s.to(acc))
        keep = torch.exp(lse[:, :, rows] - merged).nan_to_num_(0.0)  # -inf - -inf: nothing seen yet, nor now
        new = torch.exp(s.to(acc) - merged).nan_to_num_(0.0)
        out[:, :, rows] = keep[..., None] * out[:, :, rows] + new[..., None] * o.to(acc)
        lse[:, :, rows] = merged
    return out.to(q.dtype), lse.to(_acc_dtype(q.dtype))


def context_backward(grad_out, q, k, v, lo, hi, key_valid, out, lse, scale: float, chunk: int):
    """(dq, dk, dv) of the context keys' share of the attention whose final output and log-sum-exp are out / lse."""
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc)
    dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)  # chunks' key ranges overlap
    for start, stop, first, last, mask, _ in range_blocks(lo, hi, key_valid, chunk, q.dtype):
        rows, keys = slice(start, stop), slice(first, last)
        gq, gk, gv = _flash_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                     out[:, :, rows], lse[:, :, rows], 0.0, False, attn_mask=mask, scale=scale)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, nkv, R, D) rows ``index`` (B, Q) -> (B, nkv, 1, Q, D) in ``dtype`` (broadcast over a head group)."""
    B, nkv, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, nkv, -1, D)).to(dtype)[:, :, None]


def merge_own(q, o0, lse0, k_own, v_own, own_index, own_allowed, scale: float):
    """Merge the context part (o0, lse0) with the own keys. Returns (out (B, nh, Q, D) in q's dtype, lse (B, nh, Q)
    in lse0's dtype, weights (J, B, nh, Q) of the own keys in the merge dtype)."""
    acc, nkv = _acc_dtype(q.dtype), k_own.shape[1]
    qg = _grouped(q.to(acc), nkv)
    scores = [(scale * (qg * _gather(k_own, idx, acc)).sum(-1)).flatten(1, 2).masked_fill(~ok[:, None], float("-inf"))
              for idx, ok in zip(own_index, own_allowed)]
    parts = torch.stack([lse0.to(acc), *scores])
    lse = torch.logsumexp(parts, 0)
    if bool(torch.isneginf(lse).any()):
        raise ValueError("ranged_attention: a query sees no key (neither context nor own)")
    weights = torch.exp(parts - lse)
    out = _grouped(weights[0, ..., None] * o0.to(acc), nkv)
    for w, idx in zip(weights[1:], own_index):
        out = out + _grouped(w[..., None], nkv) * _gather(v_own, idx, acc)
    return out.flatten(1, 2).to(q.dtype), lse.to(lse0.dtype), weights[1:]


def own_backward(grad_out, q, out, weights, k_own, v_own, own_index, scale: float, dq):
    """Add the own keys' terms to the context part's ``dq``; return (dq, dk_own, dv_own)."""
    acc, nkv = _acc_dtype(q.dtype), k_own.shape[1]
    dout, qg = _grouped(grad_out.to(acc), nkv), _grouped(q.to(acc), nkv)
    rowsum = (dout * _grouped(out.to(acc), nkv)).sum(-1)  # D = rowsum(dO * out), as the flash backward takes it
    dqg = _grouped(dq.to(acc), nkv)
    dk, dv = torch.zeros(k_own.shape, dtype=acc), torch.zeros(v_own.shape, dtype=acc)
    B, _, _, D = k_own.shape
    for w, idx in zip(weights, own_index):
        w = _grouped(w, nkv)
        kj, vj = _gather(k_own, idx, acc), _gather(v_own, idx, acc)
        ds = (w * ((dout * vj).sum(-1) - rowsum))[..., None]
        dqg = dqg + scale * ds * kj
        at = idx[:, None, :, None].expand(B, nkv, -1, D)
        dk.scatter_add_(2, at, (scale * ds * qg).sum(2))
        dv.scatter_add_(2, at, (w[..., None] * dout).sum(2))
    return dqg.flatten(1, 2).to(q.dtype), dk.to(k_own.dtype), dv.to(v_own.dtype)
