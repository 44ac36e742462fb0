"""Triton kernels for the batched target-only tree walk (reference: ``verify_tree_sampling_reference``).

Two launches, no host sync. ``_row_stats`` computes, for all B*(n+1) rows in parallel, the max of
z / T and the softmax normaliser sum(exp(z / T - max)) in float64. ``_tree_walk`` then walks each
tree in one program: at each visited node it draws x by inverse CDF with the next uniform (one
scan over the row, counting cumulative weights <= u * total), moves to the child whose token is x,
or else draws the bonus from the row with the children's tokens removed (two scans: the remaining
mass, then the draw). All arithmetic after the load is float64, as in ``verify.py``, so the choices
match the reference except when a uniform lands within float64 rounding of a CDF boundary.
"""

from __future__ import annotations

import torch

from specheads.kernels import check_device, require_triton

triton, tl = require_triton()


@triton.jit
def _row_stats(logits_ptr, temp_ptr, max_ptr, sum_ptr, V, BLOCK: tl.constexpr):
    """Per row of logits (R, V): max(z / T) and sum(exp(z / T - max)), float64."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    T = tl.load(temp_ptr)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float64)
        m = tl.maximum(m, tl.max(z / T, 0))
    s = tl.full((), 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float64)
        s += tl.sum(tl.where(idx < V, tl.exp(z / T - m), 0.0), 0)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)


@triton.jit
def _scan(base, V, T, m, t, kid_toks, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """Over w = exp(z / T - m) (children's tokens zeroed if MASKED): -> (number of cumulative sums
    <= t, last id with w > 0, total of w)."""
    offs = tl.arange(0, BLOCK)
    carry = tl.full((), 0.0, tl.float64)
    cnt = tl.full((), 0, tl.int32)
    last = tl.full((), -1, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        inside = idx < V
        z = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float64)
        w = tl.where(inside, tl.exp(z / T - m), 0.0)
        if MASKED:
            drop = tl.max((idx[:, None] == kid_toks[None, :]).to(tl.int32), 1)
            w = tl.where(drop > 0, 0.0, w)
        c = carry + tl.cumsum(w, 0)
        cnt += tl.sum(((c <= t) & inside).to(tl.int32), 0)
        last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0))
        carry = tl.max(c, 0)
    return cnt, last, carry


@triton.jit
def _draw(base, V, T, m, u, total, kid_toks, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse-CDF draw with uniform u from a row whose (masked) weights sum to ``total``."""
    cnt, last, _ = _scan(base, V, T, m, u * total, kid_toks, MASKED, BLOCK)
    return tl.where(cnt < V, cnt, last)


@triton.jit
def _tree_walk(logits_ptr, temp_ptr, max_ptr, sum_ptr, u_ptr, tokens_ptr, parents_ptr,
               accept_ptr, path_ptr, bonus_ptr, n, V,
               NPAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program per tree; path (B, n) is pre-filled with -1."""
    b = tl.program_id(0).to(tl.int64)
    T = tl.load(temp_ptr)
    offs = tl.arange(0, NPAD)
    valid = offs < n
    toks = tl.load(tokens_ptr + b * n + offs, mask=valid, other=-1).to(tl.int32)
    pars = tl.load(parents_ptr + b * n + offs, mask=valid, other=-3).to(tl.int32)
    node = tl.full((), -1, tl.int32)
    alive = tl.full((), 1, tl.int32)
    acc = tl.full((), 0, tl.int32)
    bonus = tl.full((), 0, tl.int32)
    for d in range(n + 1):
        if alive != 0:
            row = b * (n + 1) + node + 1
            base = logits_ptr + row * V
            m = tl.load(max_ptr + row)
            u = tl.load(u_ptr + b * (n + 1) + d)
            kid_toks = tl.where((pars == node) & valid, toks, -1)
            x = _draw(base, V, T, m, u, tl.load(sum_ptr + row), kid_toks, False, BLOCK)
            hit = tl.min(tl.where(kid_toks == x, offs, n), 0)
            ok = hit < n
            r = x
            if (not ok) and (tl.max(kid_toks, 0) >= 0):  # rejected: draw from the rest
                u2 = tl.load(u_ptr + b * (n + 1) + d + 1)
                _, _, rest = _scan(base, V, T, m, -1.0, kid_toks, True, BLOCK_R)
                if rest > 0:
                    r = _draw(base, V, T, m, u2, rest, kid_toks, True, BLOCK_R)
            tl.store(path_ptr + b * n + d, hit.to(tl.int64), mask=ok)
            bonus = tl.where(ok, bonus, r)
            node = tl.where(ok, hit, node)
            acc += ok.to(tl.int32)
            alive = ok.to(tl.int32)
    tl.store(accept_ptr + b, acc.to(tl.int64))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def verify_tree_sampling_triton(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                                temperature: float, uniforms: torch.Tensor, block: int = 1024):
    """logits (B, n+1, V), tokens/parents (B, n), uniforms (B, n+1) float64, temperature > 0
    -> (accept_len (B,), path (B, n), bonus (B,))."""
    check_device(logits, tokens, parents, uniforms, where="verify_tree_sampling_triton")
    if not temperature > 0:
        raise ValueError(f"verify_tree_sampling_triton: temperature must be > 0, got {temperature}")
    B, rows, V = logits.shape
    n, dev = rows - 1, logits.device
    flat = logits.reshape(B * rows, V).contiguous()
    accept = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    if B == 0:
        return accept, path, bonus
    blk = min(block, triton.next_power_of_2(V))
    npad = max(triton.next_power_of_2(n), 16)
    rmax, rsum = row_stats(flat, temperature, block)
    temp = torch.tensor([float(temperature)], dtype=torch.float64, device=dev)
    _tree_walk[(B,)](flat, temp, rmax, rsum, uniforms.contiguous(), tokens.long().contiguous(),
                     parents.long().contiguous(), accept, path, bonus, n, V,
                     NPAD=npad, BLOCK=blk, BLOCK_R=max(16, min(blk, 8192 // npad)))
    return accept, path, bonus


def row_stats(logits2d: torch.Tensor, temperature: float, block: int = 1024):
    """(R, V) -> (max of z / T (R,), sum of exp(z / T - max) (R,)), float64."""
    check_device(logits2d, where="row_stats")
    R, V = logits2d.shape
    dev = logits2d.device
    temp = torch.tensor([float(temperature)], dtype=torch.float64, device=dev)
    rmax = torch.empty(R, dtype=torch.float64, device=dev)
    rsum = torch.empty(R, dtype=torch.float64, device=dev)
    if R:
        _row_stats[(R,)](logits2d.contiguous(), temp, rmax, rsum, V,
                         BLOCK=min(block, triton.next_power_of_2(V)))
    return rmax, rsum
