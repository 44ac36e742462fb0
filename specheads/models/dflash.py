"""DFlash: a block-diffusion drafter that proposes a whole block of tokens in one forward.

Following "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036) in the form the public
trainers (z-lab's reference, vLLM speculators, SpecForge, NVIDIA ModelOpt) train and the engines load it:

* **Context.** The target's states at ``aux_layers`` (our layer convention, ``specheads.targets``) for every
  context position are concatenated, fused by ``fc`` (H, k·H) and normalised by ``hidden_norm``. Each draft
  layer turns that fused state into extra keys and values with its own ``k_proj`` (then ``k_norm`` and RoPE
  at the context position) and ``v_proj``.
* **Block.** A block anchored at position ``a`` holds the token at ``a`` in slot 0 and ``mask_token_id`` in
  slots ``1..B-1``, embedded with the target's (frozen) embedding, at positions ``a..a+B-1``. Its queries
  see the context positions before ``a`` and every slot of their own block (bidirectional); slot ``j``
  predicts the token at ``a+j``, through ``norm`` and the target's LM head.
* **Layers** are Qwen3-style: ``input_layernorm``, attention with per-head ``q_norm``/``k_norm``,
  ``post_attention_layernorm``, SwiGLU ``mlp``. Parameter names are those of the exported
  ``DFlashDraftModel`` (``fc``, ``hidden_norm``, ``layers.i.*``, ``norm``); the embedding and LM head are
  the target's, lent by ``attach(target)`` and never saved.

Drafting API (``KVCache`` from ``specheads.models.layers`` holds the context's keys and values only)::

    cache = model.new_cache()
    model.extend_context(cache, model.fuse(hidden_aux), positions)   # (B, s, k·H), (B, s)
    h = model.decode(block_ids, block_positions, cache, attn_mask)   # (B, q) ids -> (B, q, H)
    logits = model.logits(h)                                         # (B, q, V) target vocabulary

``attn_mask`` is ``(B, q, len(cache) + q)`` bool (True = may attend), the block's own keys last.
``block_attention_mask`` builds it for anchors, training's many blocks per row included. Training passes a
``BlockLayout`` (the anchors, not the mask) instead: on a CPU its blocks attend through
``ranged_attention`` with no (queries, context + queries) mask, elsewhere through the mask it builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.models import ranged_attention
from specheads.models.layers import (DraftMLP, KVCache, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb,
                                    draft_fields_from_target, fusion_linear)
from specheads.targets import Target, default_eagle3_layers


class DFlashConfig(LlamaConfig):
    """The target's layer sizes plus the DFlash fields.

    num_hidden_layers: draft layers; block_size: B (slot 0 the anchor, B-1 drafted tokens); aux_layers:
    fused target layers (layer inputs, see specheads.targets); mask_token_id: the embedding row of the
    masked slots (an existing row of the target's embedding); target_hidden_size, num_target_layers,
    target: the target's width, depth and name.
    """

    model_type = "specheads_dflash"
    block_size: int = 16
    aux_layers: list[int] | None = None
    mask_token_id: int | None = None
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    target: str | None = None

    @classmethod
    def from_target(cls, target: Target, num_layers: int = 1, block_size: int = 16, aux_layers=None,
                    mask_token_id: int | None = None) -> "DFlashConfig":
        aux = list(aux_layers) if aux_layers is not None else list(default_eagle3_layers(target.num_layers))
        mask = default_mask_token(target) if mask_token_id is None else int(mask_token_id)
        return cls(num_hidden_layers=num_layers, block_size=block_size, aux_layers=aux, mask_token_id=mask,
                   target_hidden_size=target.hidden_size, num_target_layers=target.num_layers, target=target.name,
                   tie_word_embeddings=False, **draft_fields_from_target(target.config, mrope=False))


def default_mask_token(target: Target) -> int:
    """The embedding row the masked slots read: the first row past the tokenizer's ids when the embedding has
    spare rows (Qwen3: 151669), else the tokenizer's mask, pad or unk token, else the last row."""
    vocab, tok = target.vocab_size, target.tokenizer
    if tok is not None:
        if len(tok) < vocab:
            return len(tok)
        for name in ("mask_token_id", "pad_token_id", "unk_token_id"):
            tid = getattr(tok, name, None)
            if tid is not None and 0 <= tid < vocab:
                return int(tid)
    return vocab - 1


class DFlashAttention(nn.Module):
    """Grouped-query attention of block queries over [context keys; block keys], Qwen3-style q/k norms."""

    def __init__(self, config):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        B, q, _ = x.shape
        return proj(x).view(B, q, n, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, s, H) states -> keys and values (B, n_kv, s, D): k_norm then RoPE on the keys."""
        k = self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads))
        v = self._heads(x, self.v_proj, self.num_kv_heads)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, attn_mask: "torch.Tensor | BlockLayout") -> torch.Tensor:
        """x: (B, q, H) normed block states; ctx_k/v: (B, n_kv, S, D) or None; attn_mask (B, q, S + q) bool or a
        ``BlockLayout``."""
        B, q_len, _ = x.shape
        q = self.q_norm(self._heads(x, self.q_proj, self.num_heads))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.kv(x, cos, sin)
        if isinstance(attn_mask, BlockLayout):
            out = attn_mask.run(q, ctx_k, ctx_v, k, v, self.head_dim ** -0.5)
        else:
            out = masked_attention(q, ctx_k, ctx_v, k, v, attn_mask, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, q_len, -1))


def masked_attention(q: torch.Tensor, ctx_k: torch.Tensor | None, ctx_v: torch.Tensor | None, k: torch.Tensor,
                     v: torch.Tensor, attn_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, nh, q, D) attention of q over [ctx_k; k] (B, nkv, S + q, D) where ``attn_mask`` (B, q, S + q) is True."""
    if ctx_k is not None:
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.device.type != "cpu":  # CUDA's memory-efficient kernel takes a mask, not unequal head counts
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None], scale=scale, enable_gqa=gqa)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DFlashAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _supports_sdpa = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = fusion_linear(config)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.__dict__["_embed"] = None  # the target's embedding and LM head: used, never registered or saved
        self.__dict__["_lm_head"] = None
        self.post_init()

    @property
    def num_draft_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- wiring to the target
    def attach(self, target: Target) -> "DFlashModel":
        """Use the target's (frozen) token embedding and LM head. Checks that the target matches the config."""
        if target.hidden_size != self.config.hidden_size or target.vocab_size != self.config.vocab_size:
            raise ValueError(f"target {target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}) does not "
                             f"match this DFlash head (hidden {self.config.hidden_size}, vocab {self.config.vocab_size})")
        if not 0 <= int(self.config.mask_token_id) < target.vocab_size:
            raise ValueError(f"mask_token_id {self.config.mask_token_id} is not a row of the target's embedding "
                             f"(vocabulary {target.vocab_size})")
        self.__dict__["_embed"] = target.raw_embedding
        self.__dict__["_lm_head"] = target.logits  # post-norm hidden -> target logits (soft-capped where capped)
        self.__dict__["_head_dtype"] = target.lm_head.weight.dtype
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise RuntimeError("DFlashModel has no token embedding: call model.attach(target) first")
        return self._embed(input_ids).to(self.fc.weight.dtype)

    # -- drafting API
    def fuse(self, hidden_aux: torch.Tensor) -> torch.Tensor:
        """(B, s, n_aux * H_target) target states -> (B, s, H) context states."""
        return self.hidden_norm(self.fc(hidden_aux.to(self.fc.weight.dtype)))

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)

    def extend_context(self, cache: KVCache, context: torch.Tensor, position_ids: torch.Tensor) -> KVCache:
        """Append the keys and values of ``context`` (B, s, H) (``fuse``'s output) at ``position_ids`` (B, s)."""
        cos, sin = self.rotary_emb(context, position_ids)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(context, cos, sin)
            cache.update(i, k, v)
        return cache

    def decode(self, block_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None,
               attn_mask: "torch.Tensor | BlockLayout") -> torch.Tensor:
        """Block tokens (B, q) at ``position_ids`` (B, q) -> (B, q, H) pre-norm states. The block's own keys
        and values are not kept: ``cache`` holds the context only. attn_mask: (B, q, len(cache) + q) bool, or a
        ``BlockLayout`` of q / block_size blocks per row."""
        x = self.embed(block_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        S = 0 if cache is None else len(cache)
        if isinstance(attn_mask, BlockLayout):
            attn_mask.check(block_ids.shape, S)
        elif attn_mask.dtype != torch.bool or attn_mask.shape[1:] != (block_ids.shape[1], S + block_ids.shape[1]):
            raise ValueError(f"attn_mask must be bool (B, q={block_ids.shape[1]}, kv={S + block_ids.shape[1]}); "
                             f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
        for i, layer in enumerate(self.layers):
            ctx_k = None if cache is None or not S else cache.keys[i]
            ctx_v = None if cache is None or not S else cache.values[i]
            x = layer(x, cos, sin, ctx_k, ctx_v, attn_mask)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm states -> (..., V) logits over the target's vocabulary (its LM head)."""
        if self._lm_head is None:
            raise RuntimeError("DFlashModel has no LM head: call model.attach(target) first")
        return self._lm_head(self.norm(h).to(self._head_dtype))  # a float32 head on a bfloat16 target too

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """(...,) anchor tokens -> (..., B) block tokens: the anchor, then mask tokens."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.block_size), int(self.config.mask_token_id))
        block[..., 0] = anchor_ids
        return block


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int,
                         context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n·block_size, context_len + n·block_size) bool mask of ``n`` blocks per row anchored at
    ``anchors`` (B, n): a slot of block ``i`` sees the context positions before its anchor (and valid in
    ``context_valid`` (B, context_len)) and every slot of block ``i``; never another block."""
    B, n = anchors.shape
    pos = torch.arange(context_len, device=anchors.device)
    ctx = pos[None, None, :] < anchors[:, :, None]  # (B, n, S)
    if context_valid is not None:
        ctx = ctx & context_valid[:, None, :].bool()
    ctx = ctx.repeat_interleave(block_size, dim=1)  # (B, n·bs, S)
    blk = torch.arange(n, device=anchors.device).repeat_interleave(block_size)
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # (B, n·bs, n·bs)
    return torch.cat([ctx, own], dim=2)


@dataclass
class BlockLayout:
    """``block_attention_mask``'s pattern without the mask: ``anchors`` (B, n) blocks of ``block_size`` slots per row,
    the context keys valid where ``context_valid`` (B, S) says (None: all)."""

    anchors: torch.Tensor
    block_size: int
    context_valid: torch.Tensor | None = None

    def check(self, block_shape, context_len: int) -> None:
        """Refuse a layout that does not describe (B, q) block tokens over ``context_len`` context positions."""
        B, n = self.anchors.shape
        valid = self.context_valid
        if tuple(block_shape) != (B, n * self.block_size) or (valid is not None and valid.shape != (B, context_len)):
            raise ValueError(f"BlockLayout of {n} blocks of {self.block_size} for batch {B} (context_valid "
                             f"{None if valid is None else tuple(valid.shape)}) does not fit blocks "
                             f"{tuple(block_shape)} over {context_len} context positions")

    def dense(self, context_len: int) -> torch.Tensor:
        """The (B, n·block_size, context_len + n·block_size) bool mask (``block_attention_mask``)."""
        return block_attention_mask(self.anchors, self.block_size, context_len, self.context_valid)

    def run(self, q: torch.Tensor, ctx_k: torch.Tensor | None, ctx_v: torch.Tensor | None, k: torch.Tensor,
            v: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, nh, n·bs, D) attention of the block queries: ``attend`` where it takes the tensors, else through the
        dense mask. A sequence-parallel layout (``training.sequence_parallel.ShardedBlockLayout``) overrides it."""
        out = self.attend(q, ctx_k, ctx_v, k, v, scale)
        if out is None:
            out = masked_attention(q, ctx_k, ctx_v, k, v, self.dense(0 if ctx_k is None else ctx_k.shape[2]), scale)
        return out

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor | None, ctx_v: torch.Tensor | None, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """(B, nh, n·bs, D) attention of the block queries q over the context keys ctx_k/v (B, nkv, S, D) or None and
        the blocks' own keys k/v (B, nkv, n·bs, D), through ``ranged_attention``; None where it does not take the
        tensors (the caller then uses ``dense``)."""
        if ctx_k is None:
            ctx_k, ctx_v = k[:, :, :0], v[:, :, :0]
        if not ranged_attention.supported(q, ctx_k, ctx_v, k, v):
            return None
        B, n = self.anchors.shape
        bs, dev = self.block_size, q.device
        hi = self.anchors.repeat_interleave(bs, dim=1)  # each slot: the context before its block's anchor
        start = torch.arange(n, device=dev).repeat_interleave(bs) * bs  # each slot's block's first key
        index = (start + torch.arange(bs, device=dev)[:, None]).expand(bs, n * bs)[:, None].expand(bs, B, n * bs)
        return ranged_attention.ranged_attention(q, ctx_k, ctx_v, torch.zeros_like(hi), hi, self.context_valid, k, v,
                                                 index, torch.ones(index.shape, dtype=torch.bool, device=dev), scale)
