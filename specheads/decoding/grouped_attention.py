"""Scaled-dot-product attention for grouped-query targets that never copies the KV cache.

A verify forward feeds a few tokens against a long cache. For a grouped-query model (``g`` query heads
per key/value head) with a mask, transformers' SDPA path repeats every key/value head ``g`` times
(``repeat_kv``: a copy of the whole cache, per layer, per forward) unless exactly one token is fed;
for one token it folds the ``g`` heads into the query rows instead. On SmolLM2-135M (g = 3, a
404-token cache, 2 CPU cores) those copies were 7.3 ms of a 5-token forward, about an eighth of a
plain decoding step, spent by every tree or chain the evaluator verifies and by no plain step.

``grouped_sdpa_attention`` folds the heads for any number of fed tokens: the ``g`` query heads that
read key/value head ``j`` become ``g·q`` query rows of one head, the mask is repeated for them (``q·kv``
values per head: small beside the cache), and SDPA runs on the cache as stored. Each query row attends
to the same keys with the same mask as before; for one token it is transformers' own folding. A long
forward (a prefill), whose repeated mask would outweigh the cache copy it saves (``g·q > 2·Hkv·d``),
goes to transformers' SDPA as before.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION_NAME = "specheads_grouped_sdpa"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None,
                           dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, q, d), key/value (B, Hkv, kv, d), mask additive
    (B, 1, q, kv) float, boolean (True = attend) or None (causal, the q queries being the last q keys).
    Returns (B, q, H, d)."""
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"grouped SDPA attention does not implement {name}= (model "
                                      f"{type(module).__name__}); decode with the model's own attention")
    b, h, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    g = h // hkv
    if g * q > 2 * hkv * d:  # the folded mask would cost more than the copied cache
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if attention_mask is None:
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)[None, None]
    mask = attention_mask[..., :kv]
    if mask.shape[1] != 1:
        raise ValueError(f"grouped SDPA attention needs one mask for all heads, got {tuple(mask.shape)}")
    # query head j*g + i reads key/value head j (transformers' repeat_kv order)
    qg = query.reshape(b, hkv, g * q, d)
    mg = mask.unsqueeze(2).expand(mask.shape[0], 1, g, q, kv).reshape(mask.shape[0], 1, g * q, kv)
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, key, value, attn_mask=mg, dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.view(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module) -> bool:
    """Switch a grouped-query model that runs transformers' SDPA to ``grouped_sdpa_attention`` (in
    place); returns whether it did. Other models (eager, exact or flash attention, one query head per
    key/value head, attention with soft-capped scores or sinks, which SDPA cannot take) are left as they are."""
    cfg = model.config
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if cfg._attn_implementation != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    if getattr(cfg, "attn_logit_softcapping", None) or any(n.endswith("sinks") for n, _ in model.named_parameters()):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    return True
