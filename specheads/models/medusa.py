"""Medusa heads (Cai et al., 2024): K extra LM heads on the target's last hidden state.

At position ``t`` the target's own LM head predicts ``ids[t+1]``; Medusa head ``k`` (from 0)
predicts ``ids[t+k+2]``. Head ``k`` is ``num_hidden_layers`` residual blocks
``x <- x + SiLU(W x + b)`` (W and b start at zero, so a head starts as the identity) followed by
its own output layer, initialised from the target's LM head.

Weight names follow vLLM's Medusa loader so export is a copy: ``blocks.{k}.layers.{j}.weight``
(``.bias`` when ``medusa_fc_bias``) and ``lm_heads.{k}.weight``. vLLM reads the block bias only
when the config says ``medusa_fc_bias: true``, so the key is always written.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class MedusaConfig(PretrainedConfig):
    """hidden_size/vocab_size: the target's; num_heads: K; num_hidden_layers: residual blocks per head.

    adapted_target: for Medusa-2, the folder (relative to the head folder) holding the adapted target
    that must verify these heads; None when the heads sit on the unchanged target.
    """

    model_type = "medusa"

    def __init__(self, hidden_size: int = 576, vocab_size: int = 49152, num_heads: int = 5,
                 num_hidden_layers: int = 1, truncated_vocab_size: int | None = None,
                 medusa_fc_bias: bool = True, target_name: str | None = None,
                 target_config_hash: str | None = None, adapted_target: str | None = None, **kwargs):
        if num_heads < 1 or num_hidden_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_hidden_layers >= 0, got "
                             f"{num_heads} and {num_hidden_layers}")
        if truncated_vocab_size is not None and truncated_vocab_size != vocab_size:
            raise NotImplementedError(f"truncated_vocab_size={truncated_vocab_size} < vocab_size={vocab_size}: "
                                      "truncated Medusa vocabularies are not supported; leave it unset")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_hidden_layers = num_hidden_layers
        self.truncated_vocab_size = vocab_size if truncated_vocab_size is None else truncated_vocab_size
        self.medusa_fc_bias = medusa_fc_bias
        self.target_name = target_name
        self.target_config_hash = target_config_hash
        self.adapted_target = adapted_target
        super().__init__(**kwargs)


class ResidualBlock(nn.Module):
    """``num_layers`` times ``x <- x + SiLU(linear(x))``: (..., H) -> (..., H)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.act = nn.SiLU()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero weights and biases: the block starts as the identity."""
        for layer in self.layers:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(PreTrainedModel):
    """K Medusa heads. ``forward(hidden_last (B, T, H)) -> logits (K, B, T, V)``."""

    config_class = MedusaConfig
    base_model_prefix = "medusa"
    _no_split_modules = ["ResidualBlock"]

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H, config.num_hidden_layers, config.medusa_fc_bias)
                                    for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Blocks start as the identity; output layers are overwritten by ``init_from_target``.
        if isinstance(module, ResidualBlock):
            module.reset_parameters()
        elif isinstance(module, nn.Linear) and module.out_features == self.config.vocab_size:
            nn.init.normal_(module.weight, std=0.02)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_hidden(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """(..., H) -> head k's hidden state after its residual blocks (..., H)."""
        return self.blocks[k](hidden)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """(..., H) -> head k's logits (..., V) for token ``t + k + 2``."""
        return self.lm_heads[k](self.blocks[k](hidden))

    def forward(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(B, T, H) post-norm last hidden state -> (K, B, T, V) logits."""
        return torch.stack([self.head_logits(hidden_last, k) for k in range(self.num_heads)])

    @torch.no_grad()
    def init_from_target(self, target) -> "MedusaHeads":
        """Copy the target's LM head into every head's output layer and record the target's identity."""
        w = target.lm_head.weight
        if tuple(w.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target LM head is {tuple(w.shape)}, heads expect "
                             f"({self.config.vocab_size}, {self.config.hidden_size})")
        if getattr(target.lm_head, "bias", None) is not None:
            raise ValueError("the target's LM head has a bias; Medusa output layers have none")
        for head in self.lm_heads:
            head.weight.copy_(w.to(head.weight.dtype))
        self.config.target_name = target.name
        self.config.target_config_hash = target.config_hash()
        return self


def medusa_for_target(target, num_heads: int = 5, num_layers: int = 1, bias: bool = True) -> MedusaHeads:
    """Fresh heads sized for ``target`` (float32, on the target's device), output layers copied from it."""
    config = MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=num_heads,
                          num_hidden_layers=num_layers, medusa_fc_bias=bias)
    return MedusaHeads(config).to(target.device).init_from_target(target)
