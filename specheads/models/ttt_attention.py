"""The training-time test's attention without a dense mask (CPU): no tensor of T x T elements or more.

Step ``i`` of an unroll (``specheads.methods.ttt``, ``layers.UnrollCache``) attends, at position ``t``, causally to
the step-0 keys ``<= t`` (within the sliding window, if the layer has one) and to the key each step ``1..i`` made at
``t`` itself. ``layers.dense_unrolled_attention`` does that with one fused attention over the ``(i+1)T``
concatenated keys under a ``(T, (i+1)T)`` additive mask (``layers.unroll_mask``): memory and time in T². Here the
two kinds of keys are attended apart and merged exactly (one 7-step unroll of an EAGLE-3 head of SmolLM2-135M's
shapes over 8k tokens, forward and backward, float32, 2 CPU cores: 11.0 GiB and 189 CPU-seconds dense, 3.7 GiB and
42 here; ``scripts/bench/ttt_memory.py --loss unroll``):

* the causal block goes to CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``), which
  gives each row's log-sum-exp ``lse0`` besides its output ``o0`` and holds O(T) memory; with a sliding window W
  the queries go ``chunk`` at a time against the keys their windows reach, under a (chunk, chunk + W - 1) mask;
* each later step's diagonal key is one score per position, ``s_j = scale * q . k_j`` (B, heads, T);
* the parts merge by log-sum-exp, in float32 at least: ``L = logsumexp(lse0, s_1, ..)``,
  ``out = exp(lse0 - L) o0 + sum_j exp(s_j - L) v_j``.

The backward is exact. CPU flash attention's backward recomputes ``P = exp(scale q k^T - lse)`` from the
``lse`` it is given and ``D = rowsum(dO * out)`` from the ``out`` it is given; handed the final output and the
final ``L``, it returns the whole softmax's gradient restricted to the causal keys. The diagonal keys add, with
``w_j = exp(s_j - L)`` and ``dS_j = w_j (dO . v_j - D)``: ``dq += scale sum_j dS_j k_j``, ``dk_j = scale dS_j q``,
``dv_j = w_j dO``. Grouped-query heads (heads a multiple of the key/value heads) broadcast each key/value head
over its group for the diagonal terms, whose key/value gradients are summed back over the group. The flash forward
takes unequal head counts itself (``NATIVE_GQA``); the flash backward is given the key/values repeated per query
head and their gradients summed (``_heads(backward=True)``): it runs one thread per (row, key/value head) it is
handed, so native grouped heads would leave cores idle (SmolLM2's 3 key/value heads: 1.5x on 2 threads, 3 of 16).

Other devices and dtypes keep the dense path (``supported`` says which inputs come here). On CUDA the same scheme
would take the log-sum-exp of ``aten._scaled_dot_product_efficient_attention`` (or flash attention's) and hand the
final one to its backward; that is not written: it has not been run on a GPU against the dense path.
"""

from __future__ import annotations

import torch
from packaging.version import Version
from torch.autograd.function import once_differentiable

