"""M-RoPE for a drafter of a vision-language target (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each rotary frequency turns
by one of three position axes (temporal, height, width), as the target's language model does.

The axes are assigned per frequency by the config's ``rope_parameters["mrope_section"]`` ``[t, h, w]`` (summing
to ``head_dim / 2``): in order (Qwen2/2.5-VL: the first ``t`` frequencies by time, the next ``h`` by height, the
last ``w`` by width) or, with ``mrope_interleaved`` (Qwen3-VL), frequency ``j`` by height where ``j % 3 == 1`` and
``j < 3h``, by width where ``j % 3 == 2`` and ``j < 3w``, by time elsewhere. vLLM's draft (``get_rope`` with an
``mrope_section``) rotates the same way, from the target's 3-D positions the proposer hands it. The result is the
usual ``(cos, sin)`` pair of ``(B, T, head_dim)``, so ``apply_rotary_pos_emb`` applies it unchanged; positions of
``(B, T)`` (a text row: the three axes equal) rotate as plain RoPE.
"""

from __future__ import annotations

import torch
from torch import nn


def mrope_settings(config) -> tuple[list[int], bool] | None:
    """(mrope_section, interleaved) of a config whose rope settings name an ``mrope_section``, else None."""
    rope = getattr(config, "rope_parameters", None) or {}
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    if section is None:
        return None
    return [int(s) for s in section], bool(rope.get("mrope_interleaved", False))


def frequency_axes(section: list[int], interleaved: bool, half: int, device=None) -> torch.Tensor:
    """(half,) long: the position axis (0 time, 1 height, 2 width) each of the ``half = head_dim / 2`` rotary
    frequencies turns by."""
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {section} must hold 3 sizes summing to head_dim / 2 = {half}")
    if interleaved:
        axes = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                for j in range(half)]
    else:
        axes = [axis for axis, size in enumerate(section) for _ in range(size)]
    return torch.tensor(axes, dtype=torch.long, device=device)


class MRotaryEmbedding(nn.Module):
    """Rotary embedding by 3-D positions: ``forward(x, position_ids)`` with position_ids ``(B, T, 3)`` (or ``(B, T)``)
    -> (cos, sin) each ``(B, T, head_dim)`` in ``x``'s dtype. Only the default rope type (no scaling), the one the
    Qwen-VL families use."""

    def __init__(self, config):
        super().__init__()
        rope = config.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"M-RoPE drafts take the default rope type, got {rope.get('rope_type')!r}")
        self.section, self.interleaved = mrope_settings(config)
        self.theta, self.dim = float(rope["rope_theta"]), int(config.head_dim)
        self.axes()  # the section checked here, before any work
        # No buffers: from_pretrained builds modules on the meta device and leaves non-persistent buffers unset

    def axes(self, device=None) -> torch.Tensor:
        """(head_dim / 2,) the axis of each frequency (``frequency_axes``)."""
        return frequency_axes(self.section, self.interleaved, self.dim // 2, device or "cpu")

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 2:  # 1-D positions: every axis the same
            position_ids = position_ids[..., None].expand(*position_ids.shape, 3)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float, device=x.device) / self.dim))
        pos = position_ids.to(x.device).float().index_select(-1, self.axes(x.device))  # (B, T, head_dim / 2)
        freqs = pos * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotary_embedding(config) -> nn.Module:
    """The drafter's rotary embedding: M-RoPE where the config names an ``mrope_section``, else Llama's."""
    from specheads.models.layers import RotaryEmbedding

    return MRotaryEmbedding(config) if mrope_settings(config) else RotaryEmbedding(config)


def step_positions(position_ids: torch.Tensor, step: int) -> torch.Tensor:
    """The positions of draft step ``step`` from the step-0 positions ``(B, T)`` or ``(B, T, 3)``: ``+ step`` in 1-D;
    in 3-D the step-0 positions themselves, and after them the temporal position ``+ step`` on every axis (vLLM's
    proposer advances M-RoPE positions so; at a text token the three axes are equal anyway)."""
    if position_ids.dim() == 2:
        return position_ids + step
    if step == 0:
        return position_ids
    return (position_ids[..., :1] + step).expand_as(position_ids)
