"""EAGLE-3: a one-layer drafter over fused low/mid/high target features, with its own draft vocabulary.

Model (parameter names as vLLM's ``LlamaForCausalLMEagle3`` / vLLM-speculators load them):
``fc.weight`` (H, 3H) fuses ``hidden_aux``; ``midlayer`` is a ``DraftDecoderLayer`` whose attention
reads ``[input_layernorm(embed(ids)); hidden_norm(hidden)]`` (2H); ``norm`` then ``lm_head``
(V_draft, H) give draft logits; ``d2t``/``t2d`` map draft ids to target ids
(``specheads.heads.vocab``). The token embedding is the target's, frozen and not saved: call
``model.attach(target)`` after ``from_pretrained``.

Drafting API (docs/architecture.md)::

    h0 = model.fuse(hidden_aux)                                 # (B, q, 3H) -> (B, q, H)
    h_out, logits = model.step(h0, input_ids, position_ids, attn_mask, cache)
    target_ids = model.to_target_ids(logits.argmax(-1))
    # the next step feeds h_out back as `hidden` (pre-norm output)

The input at position ``t`` is (feature at ``t``, token ``ids[t+1]``) and the drafter's position id
is ``t``; a token drafted ``i`` steps later uses position ``t+i``.

Tree drafting with the cache (``specheads.heads.layers``): ``cache = model.new_cache()``; feed
the prompt's (feature, next token) pairs with ``attn_mask=None`` (causal); then for each tree
level pass the new nodes as ``q`` queries with a ``(B, q, len(cache) + q)`` bool mask that is
True on the committed prefix, on the node's ancestors already in the cache and on itself (the
same token can sit at the same position in two branches). After verification keep the accepted
entries with ``cache.select(index)`` (``(S',)`` or per-row ``(B, S')``) or ``cache.crop(n)``.
A query row must see at least one key (a fully masked row yields NaN for that row only).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.heads.layers import (DraftDecoderLayer, KVCache, RMSNorm, RotaryEmbedding, UnrollCache,
                                    draft_fields_from_target)
from specheads.heads.vocab import build_draft_vocab, count_loss_tokens, coverage
from specheads.targets import Target, default_eagle3_layers
from specheads.training.losses import target_argmax, target_probs
from specheads.training.method import FeatureSpec, StepOutput
from specheads.training.ttt import TargetRows, step_rows, summarize_steps, ttt_loss, unrolled_accuracy

log = logging.getLogger(__name__)

class Eagle3Config(LlamaConfig):
    """A one-layer Llama config plus the EAGLE-3 fields.

    draft_vocab_size: rows of lm_head; target_hidden_size: width of each fused target feature;
    aux_layers: target layer inputs fused by fc (see specheads.targets); target: the target's name.
    """

    model_type = "specheads_eagle3"
    draft_vocab_size: int = 32000
    target_hidden_size: int | None = None
    aux_layers: list[int] | None = None
    target: str | None = None

    @classmethod
    def from_target(cls, target: Target, draft_vocab_size: int, aux_layers=None) -> "Eagle3Config":
        aux = list(aux_layers) if aux_layers is not None else list(default_eagle3_layers(target.num_layers))
        return cls(num_hidden_layers=1, draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                   target_hidden_size=target.hidden_size, aux_layers=aux, target=target.name,
                   tie_word_embeddings=False, **draft_fields_from_target(target.config))


class Eagle3Model(PreTrainedModel):
    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _supports_sdpa = True

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        H = config.hidden_size
        n_aux = len(config.aux_layers or (0, 0, 0))
        self.fc = nn.Linear(n_aux * (config.target_hidden_size or H), H, bias=False)
        self.midlayer = DraftDecoderLayer(config, layer=0, embeds_input=True)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
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
        self.__dict__["_embed"] = target.embed_tokens
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
        """(B, q, n_aux * H_target) target features -> (B, q, H) drafter input."""
        return self.fc(hidden_aux.to(self.fc.weight.dtype))

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attn_mask: torch.Tensor | None = None, cache: KVCache | UnrollCache | None = None) -> torch.Tensor:
        """One drafter layer: (B, q, H) hidden, (B, q) ids and positions -> (B, q, H) pre-norm output.

        attn_mask: (B, q, len(cache) + q) bool, True = attend; None = whole cache + causal.
        """
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.midlayer(hidden, cos, sin, attn_mask, cache, embeds=self.embed(input_ids))

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm output -> (..., V_draft) draft logits."""
        return self.lm_head(self.norm(h_out))

    def step(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        """``decode`` then ``logits``: returns (h_out (B, q, H), logits (B, q, V_draft))."""
        h_out = self.decode(hidden, input_ids, position_ids, attn_mask, cache)
        return h_out, self.logits(h_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)


class Eagle3Method:
    """EAGLE-3 training: training-time test over ``ttt_steps`` steps, soft CE on the draft vocabulary.

    draft_vocab_size: draft vocabulary (capped at the target's); vocab_data: prepared dataset whose
    loss-masked token counts pick it (required unless ``build`` gets a model with its vocab set);
    vocab_max_samples: count at most this many conversations; aux_layers: None = the default
    (2, N//2, N-3); ttt_steps / step_decay: unroll length and step-loss weights decay**i;
    target_chunk / head_chunk: rows per chunk for the target's and the drafter's logits;
    init_lm_head_from_target: start lm_head from the target's rows of the draft vocabulary.
    """

    name = "eagle3"

    def __init__(self, draft_vocab_size: int = 32000, vocab_data: str | None = None,
                 vocab_max_samples: int | None = None, aux_layers=None, ttt_steps: int = 3,
                 step_decay: float = 0.8, target_chunk: int = 1024, head_chunk: int = 2048,
                 init_lm_head_from_target: bool = False):
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        self.draft_vocab_size = draft_vocab_size
        self.vocab_data = vocab_data
        self.vocab_max_samples = vocab_max_samples
        self.aux_layers = None if aux_layers is None else tuple(int(i) for i in aux_layers)
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.target_chunk, self.head_chunk = target_chunk, head_chunk
        self.init_lm_head_from_target = init_lm_head_from_target
        self._num_target_layers: int | None = None

    @property
    def feature_spec(self) -> FeatureSpec:
        """Needs the target's layer count when ``aux_layers`` is unset: call ``bind(target)`` or ``build`` first."""
        if self.aux_layers is None:
            if self._num_target_layers is None:
                raise RuntimeError("Eagle3Method.feature_spec: aux_layers is unset; call bind(target) or build(target) first")
            return FeatureSpec(aux_layers=default_eagle3_layers(self._num_target_layers), need_last=True)
        return FeatureSpec(aux_layers=self.aux_layers, need_last=True)

    def bind(self, target: Target) -> "Eagle3Method":
        self._num_target_layers = target.num_layers
        return self

    def build(self, target: Target) -> Eagle3Model:
        self.bind(target)
        config = Eagle3Config.from_target(target, self.draft_vocab_size, self.feature_spec.aux_layers)
        model = Eagle3Model(config).to(target.device).attach(target)
        if self.vocab_data is None:
            raise ValueError("Eagle3Method needs vocab_data (a prepared dataset) to pick the draft vocabulary: "
                             "set method.vocab_data=<path>")
        counts = count_loss_tokens(self.vocab_data, target.vocab_size, self.vocab_max_samples)
        d2t, t2d = build_draft_vocab(counts, config.draft_vocab_size)
        log.info("draft vocabulary %d covers %.2f%% of loss tokens", config.draft_vocab_size, 100 * coverage(counts, t2d))
        model.set_draft_vocab(d2t.to(target.device), t2d.to(target.device))
        if self.init_lm_head_from_target:
            self._init_lm_head(model, target)
        return model

    @staticmethod
    def _init_lm_head(model: Eagle3Model, target: Target) -> None:
        ids = model.t2d.nonzero().squeeze(-1)
        with torch.no_grad():
            model.lm_head.weight.copy_(target.lm_head.weight.index_select(0, ids).to(model.lm_head.weight))

    # -- training
    def target_rows(self, model: Eagle3Model, batch: dict, target: Target) -> TargetRows:
        """The target's distribution (on the draft vocabulary) at rows ``s`` with ``ids[s+1]`` trained."""
        last = batch["hidden_last"]
        B, T, _ = last.shape
        need = torch.zeros(B, T, dtype=torch.bool, device=last.device)
        need[:, : T - 1] = (batch["loss_mask"][:, 1:] > 0) & (batch["attention_mask"][:, 1:] > 0)
        columns = model.t2d.nonzero().squeeze(-1)
        probs, argmax_rows = target_probs(target.logits, last[need], columns, self.target_chunk)
        argmax = torch.zeros(B, T, dtype=torch.long, device=last.device)
        argmax[need] = argmax_rows
        row_of = torch.full((B, T), -1, dtype=torch.long, device=last.device)
        row_of[need] = torch.arange(probs.shape[0], device=last.device)
        return TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)

    def loss(self, model: Eagle3Model, batch: dict, target: Target) -> StepOutput:
        rows = self.target_rows(model, batch, target)
        h0 = model.fuse(batch["hidden_aux"])
        loss, stats = ttt_loss(model, h0, batch, rows, self.ttt_steps, self.step_decay, self.head_chunk)
        metrics = {}
        for i, s in enumerate(stats):
            metrics[f"step{i}_loss"] = float(s.loss)
            metrics[f"step{i}_acc"] = s.correct / s.total if s.total else 0.0
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, model: Eagle3Model, batch: dict, target: Target) -> dict[str, float]:
        """Per-step top-1 agreement with the target argmax on all assistant tokens (sums and counts)."""
        argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
        return unrolled_accuracy(model, model.fuse(batch["hidden_aux"]), batch, argmax, self.ttt_steps, self.head_chunk)

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_estimate`` from the per-step accuracies (and ``tau_joint``)."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training)."""
        from specheads.decoding.head_drafters import EagleDrafter

        return EagleDrafter(getattr(model, "module", model), shape, "eagle3")

    def save(self, model: Eagle3Model, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)


__all__ = ["Eagle3Config", "Eagle3Model", "Eagle3Method", "step_rows"]
