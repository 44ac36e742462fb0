"""Triton kernels for the batched target-only tree walk (reference: ``verify_tree_sampling_reference``).

Two launches, no host sync. ``_chunk_stats`` splits every one of the B*(n+1) logit rows into
chunks of CHUNK ids and computes, for all chunks in parallel, the max of z / T and sum(exp(z / T -
max)) in float64. ``_tree_walk`` then walks each tree in one program. At each visited node it draws
x by inverse CDF with the next uniform u: the chunk masses give the chunk where u * total falls,
and one scan of that chunk alone counts the cumulative weights <= u * total. It moves to the child
whose token is x; otherwise it draws the bonus the same way from the row with the children's
tokens removed (their weights are taken out of their chunks' masses). All arithmetic after the load
is float64, as in ``verify.py``, so the choices match the reference except when a uniform lands
within float64 rounding of a CDF boundary.
"""

from __future__ import annotations

import torch

from specheads.kernels import check_device, require_triton

triton, tl = require_triton()


@triton.jit
def _chunk_stats(logits_ptr, temp_ptr, max_ptr, sum_ptr, V, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, k) over ids [k*CHUNK, (k+1)*CHUNK): max of z / T and sum(exp(z / T - max))."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    base = logits_ptr + row * V
    T = tl.load(temp_ptr)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float64)
    for start in range(0, CHUNK, BLOCK):
        idx = k * CHUNK + start + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float64)
        m = tl.maximum(m, tl.max(z / T, 0))
    s = tl.full((), 0.0, tl.float64)
    m = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: weights 0, no inf - inf
    for start in range(0, CHUNK, BLOCK):
        idx = k * CHUNK + start + offs
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float64) / T
        s += tl.sum(tl.where(z != float("-inf"), tl.exp(z - m), 0.0), 0)
    tl.store(max_ptr + row * S + k, tl.where(s > 0, m, float("-inf")))
    tl.store(sum_ptr + row * S + k, s)


@triton.jit
def _masses(max_ptr, sum_ptr, row, S, SPAD: tl.constexpr):
    """-> (row max M, (SPAD,) chunk masses sum(exp(z / T - M)) over each chunk)."""
    ks = tl.arange(0, SPAD)
    ms = tl.load(max_ptr + row * S + ks, mask=ks < S, other=float("-inf"))
    ss = tl.load(sum_ptr + row * S + ks, mask=ks < S, other=0.0)
    M = tl.max(ms, 0)
    return M, tl.where(ss > 0, ss * tl.exp(ms - M), 0.0)


@triton.jit
def _kid_masses(base, T, M, kid_toks, S, CHUNK: tl.constexpr, NPAD: tl.constexpr, SPAD: tl.constexpr):
    """(SPAD,) weight exp(z / T - M) of the children's distinct tokens, summed per chunk."""
    j = tl.arange(0, NPAD)
    first = tl.max(((kid_toks[:, None] == kid_toks[None, :]) & (j[:, None] < j[None, :])).to(tl.int32), 0) == 0
    real = (kid_toks >= 0) & first  # a token shared by two siblings is removed once
    z = tl.load(base + kid_toks, mask=real, other=float("-inf")).to(tl.float64) / T
    w = tl.where(real & (z != float("-inf")), tl.exp(z - M), 0.0)
    ks = tl.arange(0, SPAD)
    hit = (kid_toks[None, :] // CHUNK) == ks[:, None]
    return tl.sum(tl.where(hit, w[None, :], 0.0), 1)


@triton.jit
def _draw(base, V, T, M, mass, u, kid_toks, S, MASKED: tl.constexpr, CHUNK: tl.constexpr,
          BLOCK: tl.constexpr, SPAD: tl.constexpr):
    """Inverse-CDF draw with uniform u from weights exp(z / T - M) (children's tokens zeroed if
    MASKED) whose chunk masses are ``mass``; -1 if nothing is left."""
    ks = tl.arange(0, SPAD)
    prefix = tl.cumsum(mass, 0)
    t = u * tl.sum(mass, 0)
    k = tl.sum(((prefix <= t) & (ks < S)).to(tl.int32), 0)
    k = tl.where(k < S, k, tl.max(tl.where(mass > 0, ks, 0), 0))  # rounding left t at the top
    carry = tl.sum(tl.where(ks == k - 1, prefix, 0.0), 0)
    offs = tl.arange(0, BLOCK)
    cnt = tl.full((), 0, tl.int32)
    last = tl.full((), -1, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        idx = k * CHUNK + start + offs
        inside = idx < V
        z = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float64) / T
        w = tl.where(inside & (z != float("-inf")), tl.exp(z - M), 0.0)
        if MASKED:
            drop = tl.max((idx[:, None] == kid_toks[None, :]).to(tl.int32), 1)
            w = tl.where(drop > 0, 0.0, w)
        c = carry + tl.cumsum(w, 0)
        cnt += tl.sum(((c <= t) & inside).to(tl.int32), 0)
        last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0))
        carry = tl.max(c, 0)
    return tl.where(cnt < tl.minimum(CHUNK, V - k * CHUNK), k * CHUNK + cnt, last)


