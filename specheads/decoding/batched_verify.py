"""Batched verification of B draft trees at once: exact PyTorch references and the dispatcher.

Same rules as ``verify.py`` (``verify_greedy``, ``verify_tree_sampling``), but for a whole batch
with no Python loop over nodes or rows, and with the randomness made explicit so that the Triton
kernels in ``specheads.kernels`` and these references make bit-identical choices.

Shapes (B trees of n node slots, vocabulary V):
- ``logits (B, n+1, V)``: row 0 = the target after the root, row i+1 = after node i (any float dtype).
- ``tokens (B, n)`` and ``parents (B, n)`` long: ``parents[b, i]`` is an earlier node or ``-1`` (the
  root); ``PAD = -2`` marks an unused slot of a tree smaller than n (see ``pack_trees``).
- Outputs: ``accept_len (B,)`` long, ``path (B, n)`` long accepted node indices padded with ``-1``
  (n is the deepest a tree of n nodes can be, so no host sync is needed to size it), ``bonus (B,)``.

Tie-breaking in argmax: the lowest token id wins (as ``torch.argmax`` does); among duplicate
siblings the lowest node index wins (as ``verify_greedy`` does).

Sampling draws: ``uniforms (B, n+1)`` float64 in [0, 1). Draw k of row b (k = 0, 1, ...) uses
``uniforms[b, k]`` by inverse CDF over p = softmax(logits / T) in float64: the token is the number of
entries of cumsum(p) that are <= u * sum(p) (the first id whose cumulative mass passes u), falling
back to the last id with p > 0 if rounding leaves u * sum(p) at the top. The walk consumes draws in
``verify_tree_sampling``'s order: one per visited node with children, then one for the bonus (from
the leaf's row, or from the row with the rejected children removed). Kernel and reference sum in
different orders, so a choice can differ only when u falls within float64 rounding (~1e-15) of a
CDF boundary.
"""

from __future__ import annotations

import torch

from specheads.decoding.tree import DraftTree, probs
from specheads.decoding.verify import Verdict

PAD = -2
BACKENDS = ("auto", "torch", "triton")
Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ inputs and outputs

def check_batch(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                values: bool = True, where: str = "verify_batched") -> tuple[int, int, int]:
    """Check shapes (free) and, if ``values``, token/parent ranges (one host sync). -> (B, n, V)."""
    if logits.dim() != 3:
        raise ValueError(f"{where}: logits {tuple(logits.shape)} must be (B, n+1, V)")
    B, rows, V = logits.shape
    if tokens.dim() != 2 or tokens.shape != parents.shape:
        raise ValueError(f"{where}: tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} "
                         f"must both be (B, n)")
    if tokens.shape != (B, rows - 1):
        raise ValueError(f"{where}: logits {tuple(logits.shape)} need tokens/parents of shape "
                         f"({B}, {rows - 1}), got {tuple(tokens.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{where}: logits must be floating point, got {logits.dtype}")
    if tokens.is_floating_point() or parents.is_floating_point():
        raise TypeError(f"{where}: tokens and parents must be integer tensors")
    if tokens.device != logits.device or parents.device != logits.device:
        raise ValueError(f"{where}: logits, tokens, parents must share a device")
    n = rows - 1
    if values and n:
        _check_values(tokens, parents, V, where)
    return B, n, V


def _check_values(tokens: torch.Tensor, parents: torch.Tensor, V: int, where: str) -> None:
    real = parents != PAD
    bad_tok = real & ((tokens < 0) | (tokens >= V))
    if bad_tok.any():
        b, i = bad_tok.nonzero()[0].tolist()
        raise ValueError(f"{where}: tokens[{b}, {i}] = {int(tokens[b, i])} is outside [0, {V})")
    idx = torch.arange(tokens.shape[1], device=parents.device)
    bad_par = real & ((parents < -1) | (parents >= idx))
    if bad_par.any():
        b, i = bad_par.nonzero()[0].tolist()
        raise ValueError(f"{where}: parents[{b}, {i}] = {int(parents[b, i])} must be -1, {PAD} "
                         f"(padding) or an earlier node in [0, {i})")


