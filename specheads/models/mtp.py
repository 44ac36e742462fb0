"""The multi-token-prediction (MTP) layer a target checkpoint carries, as a drafter (FastMTP, arXiv 2509.18362).

transformers 5.x builds no MTP module and drops the ``mtp`` tensors when it loads a target, so the layer is
written here, as each family's serving code defines it (vLLM 0.32). Two families:

``mimo`` (``MiMoForCausalLM``: a Qwen2 model plus ``model.mtp_layers.{i}.*``; vLLM ``mimo_mtp.py``)::

    e = token_layernorm(embed(x) masked to 0 at position 0)      (B, q, H)
    h = hidden_layernorm(previous hidden)                        (B, q, H)
    y = Qwen2 decoder layer(input_proj([h; e]))                  pre-norm residual stream
    out = final_layernorm(y)  -> the target's LM head; also the next step's previous hidden

Step 0's previous hidden is the target's *pre-norm* last state (vLLM's MiMo model hands that to its drafter).
The features hold the post-norm state ``w_f * x / rms(x)``; since the MTP normalises it first,
``fuse(post) = post / w_f`` (the target's final-norm weight) gives ``x / rms(x)``, which ``hidden_layernorm``
maps to what it maps ``x`` to (up to the norm's epsilon).

``qwen3_next`` (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``: ``mtp.*``; vLLM
``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``)::

    x = fc([pre_fc_norm_embedding(embed(x)); pre_fc_norm_hidden(previous hidden)])
    y = layers.{i}(x)    a full-attention Qwen3-Next layer (gated attention, query/key norms, partial RoPE;
                         the MLP a sparse MoE where the family's rule makes layer i one, else dense)
    out = norm(y)

with the family's offset RMSNorms (``specheads.models.qwen3_next_parts``). These models hand their drafter the
*post-norm* last state, which is what the features hold: ``fuse`` is the identity.

The embedding and LM head are the target's, frozen and never saved (``attach``). Parameters are named as under
the checkpoint's prefix, inside ``layers.0`` (``specheads.models.mtp_checkpoint`` maps the names both ways).
Drafting API: the same as EAGLE-1's (``fuse``, ``decode``, ``logits``, ``step``, ``new_cache``), so the
training-time unroll (``methods/ttt.py``) and ``EagleDrafter`` run it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.errors import ConfigError
from specheads.models.layers import (DraftDecoderLayer, DraftMLP, KVCache, RMSNorm, RotaryEmbedding, UnrollCache,
                                     draft_fields_from_target)
from specheads.models.qwen3_next_parts import GatedAttention, OffsetRMSNorm, PartialRotaryEmbedding, SparseMoE

FAMILIES = ("mimo", "qwen3_next")
# the target config fields a qwen3_next MTP layer's MoE reads (absent from a dense target's config)
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob")


class MTPConfig(LlamaConfig):
    """The target's layer sizes plus: ``target`` (name or folder), ``family`` (``FAMILIES``), ``mtp_layer`` (which
    of the checkpoint's MTP layers this is), ``num_steps`` (recursive steps trained: the chain to serve),
    ``qkv_bias`` (Qwen2 attention) and, for ``qwen3_next``, ``mtp_moe`` (the layer's MLP is a sparse MoE) with the
    MoE's sizes."""

    model_type = "specheads_mtp"
    target: str | None = None
    family: str = "mimo"
    mtp_layer: int = 0
    num_steps: int = 3
    qkv_bias: bool = True
    mtp_moe: bool = False

    @classmethod
    def from_target(cls, target, family: str, num_steps: int, mtp_layer: int = 0) -> "MTPConfig":
        extra = {}
        if family == "qwen3_next":
            extra = {k: getattr(target.config, k) for k in _MOE_FIELDS if getattr(target.config, k, None) is not None}
            extra["mtp_moe"] = mtp_layer_is_moe(target.config, mtp_layer)
        return cls(num_hidden_layers=1, target=target.name, family=family, mtp_layer=mtp_layer, num_steps=num_steps,
                   qkv_bias=family == "mimo", tie_word_embeddings=False, attention_bias=False,
                   **draft_fields_from_target(target.config), **extra)


def mtp_layer_is_moe(config, mtp_layer: int = 0) -> bool:
    """vLLM's rule for a Qwen3-Next / Qwen3.5 MTP layer ``i``: a sparse MoE unless ``i`` is in ``mlp_only_layers``,
    the target has no experts, or ``(i + 1)`` is no multiple of ``decoder_sparse_step``."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    experts, step = int(get("num_experts") or 0), int(get("decoder_sparse_step") or 1)
    return mtp_layer not in (get("mlp_only_layers") or []) and experts > 0 and (mtp_layer + 1) % step == 0


class MTPLayer(DraftDecoderLayer):
    """One MiMo MTP block: ``forward(embeds (B,q,H), hidden (B,q,H), cos, sin, mask, cache) -> (B,q,H)`` normed."""

    def __init__(self, config: MTPConfig):
        super().__init__(config, layer=0, input_layernorm=True)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(H, eps)
        self.hidden_layernorm = RMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.final_layernorm = RMSNorm(H, eps)
        if config.qkv_bias:  # Qwen2: q/k/v carry a bias, o_proj none (DraftAttention's one flag would bias all four)
            attn = self.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))

    def forward(self, embeds, hidden, cos, sin, attn_mask=None, cache=None):
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))
        return self.final_layernorm(super().forward(x, cos, sin, attn_mask, cache))


class Qwen3NextMTPDecoder(nn.Module):
    """The full-attention Qwen3-Next layer inside the MTP block (pre-norm residual stream, offset norms)."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(H, eps)
        self.self_attn = GatedAttention(config, H)
        self.post_attention_layernorm = OffsetRMSNorm(H, eps)
        self.mlp = SparseMoE(config) if config.mtp_moe else DraftMLP(config)

    def forward(self, x, cos, sin, attn_mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, 0, attn_mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextMTPLayer(nn.Module):
    """One Qwen3-Next / Qwen3.5 MTP block: ``forward(embeds (B,q,H), hidden (B,q,H), cos, sin, mask, cache) ->
    (B,q,H)`` normed. Its ``layers.0`` is the checkpoint's ``mtp.layers.{mtp_layer}``."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(H, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3NextMTPDecoder(config)])
        self.norm = OffsetRMSNorm(H, eps)

    def forward(self, embeds, hidden, cos, sin, attn_mask=None, cache=None):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, cos, sin, attn_mask, cache))


class MTPModel(PreTrainedModel):
    config_class = MTPConfig
    base_model_prefix = "mtp"
    _supports_sdpa = True

    def __init__(self, config: MTPConfig):
        super().__init__(config)
        if config.family not in FAMILIES:
            raise ConfigError(f"MTP family {config.family!r}: implemented are {', '.join(FAMILIES)}")
        qwen = config.family == "qwen3_next"
        self.layers = nn.ModuleList([Qwen3NextMTPLayer(config) if qwen else MTPLayer(config)])
        self.rotary_emb = PartialRotaryEmbedding(config) if qwen else RotaryEmbedding(config)
        self.__dict__["_embed"] = None  # the target's embedding, LM head and final-norm weight: used, never saved
        self.__dict__["_lm_head"] = None
        self.__dict__["_final_norm"] = None
        self.post_init()

    @property
    def num_draft_layers(self) -> int:
        return 1

    def attach(self, target) -> "MTPModel":
        """Use the target's (frozen) embedding, LM head and final-norm weight; checks the sizes and that the
        final norm has no zero weight (``fuse`` divides by it)."""
        if target.hidden_size != self.config.hidden_size or target.vocab_size != self.config.vocab_size:
            raise ValueError(f"target {target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}) does not "
                             f"match this MTP layer (hidden {self.config.hidden_size}, vocab {self.config.vocab_size})")
        norm = target.model.get_decoder().norm.weight.detach()
        if self.config.family == "mimo" and bool((norm == 0).any()):
            raise ConfigError(f"target {target.name}: its final norm has zero weights, so its pre-norm state cannot be "
                              "recovered from the post-norm features the MTP layer is trained on")
        self.__dict__["_embed"] = target.raw_embedding
        self.__dict__["_lm_head"] = target.lm_head
        self.__dict__["_final_norm"] = norm
        return self

    def _need_target(self):
        if self._embed is None:
            raise RuntimeError("MTPModel has no token embedding / LM head: call model.attach(target) first")

    # -- drafting API
    def fuse(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(…, H) the target's post-norm last state -> what the family's MTP reads (see the module doc): MiMo its
        pre-norm direction ``x / rms(x)``, Qwen3-Next the post-norm state itself."""
        self._need_target()
        if self.config.family == "qwen3_next":
            return hidden_last.to(self.layers[0].fc.weight.dtype)
        dtype = self.layers[0].input_proj.weight.dtype
        return (hidden_last.float() / self._final_norm.float()).to(dtype)

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attn_mask: torch.Tensor | None = None, cache: KVCache | UnrollCache | None = None) -> torch.Tensor:
        """(B, q, H) previous hidden (``fuse``d target state, or the previous step's output), (B, q) ids of the
        next tokens and their positions -> (B, q, H) normed output (the LM head's input, the next step's hidden).

        attn_mask: (B, q, len(cache) + q) bool, True = attend; None = whole cache + causal.
        """
        self._need_target()
        embeds = self._embed(input_ids).to(hidden.dtype)
        if self.config.family == "mimo":  # vLLM's MiMo MTP zeroes the token at position 0
            embeds = embeds.masked_fill((position_ids == 0)[..., None], 0.0)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.layers[0](embeds, hidden, cos, sin, attn_mask, cache)

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """(…, H) -> (…, V) through the target's LM head (in the head's dtype inside, the output in ``h_out``'s)."""
        self._need_target()
        weight = getattr(self._lm_head, "weight", None)
        if weight is None or weight.dtype == h_out.dtype:
            return self._lm_head(h_out)
        return self._lm_head(h_out.to(weight.dtype)).to(h_out.dtype)

    def step(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        """``decode`` then ``logits``: (h_out (B, q, H), logits (B, q, V))."""
        h_out = self.decode(hidden, input_ids, position_ids, attn_mask, cache)
        return h_out, self.logits(h_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def new_cache(self) -> KVCache:
        return KVCache(1)