@triton.jit
def _tree_walk(logits_ptr, temp_ptr, max_ptr, sum_ptr, u_ptr, tokens_ptr, parents_ptr,
               accept_ptr, path_ptr, bonus_ptr, n, V, S, NPAD: tl.constexpr, SPAD: tl.constexpr,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
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
            M, mass = _masses(max_ptr, sum_ptr, row, S, SPAD)
            u = tl.load(u_ptr + b * (n + 1) + d)
            kid_toks = tl.where((pars == node) & valid, toks, -1)
            x = _draw(base, V, T, M, mass, u, kid_toks, S, False, CHUNK, BLOCK, SPAD)
            hit = tl.min(tl.where(kid_toks == x, offs, n), 0)
            ok = hit < n
            r = x
            if (hit >= n) & (tl.max(kid_toks, 0) >= 0):  # rejected: draw from the rest
                rest = tl.maximum(mass - _kid_masses(base, T, M, kid_toks, S, CHUNK, NPAD, SPAD), 0.0)
                if tl.sum(rest, 0) > 0:
                    u2 = tl.load(u_ptr + b * (n + 1) + d + 1)
                    r = _draw(base, V, T, M, rest, u2, kid_toks, S, True, CHUNK, BLOCK_R, SPAD)
                    r = tl.where(r >= 0, r, x)
            tl.store(path_ptr + b * n + d, hit.to(tl.int64), mask=ok)
            bonus = tl.where(ok, bonus, r)
            node = tl.where(ok, hit, node)
            acc += ok.to(tl.int32)
            alive = ok.to(tl.int32)
    tl.store(accept_ptr + b, acc.to(tl.int64))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def chunk_stats(logits2d: torch.Tensor, temperature: float, chunk: int = 4096, block: int = 1024):
    """(R, V) -> (max of z / T, sum of exp(z / T - max)), each (R, S) float64 over chunks of ``chunk`` ids."""
    check_device(logits2d, where="chunk_stats")
    R, V = logits2d.shape
    dev = logits2d.device
    chunk = min(triton.next_power_of_2(chunk), triton.next_power_of_2(V))
    S = triton.cdiv(V, chunk)
    temp = torch.tensor([float(temperature)], dtype=torch.float64, device=dev)
    rmax = torch.empty(R, S, dtype=torch.float64, device=dev)
    rsum = torch.empty(R, S, dtype=torch.float64, device=dev)
    if R:
        _chunk_stats[(R, S)](logits2d.contiguous(), temp, rmax, rsum, V, S, CHUNK=chunk,
                             BLOCK=min(block, chunk))
    return rmax, rsum


def verify_tree_sampling_triton(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                                temperature: float, uniforms: torch.Tensor, chunk: int = 4096,
                                block: int = 1024):
    """logits (B, n+1, V), tokens/parents (B, n), uniforms (B, n+1) float64, temperature > 0
    -> (accept_len (B,), path (B, n), bonus (B,))."""
    check_device(logits, tokens, parents, uniforms, where="verify_tree_sampling_triton")
    if not temperature > 0:
        raise ValueError(f"verify_tree_sampling_triton: temperature must be > 0, got {temperature}")
    B, rows, V = logits.shape
    n, dev = rows - 1, logits.device
    accept = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    if B == 0:
        return accept, path, bonus
    flat = logits.reshape(B * rows, V).contiguous()
    chunk = min(triton.next_power_of_2(chunk), triton.next_power_of_2(V))
    rmax, rsum = chunk_stats(flat, temperature, chunk, block)
    S, blk = rmax.shape[1], min(block, chunk)
    npad = max(triton.next_power_of_2(n), 16)
    temp = torch.tensor([float(temperature)], dtype=torch.float64, device=dev)
    _tree_walk[(B,)](flat, temp, rmax, rsum, uniforms.contiguous(), tokens.long().contiguous(),
                     parents.long().contiguous(), accept, path, bonus, n, V, S,
                     NPAD=npad, SPAD=max(triton.next_power_of_2(S), 16), CHUNK=chunk, BLOCK=blk,
                     BLOCK_R=max(16, min(blk, 8192 // npad)))
    return accept, path, bonus
