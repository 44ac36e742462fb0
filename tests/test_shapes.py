"""shape: targets (a real model's shape with random weights): their configs give the published parameter counts,
FLOPs per token follow from the configuration, the GPU peaks are found by name, and a bad name is one line."""

from __future__ import annotations

import pytest
import torch

from specheads.hardware import peak_tflops
from specheads.targets.shapes import (ShapeError, forward_flops_per_token, parameter_count, shape_config,
                                      shape_target)


@pytest.mark.parametrize("name, billions", [("llama-3.2-1b", 1.236), ("llama-3.1-8b", 8.030), ("qwen3-8b", 8.191),
                                            ("smollm2-135m", 0.1345)])
def test_shapes_have_the_published_parameter_counts(name, billions):
    """Counted on transformers' own module built on the meta device (no memory), and by the formula."""
    from transformers import AutoModelForCausalLM

    config = shape_config("shape:" + name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    assert real == parameter_count(config)
    assert real / 1e9 == pytest.approx(billions, rel=2e-3)


def test_the_smollm2_shape_is_the_embedded_targets_config():
    from transformers import AutoConfig

    from specheads.targets import resolve_target_path

    real, shape = AutoConfig.from_pretrained(resolve_target_path("smollm2")), shape_config("shape:smollm2-135m")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(real, key) == pytest.approx(getattr(shape, key), rel=1e-6), key  # eps: a GGUF's float32
    assert real.rope_parameters["rope_theta"] == shape.rope_parameters["rope_theta"]


def test_forward_flops_are_two_per_multiply_add_plus_attention():
    config = shape_config("shape:smollm2-135m")
    matmul_params = parameter_count(config, embeddings=False) - config.num_hidden_layers * 2 * config.hidden_size \
        - config.hidden_size  # the norms do no matrix work
    lm_head = config.vocab_size * config.hidden_size
    assert forward_flops_per_token(config) == 2 * (matmul_params + lm_head)
    assert forward_flops_per_token(config, lm_head=False) == 2 * matmul_params
    attn = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 100
    assert forward_flops_per_token(config, context=100) == forward_flops_per_token(config) + attn


def test_a_shape_target_is_built_where_asked_in_the_dtype_asked():
    target = shape_target("shape:smollm2-135m", "cpu", torch.bfloat16)
    assert target.name == "shape:smollm2-135m" and target.dtype == torch.bfloat16
    assert target.hidden_size == 576 and target.vocab_size == 49152
    assert not any(p.requires_grad for p in target.model.parameters())


def test_an_unknown_shape_is_one_line_naming_the_known_ones():
    with pytest.raises(ShapeError) as e:
        shape_config("shape:llama-9")
    assert "\n" not in str(e.value) and "shape:llama-3.2-1b" in str(e.value)


def test_gpu_peaks_by_name_and_none_for_a_cpu():
    assert peak_tflops("NVIDIA H200", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert peak_tflops("cpu", "bfloat16") is None
