"""Grouped-query SDPA without a KV-cache copy: the same attention as transformers' SDPA, and no
``repeat_kv`` in a verify forward (which transformers' SDPA does for every forward over more than one
token with a mask)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from specheads.decoding.grouped_attention import ATTENTION_NAME, grouped_sdpa_attention, use_grouped_attention
from specheads.decoding.runner import TargetRunner


def _module(h: int, hkv: int, causal: bool) -> torch.nn.Module:
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = h // hkv, causal
    return module


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("q", [1, 5, 40])  # 40: past the folding limit (g*q > 2*Hkv*d), transformers' own path
def test_grouped_attention_matches_sdpa(mask_kind, q):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, h, hkv, d = 2, 6, 2, 8
    kv = q if mask_kind == "none" else q + 11  # no mask: causal over a prefill (SDPA aligns is_causal top-left)
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, hkv, kv, d), torch.randn(b, hkv, kv, d)
    allowed = torch.rand(b, 1, q, kv) > 0.3
    allowed[..., 0] = True
    mask = {"none": None, "bool": allowed,
            "additive": torch.zeros(b, 1, q, kv).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    module = _module(h, hkv, mask is None)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert got.shape == (b, q, h, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _verify_logits(model) -> torch.Tensor:
    r = TargetRunner(model)
    r.prefill([[3, 9, 27, 4, 11, 8, 20, 5, 1, 7]])
    return r.forward(torch.tensor([[4, 6, 2, 9, 1]]), torch.tensor([[-1, 0, 0, 1, 3]])).logits[0]


def test_a_verify_forward_copies_no_kv_cache(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    def no_copy(*args, **kwargs):
        raise AssertionError("repeat_kv copied the KV cache")

    model = make_tiny_model("llama", hidden=64, layers=2, heads=4, kv_heads=2)
    model.set_attn_implementation("sdpa")
    want = _verify_logits(model)
    monkeypatch.setattr(sdpa, "repeat_kv", no_copy)
    with pytest.raises(AssertionError, match="repeat_kv"):  # the control: transformers' SDPA copies
        _verify_logits(model)
    assert use_grouped_attention(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    torch.testing.assert_close(_verify_logits(model), want, atol=1e-5, rtol=1e-5)


def test_use_grouped_attention_leaves_other_models_alone():
    eager = make_tiny_model("llama", layers=1, heads=4, kv_heads=2)
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"
    mha = make_tiny_model("llama", layers=1, heads=4, kv_heads=4)
    mha.set_attn_implementation("sdpa")
    assert not use_grouped_attention(mha) and mha.config._attn_implementation == "sdpa"
