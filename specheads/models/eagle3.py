"""EAGLE-3: a one-layer drafter over fused low/mid/high target features, with its own draft vocabulary.

Model (parameter names as vLLM's ``LlamaForCausalLMEagle3`` / vLLM-speculators load them):
``fc.weight`` (H, 3H) fuses ``hidden_aux``; ``midlayer`` is a ``DraftDecoderLayer`` whose attention
reads ``[input_layernorm(embed(ids)); hidden_norm(hidden)]`` (2H); ``norm`` then ``lm_head``
(V_draft, H) give draft logits; ``d2t``/``t2d`` map draft ids to target ids
(``specheads.models.vocab``). The token embedding is the target's, frozen and not saved: call
``model.attach(target)`` after ``from_pretrained``.

Normalisation options (each off by default; named as speculators 0.9's ``Eagle3SpeculatorConfig`` and vLLM 0.32's
``LlamaForCausalLMEagle3`` read them):
``fc_norm``: an RMSNorm per fused feature before ``fc`` (``fc_norm.{i}``, (H_target,) each);
``norm_before_fc``: one RMSNorm over the concatenated features before ``fc`` (``input_norm``, (n_aux * H_target,));
``norm_before_residual``: the residual stream of ``midlayer`` starts from ``hidden_norm(hidden)``, not ``hidden``;
``norm_output``: ``decode`` returns the post-``norm`` state, which the next step reads and ``lm_head`` reads as it is
(the logits are unchanged, only what is fed back differs).

Draft-layer options of speculators 0.9's default recipe (off by default; ``specheads.models.layers``):
``sliding_window`` W with ``layer_types`` (``"sliding_attention"`` per sliding layer): a query sees only the keys
within W positions of its anchor (training: speculators' ``kv_idx > q_idx - W`` on step 0's keys; drafting: the same
rule with the tree's root as every node's anchor, given to ``decode`` as ``window_mask``);
``qk_norm``: Qwen3's per-head ``self_attn.q_norm`` / ``self_attn.k_norm`` before RoPE (speculators' ``--draft-arch
qwen3``, its P-EAGLE default).

Drafting API (docs/architecture.md)::

    h0 = model.fuse(hidden_aux)                                 # (B, q, 3H) -> (B, q, H)
    h_out, logits = model.step(h0, input_ids, position_ids, attn_mask, cache)
    target_ids = model.to_target_ids(logits.argmax(-1))
    # the next step feeds h_out back as `hidden` (pre-norm output; post-norm with norm_output)

The input at position ``t`` is (feature at ``t``, token ``ids[t+1]``) and the drafter's position id
is ``t``; a token drafted ``i`` steps later uses position ``t+i``.

Tree drafting with the cache (``specheads.models.layers``): ``cache = model.new_cache()``; feed
the prompt's (feature, next token) pairs with ``attn_mask=None`` (causal); then for each tree
level pass the new nodes as ``q`` queries with a ``(B, q, len(cache) + q)`` bool mask that is
True on the committed prefix, on the node's ancestors already in the cache and on itself (the
same token can sit at the same position in two branches). After verification keep the accepted
entries with ``cache.select(index)`` (``(S',)`` or per-row ``(B, S')``) or ``cache.crop(n)``.
A query row must see at least one key (a fully masked row yields NaN for that row only).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.models.layers import (DraftDecoderLayer, KVCache, RMSNorm, UnrollCache,
                                    draft_fields_from_target, fusion_linear, layer_window, window_mask)
from specheads.models.mrope import rotary_embedding
from specheads.targets import Target, default_eagle3_layers

class Eagle3Config(LlamaConfig):
    """A one-layer Llama config plus the EAGLE-3 fields.

    draft_vocab_size: rows of lm_head; target_hidden_size: width of each fused target feature;
    aux_layers: target layer inputs fused by fc (see specheads.targets); target: the target's name;
    fc_norm: one RMSNorm per fused feature before fc (EAGLE-3.1; vLLM's ``fc_norm``, speculators' ``--fc-norm``);
    norm_before_fc: one RMSNorm over the concatenated fused features before fc (speculators' and vLLM's
    ``norm_before_fc``, weight ``input_norm``); norm_before_residual: the draft layer's residual starts from the normed
    hidden state; norm_output: the post-norm state is fed back between draft steps (see the module docstring);
    sliding_window / layer_types: the draft layers' sliding window, as transformers' configs name them; qk_norm:
    Qwen3's per-head q/k RMSNorms; hidden_after_input_norm: the draft layer norms the fed hidden state with
    ``input_layernorm`` before ``hidden_norm`` (how NVIDIA ModelOpt's trainer computes it; no engine does: read for
    evaluating such heads, never trained or exported here). A config.json written before these options reads them
    as off.
    """

    model_type = "specheads_eagle3"
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved"}  # a VL target's M-RoPE (models.mrope)
    draft_vocab_size: int = 32000
    target_hidden_size: int | None = None
    aux_layers: list[int] | None = None
    target: str | None = None
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    qk_norm: bool = False
    hidden_after_input_norm: bool = False

    @classmethod
    def from_target(cls, target: Target, draft_vocab_size: int, aux_layers=None, fc_norm: bool = False,
                    norm_before_fc: bool = False, norm_before_residual: bool = False,
                    norm_output: bool = False, sliding_window: int | None = None, qk_norm: bool = False,
                    num_layers: int = 1, mrope: bool = True) -> "Eagle3Config":
        """sliding_window: W for every draft layer (None: full attention); num_layers: P-EAGLE's layer count;
        mrope: keep a vision-language target's M-RoPE settings (``draft_fields_from_target``; P-EAGLE drops them)."""
        aux = list(aux_layers) if aux_layers is not None else list(default_eagle3_layers(target.num_layers))
        window = {} if sliding_window is None else {"sliding_window": int(sliding_window),
                                                    "layer_types": ["sliding_attention"] * int(num_layers)}
        if sliding_window is not None and int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 (or null), got {sliding_window}")
        return cls(num_hidden_layers=int(num_layers), draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                   target_hidden_size=target.hidden_size, aux_layers=aux, target=target.name, fc_norm=fc_norm,
                   norm_before_fc=norm_before_fc, norm_before_residual=norm_before_residual, norm_output=norm_output,
                   qk_norm=bool(qk_norm), tie_word_embeddings=False, **window,
                   **draft_fields_from_target(target.config, mrope=mrope))


