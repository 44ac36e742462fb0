"""Triton kernels for batched greedy tree verification (reference: ``verify_greedy_reference``).

Two launches, no host sync: ``_row_argmax`` takes the argmax of all B*(n+1) logit rows in parallel
(lowest id on ties, like ``torch.argmax``), then ``_greedy_walk`` walks each tree in one program
(its n tokens and parents sit in registers), writing accept_len, path and bonus.
"""

from __future__ import annotations

import torch

from specheads.kernels import check_device, require_triton

triton, tl = require_triton()


@triton.jit
def _row_argmax(logits_ptr, best_ptr, V, BLOCK: tl.constexpr):
    """best[row] = lowest index of the row's maximum; logits (R, V) contiguous."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    offs = tl.arange(0, BLOCK)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        inside = idx < V
        x = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.min(tl.where((x == m) & inside, idx, V), 0)
        better = m > best_val  # strict: an equal maximum in a later block keeps the lower id
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(best_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _greedy_walk(best_ptr, tokens_ptr, parents_ptr, accept_ptr, path_ptr, bonus_ptr, n,
                 NPAD: tl.constexpr):
    """One program per tree: follow best[] down the tree; path (B, n) is pre-filled with -1."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NPAD)
    valid = offs < n
    toks = tl.load(tokens_ptr + b * n + offs, mask=valid, other=-1)
    pars = tl.load(parents_ptr + b * n + offs, mask=valid, other=-3).to(tl.int32)
    node = tl.full((), -1, tl.int32)
    alive = tl.full((), 1, tl.int32)
    acc = tl.full((), 0, tl.int32)
    for d in range(n):
        want = tl.load(best_ptr + b * (n + 1) + node + 1)
        hit = tl.min(tl.where((pars == node) & (toks == want) & valid, offs, n), 0)
        ok = (alive != 0) & (hit < n)
        tl.store(path_ptr + b * n + d, hit.to(tl.int64), mask=ok)
        node = tl.where(ok, hit, node)
        acc += ok.to(tl.int32)
        alive = ok.to(tl.int32)
    tl.store(accept_ptr + b, acc.to(tl.int64))
    tl.store(bonus_ptr + b, tl.load(best_ptr + b * (n + 1) + node + 1))


def row_argmax(logits2d: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """(R, V) -> (R,) long argmax, lowest id on ties."""
    R, V = logits2d.shape
    best = torch.empty(R, dtype=torch.long, device=logits2d.device)
    if R:
        _row_argmax[(R,)](logits2d, best, V, BLOCK=min(block, triton.next_power_of_2(V)))
    return best


def verify_greedy_triton(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
    """logits (B, n+1, V), tokens/parents (B, n) -> (accept_len (B,), path (B, n), bonus (B,))."""
    check_device(logits, tokens, parents, where="verify_greedy_triton")
    B, rows, V = logits.shape
    n = rows - 1
    best = row_argmax(logits.reshape(B * rows, V).contiguous())
    accept = torch.zeros(B, dtype=torch.long, device=logits.device)
    path = torch.full((B, n), -1, dtype=torch.long, device=logits.device)
    bonus = torch.zeros(B, dtype=torch.long, device=logits.device)
    if B:
        _greedy_walk[(B,)](best, tokens.long().contiguous(), parents.long().contiguous(), accept, path,
                           bonus, n, NPAD=max(triton.next_power_of_2(n), 16))
    return accept, path, bonus
