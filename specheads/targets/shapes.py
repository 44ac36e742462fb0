"""Targets of a real model's shape with random weights, for benchmarks at real sizes without a download.

``shape:NAME`` names a configuration whose numbers are kept here (copied from the public config.json of the model
it is named after); ``shape_target("shape:llama-3.2-1b", device="cuda")`` builds it with its weights initialised
on the device, in the dtype asked for, and wraps it as a ``Target`` without a tokenizer (benchmarks feed token
ids). Acceptance means nothing on random weights; time, memory and FLOPs are the real model's.

FLOPs per token are counted from the configuration (``forward_flops_per_token``): 2 per multiply-add of every
matrix a token goes through (attention projections, MLP, LM head; an MoE counts its active experts) plus the
attention scores and values over ``context`` earlier tokens (4 * layers * heads * head_dim * context).
"""

from __future__ import annotations

import torch

from specheads.errors import ConfigError

PREFIX = "shape:"

def _llama31_rope(factor: float) -> dict:
    """Llama 3.1's RoPE scaling (its configs differ in ``factor`` only)."""
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# model_type, then LlamaConfig-style fields; the numbers of each model's published config.json
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
                         rope_parameters=_llama31_rope(32.0)),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
                         rope_parameters=_llama31_rope(8.0)),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}


class ShapeError(ConfigError):
    """A ``shape:`` target that is not in ``SHAPES``."""


def is_shape(name: str) -> bool:
    return str(name).startswith(PREFIX)


def shape_config(name: str):
    """The transformers config of ``shape:NAME`` (or ``NAME``)."""
    from transformers import AutoConfig

    key = str(name).removeprefix(PREFIX)
    if key not in SHAPES:
        raise ShapeError(f"target '{name}': no such shape; known: {', '.join(PREFIX + k for k in SHAPES)}")
    fields = dict(SHAPES[key])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def shape_target(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
    """``shape:NAME`` with random weights made on ``device`` in ``dtype``, frozen, as a ``Target``."""
    from transformers import AutoModelForCausalLM

    from specheads.targets.model import Target

    config = shape_config(name)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target(model.eval().requires_grad_(False), None, name=str(name))


def parameter_count(config, embeddings: bool = True) -> int:
    """Parameters of a dense decoder of ``config`` (Llama/Qwen3 layout: q/k/v/o, SwiGLU, two norms a layer; the
    token embedding and, untied, the LM head)."""
    H, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    attn = H * D * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    qk_norm = 2 * D if config.model_type == "qwen3" else 0
    layer = attn + 3 * H * I + 2 * H + qk_norm
    head = 0 if getattr(config, "tie_word_embeddings", False) else V * H
    return L * layer + H + (V * H + head if embeddings else 0)


def forward_flops_per_token(config, context: int = 0, lm_head: bool = True) -> float:
    """FLOPs one token costs in a forward of ``config`` with ``context`` tokens before it (module doc)."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    matmuls = L * (H * D * (2 * heads + 2 * kv) + 3 * H * config.intermediate_size) + (V * H if lm_head else 0)
    return 2.0 * matmuls + 4.0 * L * heads * D * context