class Eagle3Model(PreTrainedModel):
    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _supports_sdpa = True

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        H = config.hidden_size
        n_aux, Ht = len(config.aux_layers or (0, 0, 0)), config.target_hidden_size or H
        self.fc = fusion_linear(config)
        self.input_norm = RMSNorm(n_aux * Ht, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(Ht, config.rms_norm_eps)
                                     for _ in range(n_aux)) if getattr(config, "fc_norm", False) else None
        self.midlayer = DraftDecoderLayer(config, layer=0, embeds_input=True,
                                          norm_before_residual=config.norm_before_residual,
                                          hidden_after_input_norm=getattr(config, "hidden_after_input_norm", False))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary_emb = rotary_embedding(config)  # M-RoPE where the target's rope settings name an mrope_section
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.__dict__["_embed"] = None  # the target's embedding: used, never registered or saved
        self.post_init()

    num_draft_layers = 1

    # -- wiring to the target
    def attach(self, target: Target) -> "Eagle3Model":
        """Use the target's (frozen) token embedding. Checks that the target matches the config."""
        if target.hidden_size != self.config.hidden_size or target.vocab_size != self.config.vocab_size:
            raise ValueError(f"target {target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}) does not "
                             f"match this EAGLE-3 head (hidden {self.config.hidden_size}, vocab {self.config.vocab_size})")
        self.__dict__["_embed"] = target.raw_embedding  # the plain table, as the engines give a drafter
        return self

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit "
                             f"({self.config.draft_vocab_size},) / ({self.config.vocab_size},)")
        if int(t2d.sum()) != d2t.numel():
            raise ValueError(f"t2d marks {int(t2d.sum())} ids but d2t has {d2t.numel()}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise RuntimeError("Eagle3Model has no token embedding: call model.attach(target) first")
        return self._embed(input_ids).to(self.fc.weight.dtype)

    # -- drafting API
    def fuse(self, hidden_aux: torch.Tensor) -> torch.Tensor:
        """(B, q, n_aux * H_target) target features -> (B, q, H) drafter input (normed first with ``input_norm``,
        then each feature with ``fc_norm``, in vLLM's order)."""
        x = hidden_aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attn_mask: torch.Tensor | None = None, cache: KVCache | UnrollCache | None = None,
               window_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's layers: (B, q, H) hidden, (B, q) ids and positions -> (B, q, H) output, the state the next
        step reads: pre-norm, or after ``norm`` with ``norm_output``.

        attn_mask: (B, q, len(cache) + q) bool, True = attend; None = whole cache + causal.
        window_mask: the same shape, the keys within each query's sliding window (``self.window_mask``), read by the
        sliding-window layers only; needed with an explicit ``attn_mask`` when a layer slides.
        """
        cos, sin = self.rotary_emb(hidden, position_ids)
        h = self.midlayer(hidden, cos, sin, attn_mask, cache, embeds=self.embed(input_ids), window_mask=window_mask)
        for layer in self.extra_layers():
            h = layer(h, cos, sin, attn_mask, cache, window_mask=window_mask)
        return self.norm(h) if self.config.norm_output else h

    @property
    def sliding_window(self) -> int | None:
        """W when any draft layer slides (they share the config's one W), else None."""
        windows = {layer_window(self.config, i) for i in range(self.num_draft_layers)} - {None}
        return windows.pop() if windows else None

    def window_mask(self, anchor: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor | None:
        """(B, q, kv) bool keys within the window of each query's ``anchor`` (B, q), given the keys' positions (B, kv);
        None when no draft layer slides."""
        W = self.sliding_window
        return None if W is None else window_mask(anchor, key_pos, W)

    def extra_layers(self) -> list:
        """Decoder layers after ``midlayer`` (none for EAGLE-3; P-EAGLE's ``layers.{i}``, i >= 1)."""
        return []

    def normed(self, h_out: torch.Tensor) -> torch.Tensor:
        """(..., H) ``decode`` output -> the post-norm state ``lm_head`` reads (``h_out`` itself with ``norm_output``)."""
        return h_out if self.config.norm_output else self.norm(h_out)

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """(..., H) ``decode`` output -> (..., V_draft) draft logits."""
        return self.lm_head(self.normed(h_out))

    def step(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        """``decode`` then ``logits``: returns (h_out (B, q, H), logits (B, q, V_draft))."""
        h_out = self.decode(hidden, input_ids, position_ids, attn_mask, cache)
        return h_out, self.logits(h_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)
