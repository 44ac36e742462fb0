"""DSpark: DFlash's block drafter plus a low-rank Markov head and a confidence head.

Following "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation"
(arXiv 2607.05147) in the form vLLM 0.32 loads it (``Qwen3DSparkModel``):

* **Backbone.** ``specheads.models.dflash.DFlashModel`` unchanged: one bidirectional forward over the block
  ``[anchor, mask x (B-1)]`` gives every slot's state ``h_j`` (slot ``j`` predicts the token at ``a+j``).
* **Markov head.** ``markov_w1`` (V, r) embeds the token before slot ``j`` (the anchor for slot 1, the token
  drafted in slot ``j-1`` after that) and ``markov_w2`` (V, r) maps that embedding to a bias on the slot's
  logits: ``logits_j = lm_head(norm(h_j)) + markov_w2 @ markov_w1[x_{j-1}]``. The block stays one parallel
  forward; only this rank-``r`` bias is applied left to right while drafting.
* **Confidence head.** ``confidence_head.proj`` (1, H + r) with bias: ``c_j = sigmoid(proj([norm(h_j);
  markov_w1[x_{j-1}]]))``, the predicted chance that slot ``j``'s draft is accepted given the earlier ones;
  ``prod_{i<=j} c_i`` is the chance that the chain reaches ``j`` (what a verification schedule reads).

``markov_w2`` starts at zero, so a fresh head (or one warm-started from a trained DFlash head's weights) drafts
exactly as its backbone does until training moves it. Parameter names are vLLM's (``markov_head.markov_w1``,
``markov_head.markov_w2``, ``confidence_head.proj``), so export is a validated copy.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.models.dflash import DFlashConfig, DFlashModel
from specheads.targets import Target

DEFAULT_MARKOV_RANK = 256
"""The paper's and vLLM's checkpoints' rank; a tiny target caps it at its hidden size."""


class DSparkConfig(DFlashConfig):
    """DFlash's fields plus markov_rank (r), markov_head_type (``vanilla``, the only kind vLLM's dense loader
    builds), enable_confidence_head and confidence_head_with_markov (the head reads ``[norm(h); W1[x_prev]]``)."""

    model_type = "specheads_dspark"
    markov_rank: int = DEFAULT_MARKOV_RANK
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    @classmethod
    def from_target(cls, target: Target, num_layers: int = 1, block_size: int = 16, aux_layers=None,
                    mask_token_id: int | None = None, markov_rank: int | None = None) -> "DSparkConfig":
        base = DFlashConfig.from_target(target, num_layers, block_size, aux_layers, mask_token_id).to_dict()
        for key in ("model_type", "transformers_version", "architectures"):
            base.pop(key, None)
        rank = min(DEFAULT_MARKOV_RANK, target.hidden_size) if markov_rank is None else int(markov_rank)
        return cls(**base, markov_rank=rank)


class DSparkMarkovHead(nn.Module):
    """Low-rank transition bias: token ids (...,) -> embedding (..., r) -> bias (..., V)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedding)


class DSparkConfidenceHead(nn.Module):
    """(..., H) post-norm states and (..., r) Markov embeddings -> (...,) confidence logits."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool = True):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, embedding.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkModel(DFlashModel):
    config_class = DSparkConfig
    base_model_prefix = "dspark"

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        if config.markov_head_type != "vanilla":
            raise ValueError(f"DSpark: markov_head_type {config.markov_head_type!r} is not built here (vanilla only)")
        if not 0 < int(config.markov_rank):
            raise ValueError(f"DSpark: markov_rank must be positive, got {config.markov_rank}")
        self.markov_head = DSparkMarkovHead(config.vocab_size, int(config.markov_rank))
        self.confidence_head = (DSparkConfidenceHead(config.hidden_size, int(config.markov_rank),
                                                     config.confidence_head_with_markov)
                                if config.enable_confidence_head else None)
        self.post_init()
        with torch.no_grad():
            self.markov_head.markov_w2.weight.zero_()

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """(...,) previous tokens -> (..., V) bias on the logits of the slot after them."""
        return self.markov_head.bias(self.markov_head.embed(prev_ids))

    def draft_logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm slot states and (...,) the token before each slot -> (..., V) float32 logits: the
        backbone's (the target's LM head) plus the Markov bias."""
        return self.logits(h).float() + self.markov_bias(prev_ids).float()

    def confidence(self, h: torch.Tensor, prev_ids: torch.Tensor, logit: bool = False) -> torch.Tensor:
        """(..., H) pre-norm slot states and (...,) previous tokens -> (...,) float32 confidence (the logit with
        ``logit=True``)."""
        if self.confidence_head is None:
            raise RuntimeError("this DSpark head has no confidence head (enable_confidence_head=false)")
        z = self.confidence_head(self.norm(h), self.markov_head.embed(prev_ids)).float()
        return z if logit else torch.sigmoid(z)
