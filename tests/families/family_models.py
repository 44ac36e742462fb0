"""Tiny random causal LMs of every popular architecture family, built from transformers' own config classes.

``make_family_model(family)`` gives a float32, eager-attention model of a few layers, hidden 64 and a
256-token vocabulary, with each family's distinctive parts switched on and made small: sliding windows of
``WINDOW`` tokens (so a test of a few dozen tokens crosses them), soft-capping (gemma2), attention sinks
(gpt_oss), multi-head latent attention with low ranks and mixtures of experts with a few experts
(deepseek_v3, qwen3_moe, mixtral, gpt_oss); DeepSeek's value heads are wider than its query/key heads, as in
the real model. Nothing is downloaded.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "phi3",
            "gpt_oss", "deepseek_v3")
WINDOW = 8  # sliding window (tokens) of the families that have one: every decode test crosses it
LAYERS = 3  # EAGLE-3 fuses three distinct layers, so three is the fewest that serve every method

_EXTRA = {
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mistral": dict(head_dim=16, sliding_window=WINDOW),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    "phi3": dict(sliding_window=WINDOW),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 128,
                                     "rope_theta": 150000.0}),
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24,
                        head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1),
}


def family_config(family: str, vocab: int = 256, hidden: int = 64, layers: int = LAYERS, heads: int = 4,
                  kv_heads: int = 2):
    """The transformers config of a tiny ``family`` model (eager attention)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    extra = dict(_EXTRA.get(family, {}))
    if "layer_types" in extra:
        extra["layer_types"] = extra["layer_types"][:layers]
    kwargs.update(extra)
    if family == "deepseek_v3":
        kwargs["num_key_value_heads"] = heads  # MLA: every head has its own (latent-decompressed) key and value
    config = AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "eager"
    return config


def make_family_model(family: str, seed: int = 0, dtype=torch.float32, **kw):
    """A randomly initialised ``*ForCausalLM`` of ``family`` (see ``family_config``), frozen, in eval mode.

    Random initialisation is near-uniform at this size; the attention and LM-head weights are scaled up so
    next-token distributions are peaked and depend on the context (greedy decoding then exercises the mask)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **kw), dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
        for name, p in model.named_parameters():
            if "self_attn" in name and name.endswith("weight") and p.dim() == 2 and "norm" not in name:
                p.mul_(4.0)
    return model.eval().requires_grad_(False)
