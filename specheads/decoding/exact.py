"""Batch-invariant target forwards, so that speculative decoding in reduced precision stays exact.

Speculative decoding is lossless only if the target's logits for a token do not depend on how many
other tokens share its forward: a verify forward over a draft tree must give, for every node, what a
one-token forward after its accepted ancestors gives. In float32 the kernels' shape-dependent
rounding moves logits by ~1e-5 and greedy decoding has never been seen to change; in bfloat16 the
scaled-dot-product attention kernels reduce over the keys in a blocking that depends on the number of
queries and keys, the logits move by up to ~0.4 and greedy outputs diverge (4 of 12 evaluation
prompts, measured). On the CPU the linear layers are already invariant (oneDNN: one output row
depends on its input row only, bitwise, for every row count measured), so the fix is the attention:

- ``exact_attention`` computes softmax(q kᵀ·scale + mask) v in float64 and rounds the result to the
  model's dtype. Different query counts still change the float64 sums in their last bits (~1e-16
  relative), but a bfloat16 rounding (8 mantissa bits) only differs where the value lies within that
  distance of a rounding boundary: about 1e-13 per element, so the rounded outputs, and with them
  every later layer, are bitwise those of one-token forwards in practice (``tests/decoding/
  test_exact.py`` checks every node of random trees, bitwise).
- ``pack_cpu_linears`` (CPU, bfloat16; ``cpu_linears.py``): the linear weights reordered once into
  oneDNN's blocked layout, which removes the per-call weight reorder that makes an unpacked bfloat16
  linear slower than float32 at one row (the same oneDNN kernel whatever the row count, so the layers
  stay invariant).

``make_exact(model, mode)`` applies both where they are needed; the evaluator calls it for the plain
and the speculative decodes alike, so both run the same arithmetic.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specheads.decoding.cpu_linears import can_pack, pack_cpu_linears

log = logging.getLogger(__name__)

ATTENTION_NAME = "specheads_exact"
EXACT_MODES = ("auto", "on", "off")


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, q, d), key/value (B, Hkv, kv, d), mask additive
    (B, 1, q, kv) float, boolean (True = attend) or None (causal, the q queries being the last q keys).
    Returns (B, q, H, dv) in the query's dtype. Like transformers' eager attention of the families that
    have them: ``softcap`` caps the scaled scores (``cap * tanh(s / cap)``, Gemma-2) before the mask;
    ``s_aux`` (gpt-oss's attention sinks, one logit per query head) is an extra softmax column, dropped
    after the softmax. A value head dim other than the query's (DeepSeek's MLA) is kept."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"exact attention does not implement position_bias= (model {type(module).__name__}); "
                                  f"evaluate with exact_forward=off")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux", kwargs.get("sinks"))
    if dropout and module.training:
        raise ValueError("exact attention is for inference: dropout during training is not supported")
    b, h, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    g = h // hkv
    # query head j*g + i reads key/value head j (transformers' repeat_kv order)
    qd = query.to(torch.float64).reshape(b, hkv, g * q, d)
    scores = torch.matmul(qd, key.to(torch.float64).transpose(-1, -2))
    scores.mul_(d ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores.view(b, hkv, g, q, kv)
    if attention_mask is None:
        causal = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)
        scores.masked_fill_(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask[..., :kv].unsqueeze(2), float("-inf"))
    else:
        scores.add_(attention_mask[..., :kv].to(torch.float64).unsqueeze(2))
    scores = scores.view(b, hkv, g * q, kv)
    if sinks is not None:  # head j*g + i's sink logit, beside each of its q rows
        sink = sinks.to(torch.float64).view(1, hkv, g, 1).expand(b, hkv, g, q).reshape(b, hkv, g * q, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :kv]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.matmul(probs, value.to(torch.float64))  # (B, Hkv, g*q, dv)
    return out.view(b, h, q, value.shape[-1]).transpose(1, 2).to(query.dtype).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, exact_attention)


def make_exact(model: nn.Module, mode: str = "auto") -> dict:
    """Make ``model``'s forwards batch-invariant for exact speculative decoding (in place).

    mode ``auto``: on for a reduced-precision model (bfloat16 / float16) on the CPU, off for float32
    and on GPUs (where cuBLAS may pick another kernel per row count, so the linear layers are not
    row-invariant and float64 attention alone would not make the forwards exact); ``on`` / ``off``
    force it. Returns what was done, for the report: {"attention": ..., "packed_linears": n}.
    """
    if mode not in EXACT_MODES:
        raise ValueError(f"exact_forward={mode!r}: use one of {', '.join(EXACT_MODES)}")
    p = next(model.parameters())
    on = mode == "on" or (mode == "auto" and p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16))
    if not on:
        return {"attention": model.config._attn_implementation, "packed_linears": 0}
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    packed = pack_cpu_linears(model) if can_pack(model) and p.dtype == torch.bfloat16 else 0
    log.info("exact forwards: float64 attention, %d linear layers packed for oneDNN", packed)
    return {"attention": ATTENTION_NAME, "packed_linears": packed}
