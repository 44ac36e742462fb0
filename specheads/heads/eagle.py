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

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from specheads.heads.layers import DraftDecoderLayer, KVCache, RotaryEmbedding, UnrollCache, draft_fields_from_target
from specheads.targets import Target
from specheads.training.losses import feature_loss, soft_cross_entropy, target_argmax, target_probs, uniform_noise
from specheads.training.method import FeatureSpec, StepOutput
from specheads.training.ttt import default_positions, shift_tokens, step_rows, summarize_steps, unrolled_accuracy


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
        self.__dict__["_embed"] = target.embed_tokens
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
        """(..., H) predicted feature -> (..., V_target) through the target's LM head."""
        self._need_target()
        return self._lm_head(h_out)

    def step(self, hidden, input_ids, position_ids, attn_mask=None, cache=None):
        """``decode`` then ``logits``: returns (h_out (B, q, H), logits (B, q, V_target))."""
        h_out = self.decode(hidden, input_ids, position_ids, attn_mask, cache)
        return h_out, self.logits(h_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def new_cache(self) -> KVCache:
        return KVCache(self.num_draft_layers)


class Eagle1Method:
    """EAGLE-1 training: smooth-L1 on the next feature + ``ce_weight`` x soft CE against the target.

    feature_weight / ce_weight: loss weights; noise_low / noise_high: uniform noise added to the
    input features in training; num_layers: drafter layers (1 in the paper and vLLM);
    eval_steps: unrolled steps scored by ``evaluate``; target_chunk / head_chunk: rows per chunk.
    """

    name = "eagle1"

    def __init__(self, feature_weight: float = 1.0, ce_weight: float = 0.1, noise_low: float = -0.1,
                 noise_high: float = 0.1, num_layers: int = 1, eval_steps: int = 5,
                 target_chunk: int = 1024, head_chunk: int = 1024):
        if noise_low > noise_high:
            raise ValueError(f"noise_low {noise_low} > noise_high {noise_high}")
        self.feature_weight, self.ce_weight = feature_weight, ce_weight
        self.noise_low, self.noise_high = noise_low, noise_high
        self.num_layers, self.eval_steps = num_layers, eval_steps
        self.target_chunk, self.head_chunk = target_chunk, head_chunk
        self.feature_spec = FeatureSpec(aux_layers=(), need_last=True)

    def build(self, target: Target) -> Eagle1Model:
        return Eagle1Model(Eagle1Config.from_target(target, self.num_layers)).to(target.device).attach(target)

    def loss(self, model: Eagle1Model, batch: dict, target: Target) -> StepOutput:
        last = batch["hidden_last"]
        ids = batch["input_ids"]
        h_in = uniform_noise(last, self.noise_low, self.noise_high) if model.training else last
        pred = model.decode(model.fuse(h_in), shift_tokens(ids, 1), default_positions(ids))
        b, t = step_rows(batch, 0)
        n = max(b.numel(), 1)
        true_next = last[b, t + 1]
        f_loss = feature_loss(pred[b, t], true_next) / n
        probs, argmax = target_probs(target.logits, true_next, None, self.target_chunk)
        ce_sum, draft_argmax = soft_cross_entropy(model.logits, pred[b, t], probs, chunk=self.head_chunk)
        ce = ce_sum / n
        loss = self.feature_weight * f_loss + self.ce_weight * ce + 0.0 * pred.sum()
        acc = float((draft_argmax == argmax).float().mean()) if b.numel() else 0.0
        return StepOutput(loss=loss, metrics={"feature_loss": float(f_loss.detach()), "ce_loss": float(ce.detach()),
                                               "step0_acc": acc})

    @torch.no_grad()
    def evaluate(self, model: Eagle1Model, batch: dict, target: Target) -> dict[str, float]:
        """Top-1 agreement with the target argmax at each of ``eval_steps`` unrolled steps (sums and counts)."""
        argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
        return unrolled_accuracy(model, model.fuse(batch["hidden_last"]), batch, argmax, self.eval_steps, self.head_chunk)

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_estimate`` from the per-step accuracies (and ``tau_joint``)."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training)."""
        from specheads.decoding.head_drafters import EagleDrafter

        return EagleDrafter(getattr(model, "module", model), shape, "eagle1")

    def save(self, model: Eagle1Model, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
