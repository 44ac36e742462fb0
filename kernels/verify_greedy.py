"""Triton kernels for batched greedy tree verification (reference: ``verify_greedy_reference``).

Two launches, no host sync: ``_split_argmax`` takes the max (and its lowest id) of every chunk of
every one of the B*(n+1) logit rows in parallel, then ``_greedy_walk`` walks each tree in one
program (its n tokens and parents sit in registers), combining the chunk maxima of the rows it
visits (lowest id on ties, like ``torch.argmax``) and writing accept_len, path and bonus.
"""

from __future__ import annotations

import torch

from specheads.kernels import check_device, require_triton

triton, tl = require_triton()


@triton.jit
def _split_argmax(logits_ptr, pval_ptr, pidx_ptr, V, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, k): max and lowest id of that max over ids [k*CHUNK, (k+1)*CHUNK) of the row."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    base = logits_ptr + row * V
    offs = tl.arange(0, BLOCK)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = k * CHUNK  # an all -inf row ends at id 0, as torch.argmax does
    for start in range(0, CHUNK, BLOCK):
        idx = k * CHUNK + start + offs
        inside = idx < V
        x = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.min(tl.where((x == m) & inside, idx, V), 0)
        better = m > best_val  # strict: an equal maximum in a later block keeps the lower id
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(pval_ptr + row * S + k, best_val)
    tl.store(pidx_ptr + row * S + k, best_idx)


@triton.jit
def _argmax_of(pval_ptr, pidx_ptr, row, S, V, SPAD: tl.constexpr):
    """Combine a row's S partial (max, id) pairs: the overall max, lowest id on ties."""
    ks = tl.arange(0, SPAD)
    vals = tl.load(pval_ptr + row * S + ks, mask=ks < S, other=float("-inf"))
    ids = tl.load(pidx_ptr + row * S + ks, mask=ks < S, other=V)
    m = tl.max(vals, 0)
    return tl.min(tl.where((vals == m) & (ks < S), ids, V), 0)


@triton.jit
def _greedy_walk(pval_ptr, pidx_ptr, tokens_ptr, parents_ptr, accept_ptr, path_ptr, bonus_ptr, n, V, S,
                 NPAD: tl.constexpr, SPAD: tl.constexpr):
    """One program per tree: follow the argmax down the tree; path (B, n) is pre-filled with -1."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NPAD)
    valid = offs < n
    toks = tl.load(tokens_ptr + b * n + offs, mask=valid, other=-1).to(tl.int32)
    pars = tl.load(parents_ptr + b * n + offs, mask=valid, other=-3).to(tl.int32)
    node = tl.full((), -1, tl.int32)
    alive = tl.full((), 1, tl.int32)
    acc = tl.full((), 0, tl.int32)
    for d in range(n):
        if alive != 0:
            want = _argmax_of(pval_ptr, pidx_ptr, b * (n + 1) + node + 1, S, V, SPAD)
            hit = tl.min(tl.where((pars == node) & (toks == want) & valid, offs, n), 0)
            ok = hit < n
            tl.store(path_ptr + b * n + d, hit.to(tl.int64), mask=ok)
            node = tl.where(ok, hit, node)
            acc += ok.to(tl.int32)
            alive = ok.to(tl.int32)
    tl.store(accept_ptr + b, acc.to(tl.int64))
    bonus = _argmax_of(pval_ptr, pidx_ptr, b * (n + 1) + node + 1, S, V, SPAD)
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


def verify_greedy_triton(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                         chunk: int = 4096, block: int = 1024):
    """logits (B, n+1, V), tokens/parents (B, n) -> (accept_len (B,), path (B, n), bonus (B,)).

    Each row's vocabulary is split into chunks of ``chunk`` ids, one program each, so a small
    batch still fills the GPU; the walk combines the partial maxima of the rows it visits.
    """
    check_device(logits, tokens, parents, where="verify_greedy_triton")
    B, rows, V = logits.shape
    n, dev = rows - 1, logits.device
    accept = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    if B == 0:
        return accept, path, bonus
    chunk = min(triton.next_power_of_2(chunk), triton.next_power_of_2(V))
    S = triton.cdiv(V, chunk)
    pval = torch.empty(B * rows, S, dtype=torch.float32, device=dev)
    pidx = torch.empty(B * rows, S, dtype=torch.int32, device=dev)
    _split_argmax[(B * rows, S)](logits.reshape(B * rows, V).contiguous(), pval, pidx, V, S,
                                 CHUNK=chunk, BLOCK=min(block, chunk))
    _greedy_walk[(B,)](pval, pidx, tokens.long().contiguous(), parents.long().contiguous(), accept, path,
                       bonus, n, V, S, NPAD=max(triton.next_power_of_2(n), 16),
                       SPAD=max(triton.next_power_of_2(S), 16))
    return accept, path, bonus