WINDOW_CHUNK = 512
"""Queries per flash call under a sliding window: each call holds a (chunk, chunk + W - 1) mask."""

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
NATIVE_GQA = Version(torch.__version__).release >= (2, 13)
"""Whether CPU flash attention is handed fewer key/value heads than query heads: checked on torch 2.13 (forward and
backward equal to repeated heads); earlier CPU kernels have indexed the key heads by the query head."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def supported(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
    """Whether ``fused_unrolled_attention`` takes these: CPU tensors, all of one of ``DTYPES`` (or any floating
    dtypes under a CPU autocast to one of them)."""
    tensors = (q, *keys, *values)
    if any(t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") in DTYPES and all(t.is_floating_point() for t in tensors)
    return q.dtype in DTYPES and all(t.dtype == q.dtype for t in tensors)


def autocast_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in CPU autocast's dtype when it is on, as ``scaled_dot_product_attention`` would take them."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


def fused_unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                             window: int | None = None, chunk: int = WINDOW_CHUNK) -> torch.Tensor:
    """Attention of step ``len(keys) - 1`` of an unroll, as ``layers.dense_unrolled_attention`` computes it.

    q: (B, nh, T, D); keys/values: lists of (B, nkv, T, D) (nh a multiple of nkv), entry 0 attended causally
    (within ``window`` of the query's position if given, ``chunk`` queries per flash call), the rest on the diagonal.
    Returns (B, nh, T, D) in q's dtype (CPU autocast's, when on).
    """
    if len(keys) != len(values) or not keys:
        raise ValueError(f"fused_unrolled_attention: {len(keys)} key and {len(values)} value tensors")
    q, *kv = autocast_inputs([q, *keys, *values])
    if not supported(q, kv[: len(keys)], kv[len(keys):]):
        raise ValueError(f"fused_unrolled_attention takes CPU tensors of one dtype among {DTYPES}; got "
                         f"{sorted({(t.device.type, t.dtype) for t in [q, *kv]}, key=str)}")
    if q.shape[1] % keys[0].shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {keys[0].shape[1]}")
    window = None if window is None or window >= q.shape[2] else int(window)
    with torch.autocast("cpu", enabled=False):
        return _FusedUnroll.apply(q, float(scale), window, int(chunk), len(keys), *kv)


class _FusedUnroll(torch.autograd.Function):
    """``fused_unrolled_attention``'s forward and exact backward (module docstring); inputs are
    ``q, scale, window, chunk, steps, *keys, *values``."""

    @staticmethod
    def forward(ctx, q, scale, window, chunk, steps, *kv):
        keys, values = kv[:steps], kv[steps:]
        group = q.shape[1] // keys[0].shape[1]
        o0, lse0 = causal_attention(q, _heads(keys[0], group), _heads(values[0], group), scale, window, chunk)
        out, lse, weights = merge_diagonal(q, o0, lse0, keys[1:], values[1:], scale)
        ctx.scale, ctx.window, ctx.chunk, ctx.steps = scale, window, chunk, steps
        ctx.save_for_backward(q, out, lse, weights, *kv)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, out, lse, weights, *kv = ctx.saved_tensors
        keys, values = kv[: ctx.steps], kv[ctx.steps:]
        group = q.shape[1] // keys[0].shape[1]
        grad_out = grad_out.contiguous()
        k0, v0 = _heads(keys[0], group, backward=True), _heads(values[0], group, backward=True)
        dq, dk0, dv0 = causal_backward(grad_out, q, k0, v0, out, lse, ctx.scale, ctx.window, ctx.chunk)
        dq, dks, dvs = diagonal_backward(grad_out, q, out, weights, keys[1:], values[1:], ctx.scale, dq)
        dk0, dv0 = _sum_heads(dk0, group), _sum_heads(dv0, group)
        return (dq, None, None, None, None, dk0, *dks, dv0, *dvs)


def _heads(kv: torch.Tensor, group: int, backward: bool = False) -> torch.Tensor:
    """(B, nkv, T, D) keys or values as the flash kernel takes them: as they are (the forward, ``NATIVE_GQA``), or
    repeated per query head (the backward, which parallelises over the heads it is handed; older kernels)."""
    return kv if group == 1 or (NATIVE_GQA and not backward) else kv.repeat_interleave(group, dim=1)


def _sum_heads(grad: torch.Tensor, group: int) -> torch.Tensor:
    """The flash backward's key or value gradient (``_heads(kv, group, backward=True)``) back to (B, nkv, T, D)."""
    if group == 1:
        return grad
    B, nh, T, D = grad.shape
    return grad.view(B, nh // group, group, T, D).sum(2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the merge is computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def window_chunks(T: int, window: int, chunk: int, dtype: torch.dtype, device):
    """Yield ``(start, stop, first_key, mask)``: queries ``start..stop-1`` see keys ``first_key..stop-1`` under the
    additive mask (stop - start, stop - first_key), 0 where ``t - window < key <= t``."""
    for start in range(0, T, chunk):
        stop, first = min(start + chunk, T), max(0, start - window + 1)
        qpos = torch.arange(start, stop, device=device)[:, None]
        kpos = torch.arange(first, stop, device=device)[None, :]
        allowed = (kpos <= qpos) & (kpos > qpos - window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        yield start, stop, first, mask


def causal_attention(q, k, v, scale: float, window: int | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, nh, T, D), lse (B, nh, T)) of q over the causal keys k/v, within ``window`` if given."""
    if window is None:
        return _flash(q, k, v, 0.0, True, scale=scale)
    outs, lses = [], []
    for start, stop, first, mask in window_chunks(q.shape[2], window, chunk, q.dtype, q.device):
        o, lse = _flash(q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop], 0.0, False,
                        attn_mask=mask, scale=scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def causal_backward(grad_out, q, k, v, out, lse, scale: float, window: int | None, chunk: int):
    """(dq, dk, dv) of the causal keys' share of the attention whose final output and log-sum-exp are out / lse."""
    if window is None:
        return _flash_backward(grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    acc = _acc_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)  # chunks' key ranges overlap
    for start, stop, first, mask in window_chunks(q.shape[2], window, chunk, q.dtype, q.device):
        rows = slice(start, stop)
        gq, gk, gv = _flash_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, first:stop], v[:, :, first:stop],
                                     out[:, :, rows], lse[:, :, rows], 0.0, False, attn_mask=mask, scale=scale)
        dq[:, :, rows] = gq
        dk[:, :, first:stop] += gk
        dv[:, :, first:stop] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _grouped(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """(B, nh, T, ...) -> (B, nkv, nh / nkv, T, ...): query heads by the key/value head they share."""
    return x.unflatten(1, (nkv, x.shape[1] // nkv))


def merge_diagonal(q, o0, lse0, keys, values, scale: float):
    """Merge the causal part (o0, lse0) with the diagonal keys/values of the later steps.

    Returns (out (B, nh, T, D) in q's dtype, lse (B, nh, T) in lse0's dtype, weights (steps - 1, B, nh, T) of the
    diagonal keys in the merge dtype)."""
    acc = _acc_dtype(q.dtype)
    if not keys:
        return o0, lse0, torch.empty((0, *lse0.shape), dtype=acc)
    nkv = keys[0].shape[1]
    qg = _grouped(q.to(acc), nkv)
    scores = [scale * (qg * k[:, :, None].to(acc)).sum(-1).flatten(1, 2) for k in keys]
    parts = torch.stack([lse0.to(acc), *scores])
    lse = torch.logsumexp(parts, 0)
    weights = torch.exp(parts - lse)
    out = _grouped(weights[0, ..., None] * o0.to(acc), nkv)
    for w, v in zip(weights[1:], values):
        out = out + _grouped(w[..., None], nkv) * v[:, :, None].to(acc)
    return out.flatten(1, 2).to(q.dtype), lse.to(lse0.dtype), weights[1:]


def diagonal_backward(grad_out, q, out, weights, keys, values, scale: float, dq):
    """Add the diagonal keys' terms to the causal part's ``dq``; return (dq, [dk_j], [dv_j]) for steps 1.."""
    if not keys:
        return dq, [], []
    acc, nkv = _acc_dtype(q.dtype), keys[0].shape[1]
    dout, qg = _grouped(grad_out.to(acc), nkv), _grouped(q.to(acc), nkv)
    rowsum = (dout * _grouped(out.to(acc), nkv)).sum(-1)  # D = rowsum(dO * out), as the flash backward takes it
    dqg, dks, dvs = _grouped(dq.to(acc), nkv), [], []
    for w, k, v in zip(weights, keys, values):
        w = _grouped(w, nkv)
        k, v = k[:, :, None].to(acc), v[:, :, None].to(acc)
        ds = (w * ((dout * v).sum(-1) - rowsum))[..., None]
        dqg = dqg + scale * ds * k
        dks.append((scale * ds * qg).sum(2).to(keys[0].dtype))
        dvs.append((w[..., None] * dout).sum(2).to(values[0].dtype))
    return dqg.flatten(1, 2).to(q.dtype), dks, dvs
