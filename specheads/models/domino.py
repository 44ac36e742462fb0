"""Domino: DFlash's block drafter plus a GRU over the block's earlier tokens and a residual logit correction.

Following "Domino" (arXiv 2605.29707) in the form NVIDIA ModelOpt trains it and SGLang's DFlash rollout serves it:

* **Backbone.** ``specheads.models.dflash.DFlashModel`` unchanged: one bidirectional forward over the block
  ``[anchor, mask x (B-1)]`` gives every slot's state ``h_k``.
* **Labels.** With ``shift_label`` (ModelOpt's default) slot ``k`` predicts the token at ``a+k+1`` and slot 0
  counts; without it slot ``k`` predicts ``a+k`` as in DFlash. Either way the slot that predicts ``x[a+m]`` is
  ``m - 1`` (shifted) or ``m``.
* **Prefix GRU.** ``prefix_gru`` (GRU H -> G, no biases) reads the **target's token embeddings** of the block's
  earlier tokens ``x[a], x[a+1], ...`` (teacher-forced in training, the drafted ones while drafting); its state
  after ``x[a..a+m-1]`` is ``g_m``.
* **Correction.** ``embed_proj`` = Linear(H+G -> E) . SiLU . Linear(E -> V), no biases. The slot that predicts
  ``x[a+m]`` has logits ``lm_head(norm(h)) + embed_proj([norm(h); g_m])`` from slot ``suffix_start`` on
  (``pure_draft_prefix_len`` shifted, ``1 + pure_draft_prefix_len`` not), the backbone's alone before it: the
  first drafted token is DFlash's own.

Parameter names are ModelOpt's export (``prefix_gru.weight_ih_l0`` [3G, H], ``prefix_gru.weight_hh_l0`` [3G, G],
``embed_proj.0.weight`` [E, H+G], ``embed_proj.2.weight`` [V, E]) beside DFlash's.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.models.dflash import DFlashConfig, DFlashModel
from specheads.targets import Target

DEFAULT_GRU_HIDDEN = 1024
DEFAULT_EMB_DIM = 256
"""ModelOpt's and the published checkpoint's G and E; a tiny target caps both at its hidden size."""


class DominoConfig(DFlashConfig):
    """DFlash's fields plus gru_hidden_dim (G), emb_dim (E), pure_draft_prefix_len (the drafted tokens before the
    first corrected one) and shift_label (slot k predicts a+k+1; written explicitly: the trainers' defaults
    differ)."""

    model_type = "specheads_domino"
    gru_hidden_dim: int = DEFAULT_GRU_HIDDEN
    emb_dim: int = DEFAULT_EMB_DIM
    pure_draft_prefix_len: int = 1
    shift_label: bool = True

    @classmethod
    def from_target(cls, target: Target, num_layers: int = 1, block_size: int = 16, aux_layers=None,
                    mask_token_id: int | None = None, gru_hidden_dim: int | None = None, emb_dim: int | None = None,
                    pure_draft_prefix_len: int = 1, shift_label: bool = True) -> "DominoConfig":
        base = DFlashConfig.from_target(target, num_layers, block_size, aux_layers, mask_token_id).to_dict()
        for key in ("model_type", "transformers_version", "architectures"):
            base.pop(key, None)
        H = target.hidden_size
        G = min(DEFAULT_GRU_HIDDEN, H) if gru_hidden_dim is None else int(gru_hidden_dim)
        E = min(DEFAULT_EMB_DIM, H) if emb_dim is None else int(emb_dim)
        return cls(**base, gru_hidden_dim=G, emb_dim=E, pure_draft_prefix_len=int(pure_draft_prefix_len),
                   shift_label=bool(shift_label))


class DominoModel(DFlashModel):
    config_class = DominoConfig
    base_model_prefix = "domino"

    def __init__(self, config: DominoConfig):
        super().__init__(config)
        H, G, E = config.hidden_size, int(config.gru_hidden_dim), int(config.emb_dim)
        if min(G, E) < 1 or int(config.pure_draft_prefix_len) < 0:
            raise ValueError(f"Domino: gru_hidden_dim {G} and emb_dim {E} must be positive, pure_draft_prefix_len "
                             f"{config.pure_draft_prefix_len} non-negative")
        self.prefix_gru = nn.GRU(H, G, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(H + G, E, bias=False), nn.SiLU(),
                                        nn.Linear(E, config.vocab_size, bias=False))
        self.post_init()

    @property
    def shift_label(self) -> bool:
        return bool(self.config.shift_label)

    @property
    def suffix_start(self) -> int:
        """The first slot whose logits are corrected."""
        return int(self.config.pure_draft_prefix_len) + (0 if self.shift_label else 1)

    @property
    def first_slot(self) -> int:
        """The slot that predicts the token right after the anchor (0 shifted, 1 not)."""
        return 0 if self.shift_label else 1

    def gru_states(self, token_ids: torch.Tensor, state: torch.Tensor | None = None):
        """(N, L) tokens -> ((N, L, G) the GRU state after each, (1, N, G) the last), from ``state`` (None: zero).
        Token ``i``'s state has read tokens ``0..i`` only."""
        x = self.embed(token_ids).to(self.prefix_gru.weight_ih_l0.dtype)
        return self.prefix_gru(x, state)

    def correction(self, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm slot states and (..., G) GRU states -> (..., V) float32 residual logits."""
        x = torch.cat([self.norm(h), g.to(h.dtype)], -1).to(self.embed_proj[0].weight.dtype)
        return self.embed_proj(x).float()

    def draft_logits(self, h: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """(..., H) slot states -> (..., V) float32 logits: the backbone's, plus the correction where ``g`` (the
        GRU state over the tokens before the slot's) is given."""
        base = self.logits(h).float()
        return base if g is None else base + self.correction(h, g)

    def block_logits(self, h: torch.Tensor, prefix_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: (N, B, H) block states and (N, B) the tokens ``x[a], x[a+1], ...`` -> (N, B, V) float32
        logits of every slot, the correction from ``suffix_start`` on (slot k reads the GRU over the tokens up to
        the one before its own)."""
        out = self.logits(h).float()
        s = self.suffix_start
        if s >= h.shape[1]:
            return out
        g, _ = self.gru_states(prefix_ids[:, : h.shape[1] - self.first_slot])
        lo = s - self.first_slot  # slot k predicts x[a+k+1-first_slot]: the GRU state after x[a+k-first_slot]
        return torch.cat([out[:, :s], out[:, s:] + self.correction(h[:, s:], g[:, lo:])], dim=1)
