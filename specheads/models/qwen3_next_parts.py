"""The pieces of a Qwen3-Next / Qwen3.5 decoder layer that a Llama layer lacks, for the MTP block those targets ship
(``specheads.models.mtp``), written as transformers 5.x and vLLM 0.32 define them (transformers'
``modeling_qwen3_next.py`` / ``modeling_qwen3_5.py``; vLLM's ``qwen3_next.py``):

* ``OffsetRMSNorm``: RMSNorm whose weight is stored as an offset from one (``x / rms(x) * (1 + w)``, in float32,
  then cast back; initialised at zero), vLLM's ``GemmaRMSNorm``;
* ``PartialRotaryEmbedding`` / ``apply_partial_rotary``: RoPE on the first ``head_dim * partial_rotary_factor``
  channels of each head only (rotate-half style on that part), the rest passed through. Qwen3.5's multimodal
  RoPE sections reduce to this for text, whose three position streams are equal;
* ``GatedAttention``: grouped-query attention whose ``q_proj`` also yields a per-channel output gate (per head,
  ``[query | gate]`` halves of ``2 * head_dim``), an ``OffsetRMSNorm`` on each query and key head, partial RoPE,
  and the attention output multiplied by ``sigmoid(gate)`` before ``o_proj``;
* ``SparseMoE``: the routed experts (softmax router, top-k, renormalised when ``norm_topk_prob``) plus a shared
  expert scaled by ``sigmoid(shared_expert_gate(x))``; experts are named as in the checkpoints
  (``experts.{e}.{gate,up,down}_proj``), each a SwiGLU.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from specheads.models.layers import DraftAttention, DraftMLP, RotaryEmbedding


class OffsetRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PartialRotaryEmbedding(RotaryEmbedding):
    """cos/sin over the first ``head_dim * rope_parameters["partial_rotary_factor"]`` channels (default 1)."""

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs) -> tuple[torch.Tensor, float]:
        rope = config.rope_parameters
        dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: (B, heads, T, D); cos, sin: (B, T, d) with d <= D: RoPE on channels [0, d), the rest unchanged."""
    cos, sin, d = cos.unsqueeze(1), sin.unsqueeze(1), cos.shape[-1]

    def rot(x):
        return torch.cat([x[..., :d] * cos + _rotate_half(x[..., :d]) * sin, x[..., d:]], dim=-1)

    return rot(q), rot(k)


class GatedAttention(DraftAttention):
    """``DraftAttention`` with Qwen3-Next's output gate, query/key norms and partial RoPE (module doc)."""

    def __init__(self, config, input_size: int):
        super().__init__(config, input_size)
        self.q_proj = nn.Linear(input_size, 2 * self.num_heads * self.head_dim, bias=False)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, layer, attn_mask, cache):
        B, q_len, _ = x.shape
        q, gate = self.q_proj(x).view(B, q_len, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, k, cos, sin)
        out = self.attend(q, k, v, layer, attn_mask, cache)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, q_len, -1)))


def _expert(config, intermediate_size: int) -> DraftMLP:
    """A SwiGLU of the target's width with ``intermediate_size`` channels."""
    return DraftMLP(SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=intermediate_size,
                                    hidden_act=config.hidden_act, mlp_bias=False))


class SparseMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = int(config.num_experts_per_tok), bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(_expert(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = _expert(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weight, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weight[rows, slot, None].to(flat.dtype))
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)