def pack_trees(trees: list[DraftTree], n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack trees of different sizes into tokens, parents (B, n), padding with token 0, parent PAD."""
    n = max((t.size for t in trees), default=0) if n is None else n
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    parents = torch.full((len(trees), n), PAD, dtype=torch.long)
    for b, t in enumerate(trees):
        if t.size > n:
            raise ValueError(f"pack_trees: tree {b} has {t.size} nodes, more than n = {n}")
        tokens[b, :t.size] = t.tokens
        parents[b, :t.size] = t.parents
    return tokens, parents


def to_verdicts(accept_len: torch.Tensor, path: torch.Tensor, bonus: torch.Tensor,
                parents: torch.Tensor) -> list[Verdict]:
    """Per-tree ``Verdict``s (with verify.py's tested/accepted counts per depth) from batched outputs.

    Everything is decided where the outputs are and comes to the host in one copy (a row at a time would wait for
    a GPU once per row)."""
    B, n = path.shape
    last = path.gather(1, (accept_len - 1).clamp(min=0)[:, None]) if n else accept_len.new_zeros(B, 1)
    last = torch.where(accept_len[:, None] > 0, last, -1)  # the last accepted node, -1 = the root
    tested_next = (parents == last).any(1)  # the walk tested a child of it (and rejected every one)
    host = torch.cat([accept_len[:, None].long(), bonus[:, None].long(), tested_next[:, None].long(), path.long()],
                     1).cpu().tolist()
    out = []
    for k, bon, nxt, *row in host:
        depth = k + nxt
        out.append(Verdict(row[:k], bon, [1] * depth, [1] * k + [0] * (depth - k)))
    return out


# ------------------------------------------------------------------ references

def verify_greedy_reference(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> Result:
    """Batched ``verify_greedy``: follow the target's argmax down each tree."""
    B, n, _ = check_batch(logits, tokens, parents, values=False, where="verify_greedy_reference")
    best = logits.argmax(-1)  # (B, n+1)
    node = torch.full((B,), -1, dtype=torch.long, device=logits.device)
    alive = torch.ones(B, dtype=torch.bool, device=logits.device)
    accept = torch.zeros(B, dtype=torch.long, device=logits.device)
    path = torch.full((B, n), -1, dtype=torch.long, device=logits.device)
    for d in range(n):
        want = best.gather(1, (node + 1)[:, None])
        hit = _first_child(parents, node, tokens == want)
        ok = alive & (hit < n)
        path[:, d] = torch.where(ok, hit, -1)
        node = torch.where(ok, hit, node)
        accept += ok
        alive = ok
        if d % 8 == 7 and not alive.any():  # a sync now and then ends the loop early
            break
    return accept, path, best.gather(1, (node + 1)[:, None]).squeeze(1)


def _first_child(parents: torch.Tensor, node: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """(B,) lowest index i with parents[b, i] == node[b] and match[b, i]; n where there is none."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    hit = (parents == node[:, None]) & match
    return torch.where(hit, idx, n).min(1).values if n else node.new_full(node.shape, n)


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(R,) draws from rows p (R, V) >= 0 (need not sum to 1) with uniforms u (R,) in [0, 1)."""
    c = p.cumsum(-1)
    idx = (c <= (u * c[:, -1])[:, None]).sum(-1)
    last = p.shape[-1] - 1 - (p > 0).flip(-1).long().argmax(-1)
    return torch.where(idx < p.shape[-1], idx, last)


def verify_tree_sampling_reference(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                                   temperature: float, uniforms: torch.Tensor) -> Result:
    """Batched ``verify_tree_sampling`` (target-only walk) with draws taken from ``uniforms (B, n+1)``."""
    B, n, V = check_batch(logits, tokens, parents, values=False, where="verify_tree_sampling_reference")
    _check_uniforms(uniforms, B, n, logits.device)
    p_all = probs(logits, temperature)  # (B, n+1, V) float64, as verify.py computes it
    dev, ar = logits.device, torch.arange(B, device=logits.device)
    node = torch.full((B,), -1, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    accept = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, n), -1, dtype=torch.long, device=dev)
    for d in range(n + 1):
        p = p_all[ar, node + 1]  # (B, V)
        x = inverse_cdf(p, uniforms[:, d])
        kids = parents == node[:, None]
        hit = _first_child(parents, node, tokens == x[:, None])
        ok = alive & (hit < n)
        miss = alive & ~ok & kids.any(1)
        r = _residual_draw(p, tokens, kids, x, uniforms[:, min(d + 1, n)], V)
        bonus = torch.where(alive & ~ok, torch.where(miss, r, x), bonus)
        if d < n:
            path[:, d] = torch.where(ok, hit, -1)
        node = torch.where(ok, hit, node)
        accept += ok
        alive = ok
        if not alive.any():  # reference only: one sync per level ends the walk early
            break
    return accept, path, bonus


def _residual_draw(p: torch.Tensor, tokens: torch.Tensor, kids: torch.Tensor, x: torch.Tensor,
                   u: torch.Tensor, V: int) -> torch.Tensor:
    """(B,) draw from p (B, V) with the children's tokens removed; x where nothing is left."""
    drop = torch.zeros(p.shape[0], V + 1, dtype=torch.bool, device=p.device)
    drop.scatter_(1, torch.where(kids, tokens, V), True)
    rest = p.masked_fill(drop[:, :V], 0)
    s = rest.sum(-1, keepdim=True)
    r = inverse_cdf(rest / torch.where(s > 0, s, 1), u)
    return torch.where(s.squeeze(1) > 0, r, x)


def _check_uniforms(u: torch.Tensor, B: int, n: int, device: torch.device) -> None:
    if u.shape != (B, n + 1):
        raise ValueError(f"uniforms {tuple(u.shape)} must be (B, n+1) = ({B}, {n + 1})")
    if u.dtype != torch.float64 or u.device != device:
        raise ValueError(f"uniforms must be float64 on {device}, got {u.dtype} on {u.device}")


# ------------------------------------------------------------------ dispatcher

def pick_backend(backend: str, logits: torch.Tensor) -> str:
    """'auto' -> 'triton' for CUDA logits when Triton imports, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown verification backend '{backend}' (one of {', '.join(BACKENDS)})")
    if backend != "auto":
        return backend
    from specheads.kernels import triton_available
    return "triton" if logits.is_cuda and triton_available() else "torch"


def verify_greedy_batched(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                          backend: str = "auto", check: bool = True) -> Result:
    """Greedy verification of B trees -> (accept_len (B,), path (B, n), bonus (B,)).

    ``check=False`` skips the value checks (their one host sync) for serving loops.
    """
    check_batch(logits, tokens, parents, values=check, where="verify_greedy_batched")
    if pick_backend(backend, logits) == "torch":
        return verify_greedy_reference(logits, tokens, parents)
    from specheads.kernels.verify_greedy import verify_greedy_triton
    return verify_greedy_triton(logits, tokens, parents)


def verify_tree_sampling_batched(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                                 temperature: float, uniforms: torch.Tensor | None = None,
                                 generator: torch.Generator | None = None, backend: str = "auto",
                                 check: bool = True) -> Result:
    """Target-only tree walk for B trees -> (accept_len, path, bonus); greedy at temperature <= 0.

    Draws come from ``uniforms (B, n+1)`` float64, or are drawn from ``generator`` (on the
    generator's device, then moved to the logits' device) when ``uniforms`` is None.
    """
    B, n, _ = check_batch(logits, tokens, parents, values=check, where="verify_tree_sampling_batched")
    if temperature <= 0:
        return verify_greedy_batched(logits, tokens, parents, backend, check=False)
    if uniforms is None:
        gen_dev = generator.device if generator is not None else logits.device
        uniforms = torch.rand(B, n + 1, generator=generator, dtype=torch.float64,
                              device=gen_dev).to(logits.device)
    _check_uniforms(uniforms, B, n, logits.device)
    if pick_backend(backend, logits) == "torch":
        return verify_tree_sampling_reference(logits, tokens, parents, temperature, uniforms)
    from specheads.kernels.tree_sampling import verify_tree_sampling_triton
    return verify_tree_sampling_triton(logits, tokens, parents, temperature, uniforms)


# ------------------------------------------------------------------ verify.py's per-tree signatures

def verify_greedy_fused(logits: torch.Tensor, tree: DraftTree, backend: str = "auto") -> Verdict:
    """``verify_greedy(logits (n+1, V), tree)`` through the batched dispatcher (B = 1)."""
    out = verify_greedy_batched(logits[None], tree.tokens[None].to(logits.device),
                                tree.parents[None].to(logits.device), backend)
    return to_verdicts(*out, tree.parents[None].to(logits.device))[0]


def verify_tree_sampling_fused(logits: torch.Tensor, tree: DraftTree, temperature: float,
                               generator: torch.Generator | None = None, backend: str = "auto") -> Verdict:
    """``verify_tree_sampling`` through the batched dispatcher (B = 1); same law, and its draws are
    the inverse-CDF draws of ``torch.rand(1, n+1, generator=generator, dtype=float64)``."""
    parents = tree.parents[None].to(logits.device)
    out = verify_tree_sampling_batched(logits[None], tree.tokens[None].to(logits.device), parents,
                                       temperature, generator=generator, backend=backend)
    return to_verdicts(*out, parents)[0]
