"""EAGLE-1: predict the target's next feature from (feature at t, embedding of token t+1).

Model (parameter names as vLLM's / SGLang's ``EagleLlamaForCausalLM`` load them):
``fc.weight`` (H, 2H) reads ``[embed(ids[t+1]); feature_t]`` (embedding first, as vLLM's loader
concatenates), then ``layers.0`` is a Llama decoder layer *without* ``input_layernorm``; its
pre-norm output is the predicted feature at ``t+1`` and the target's own LM head turns it into
logits for ``ids[t+2]``. The feature is the target's post-norm last hidden state
(``specheads.targets``). The token embedding and LM head are the target's, frozen and not saved:
call ``model.attach(target)`` after ``from_pretrained``.

Drafting API (docs/architecture.md), the same as EAGLE-3's with ``fuse`` the identity::

    h_out, logits = model.step(hidden_last, input_ids, position_ids, attn_mask, cache)
    # logits: (B, q, V_target); the next step feeds h_out back as `hidden`
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.models.layers import DraftDecoderLayer, KVCache, RotaryEmbedding, UnrollCache, draft_fields_from_target
from specheads.targets import Target


class Eagle1Config(LlamaConfig):
    """A Llama config (``num_hidden_layers`` drafter layers, default 1) plus the target's name."""

    model_type = "specheads_eagle1"
    target: str | None = None

    @classmethod
    def from_target(cls, target: Target, num_layers: int = 1) -> "Eagle1Config":
        return cls(num_hidden_layers=num_layers, target=target.name, tie_word_embeddings=False,
                   **draft_fields_from_target(target.config))


class Eagle1Model(PreTrainedModel):
    config_class = Eagle1Config
    base_model_prefix = "eagle1"
    _supports_sdpa = True

    def __init__(self, config: Eagle1Config):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        # Layer 0 has no input_layernorm (vLLM/SGLang drop it); later layers keep theirs.
        self.layers = nn.ModuleList(DraftDecoderLayer(config, layer=i, input_layernorm=i > 0)
                                    for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config)
        self.__dict__["_embed"] = None  # the target's embedding and LM head: used, never saved
        self.__dict__["_lm_head"] = None
        self.post_init()

    @property
    def num_draft_layers(self) -> int:
        return len(self.layers)

    def attach(self, target: Target) -> "Eagle1Model":
        """Use the target's (frozen) embedding and LM head. Checks that the target matches."""
        if target.hidden_size != self.config.hidden_size or target.vocab_size != self.config.vocab_size:
            raise ValueError(f"target {target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}) does not "
                             f"match this EAGLE-1 head (hidden {self.config.hidden_size}, vocab {self.config.vocab_size})")
        self.__dict__["_embed"] = target.raw_embedding  # the plain table, as the engines give a drafter
        self.__dict__["_lm_head"] = target.lm_head
        return self

    def _need_target(self):
        if self._embed is None:
            raise RuntimeError("Eagle1Model has no token embedding / LM head: call model.attach(target) first")

    # -- drafting API
    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Identity (EAGLE-1 reads the post-norm last hidden state directly); for API symmetry."""
        return hidden.to(self.fc.weight.dtype)

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attn_mask: torch.Tensor | None = None, cache: KVCache | UnrollCache | None = None) -> torch.Tensor:
        """(B, q, H) feature, (B, q) ids and positions -> (B, q, H) predicted next feature.

        attn_mask: (B, q, len(cache) + q) bool, True = attend; None = whole cache + causal.
        """
        self._need_target()
        x = self.fc(torch.cat([self._embed(input_ids).to(hidden.dtype), hidden], dim=-1))
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask, cache)
        return x

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """(..., H) predicted feature -> (..., V_target) through the target's LM head, in the feature's dtype (the
        head's own dtype inside: a bfloat16 target's head under float32 training)."""
        self._need_target()
        weight = getattr(self._lm_head, "weight", None)
        if weight is None or weight.dtype == h_out.dtype:
            return self._lm_head(h_out)
        return self._lm_head(h_out.to(weight.dtype)).to(h_out.dtype)

    def step(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        """``decode`` then ``logits``: returns (h_out (B, q, H), logits (B, q, V_target))."""
        h_out = self.decode(hidden, input_ids, position_ids, attn_mask, cache)
        return h_out, self.logits(h_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)
